"""Command line: argparse (dashes) → config values (underscores) → api / server / bench.

Owns argument parsing, printing and exit codes; user errors (ConfigError and friends) print one line on stderr
and exit 2 without a traceback. The work itself lives in the modules each sub-command calls.
"""
from __future__ import annotations

import argparse
import json
import sys

from draftwise.config import WEIGHT_FORMATS, ConfigError

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def add_model_args(p: argparse.ArgumentParser, spec: bool = True) -> None:
    p.add_argument("--model", default=DEFAULT_TARGET, help="catalog name, .gguf file, HF checkpoint dir or hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--weights", default=None, choices=list(WEIGHT_FORMATS),
                   help="weight-only quantization of the target's linear layers")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="engine seed (requests without their own seed derive from it)")
    if spec:
        p.add_argument("--speculative-config", default=None,
                       help='vLLM-style JSON, e.g. \'{"method":"ngram","num_speculative_tokens":5}\'')


def llm_from_args(args, **overrides):
    from draftwise.api import LLM

    kw = dict(model=args.model, dtype=args.dtype, device=args.device, weights=args.weights, threads=args.threads,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=args.seed,
              speculative_config=getattr(args, "speculative_config", None))
    kw.update(overrides)
    return LLM(**kw)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--request-seed", dest="request_seed", type=int, default=None,
                   help="per-request sampling seed (default: derived from --seed)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args):
    from draftwise.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.request_seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)


# ---- generate -----------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    if (args.prompt is None) == (args.messages is None):
        raise ConfigError("give exactly one of --prompt TEXT or --messages JSON")
    params = sampling_from_args(args)
    llm = llm_from_args(args)
    if args.messages is not None:
        try:
            messages = json.loads(args.messages)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--messages is not valid JSON: {e}") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ConfigError('--messages must be a JSON list of {"role": ..., "content": ...} objects')
        prompt = {"prompt_token_ids": llm.tokenizer.encode_chat(messages)}
    else:
        prompt = args.prompt
    final = None
    for item in llm.stream(prompt, params):
        if isinstance(item, str):
            if not args.json:
                sys.stdout.write(item)
                sys.stdout.flush()
        else:
            final = item
    if args.json:
        out = final.outputs[0]
        print(json.dumps({
            "text": out.text, "prompt_ids": final.prompt_token_ids, "output_ids": out.token_ids,
            "num_prompt_tokens": len(final.prompt_token_ids), "num_output_tokens": len(out.token_ids),
            "ttft_s": final.ttft_s, "total_s": final.total_s, "tokens_per_s": final.tokens_per_s,
            "finish_reason": out.finish_reason, "spec": final.spec,
        }))
    else:
        sys.stdout.write("\n")
    return 0


def cmd_models(args) -> int:
    from draftwise.config import default_cache_dir
    from draftwise.models.catalog import list_models

    rows = list_models(default_cache_dir())
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        status = "assembled" if r["assembled"] else "installed" if r["installed"] else "not installed"
        print(f"{r['name']:30s} {r['architecture']:7s} {r['size'] / 1e9:5.2f} GB  {status:13s} {r['description']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftwise", description="Local LLM engine with speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt (streams; --json for one JSON object)")
    add_model_args(g)
    g.add_argument("--prompt", default=None)
    g.add_argument("--messages", default=None, help='chat messages as JSON: [{"role":"user","content":"..."}]')
    add_sampling_args(g)
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list the packaged models and what is installed")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    for register in _optional_commands():
        register(sub)
    return ap


def _optional_commands():
    """Sub-commands that live with their subsystem (server, bench, verify, ...)."""
    import importlib

    for mod in ("draftwise.equivalence", "draftwise.server.cli", "draftwise.bench.cli"):
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod or mod.startswith(str(e.name)):
                continue
            raise
        yield module.register


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
