"""`draftwise serve`: load the model, build the app, run uvicorn.

Owns the serve flags and the one environment read of the server (DRAFTWISE_API_KEY, when --api-key is not
given); everything below receives plain values.
"""
from __future__ import annotations

import os

from draftwise.cli_args import add_model_args, llm_from_args

API_KEY_ENV = "DRAFTWISE_API_KEY"


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: local only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV})")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body accepted (413 above)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def resolve_api_key(flag: str | None, environ) -> str | None:
    """--api-key wins; else $DRAFTWISE_API_KEY; an empty value means no key."""
    return flag or environ.get(API_KEY_ENV) or None


def cmd_serve(args) -> int:
    import uvicorn

    from draftwise.server.app import DEFAULT_MAX_BODY_BYTES, create_app

    api_key = resolve_api_key(args.api_key, os.environ)
    llm = llm_from_args(args)
    app = create_app(llm, args.served_model_name or args.model, api_key=api_key,
                     max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    spec = llm.spec_config
    print(f"draftwise: serving {args.model!r} on http://{args.host}:{args.port}/v1 "
          f"(speculation: {spec.method}, max_num_seqs {args.max_num_seqs}, context {llm.max_model_len}, "
          f"api key {'required' if api_key else 'off'}); loaded in {llm.load_time_s:.1f}s", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
