"""The server's limits and their defaults, in one place with no heavy imports, so that `draftwise serve --help`
shows them without loading FastAPI. docs/server.md "Running it safely" lists the same values.

Owns only numbers: validation.py enforces the per-request ones, runner.py / app.py the admission ones,
shutdown.py the shutdown timeout, cli.py turns each into a flag.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a request body (413 above)
DEFAULT_MAX_WAITING = 64  # requests queued beyond the KV slots before a 429
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # a request's deadline, queueing included (504, or an error event)
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # on SIGTERM: how long requests in flight may still run


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request (each a `draftwise serve` option), all checked before anything is tokenized."""

    max_stop_strings: int = 16  # entries in `stop` (OpenAI allows 4)
    max_stop_length: int = 256  # characters in one stop string
    max_stop_token_ids: int = 64  # entries in `stop_token_ids`
    max_prompt_chars: int = 262_144  # prompt text (all message contents for chat)
    max_json_depth: int = 32  # nesting of objects and arrays in the body
