"""Request hardening before anything is tokenized: strict JSON, size limits, and the field policy.

Owns (1) `loads`: the body as JSON, refusing NaN/Infinity constants, nesting deeper than a limit and strings
that are not valid Unicode (lone surrogates), each a 400; (2) `check_limits`: the caps of limits.RequestLimits on
stop strings, stop ids and prompt characters; (3) `check_fields`: every field of OpenAI's and
vLLM's completion/chat requests that draftwise does not implement is accepted only at its neutral value
(`best_of: 1`, `echo: false`, `suffix: ""`, ...) and refused with a 400 naming it
otherwise; a field nobody defines is refused too. Implemented fields are pydantic fields in protocol.py.
Knows nothing of the engine, tokenizers or HTTP; runs in the server's worker pool, off the event loop.
"""
from __future__ import annotations

import json

from draftwise.server.errors import APIError
from draftwise.server.limits import RequestLimits

__all__ = ["RequestLimits", "check_fields", "check_limits", "loads"]


# ---- strict JSON ---------------------------------------------------------------------------------------
def loads(body: bytes, max_depth: int) -> object:
    """Decode a request body: strict JSON (no NaN/Infinity), at most `max_depth` levels, valid Unicode only."""

    def no_constants(name: str):
        raise APIError(400, f"malformed JSON in the request body: {name} is not a JSON number")

    try:
        obj = json.loads(body, parse_constant=no_constants)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {max_depth} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}") from None
    _check_tree(obj, max_depth)
    return obj


def _check_tree(obj: object, max_depth: int) -> None:
    """Iteratively: nesting depth, and every string (keys too) encodable as UTF-8 (a lone surrogate is not)."""
    stack = [(obj, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > max_depth:
                raise APIError(400, f"the request body nests deeper than {max_depth} levels",
                               param=_param(path))
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in items:
                if isinstance(key, str):
                    _check_str(key, path, key=True)  # before the key joins a path that error messages print
                stack.append((value, depth + 1, path + (key,)))
        elif isinstance(node, str):
            _check_str(node, path)


def _check_str(s: str, path: tuple, key: bool = False) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        where = ".".join(str(p) for p in path) or "body"
        what = f"a key in {where}" if key else where
        raise APIError(400, f"{what}: the string is not valid Unicode (a lone UTF-16 surrogate)",
                       param=_param(path)) from None


def _param(path: tuple) -> str | None:
    return str(path[0]) if path else None


# ---- limits --------------------------------------------------------------------------------------------
def check_limits(req, limits: RequestLimits) -> None:
    """Stop strings, stop ids and prompt characters against the limits (a 400 naming the field)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop_strings:
        raise APIError(400, f"stop: at most {limits.max_stop_strings} stop strings are allowed, got {len(stop)}",
                       param="stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_length:
        raise APIError(400, f"stop: a stop string may have at most {limits.max_stop_length} characters, got "
                            f"{longest}", param="stop")
    ids = req.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise APIError(400, f"stop_token_ids: at most {limits.max_stop_token_ids} ids are allowed, got {len(ids)}",
                       param="stop_token_ids")
    if hasattr(req, "messages"):
        field, chars = "messages", sum(_content_chars(m.content) for m in req.messages)
    else:
        field, prompt = "prompt", req.prompt
        chars = len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt if isinstance(p, str))
    if chars > limits.max_prompt_chars:
        raise APIError(400, f"{field}: the prompt has {chars} characters, more than the limit of "
                            f"{limits.max_prompt_chars}", param=field, code="context_length_exceeded")


def _content_chars(content) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text")) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


# ---- field policy ---------------------------------------------------------------------------------------
def _values(*accepted):
    """A check accepting exactly these values; types matter (false is not 0), but 1 and 1.0 are the same."""

    def same(v, a) -> bool:
        numbers = {int, float}
        return v == a and (type(v) is type(a) or {type(v), type(a)} <= numbers)

    return lambda v: any(same(v, a) for a in accepted), " or ".join(json.dumps(a) for a in accepted)


def _typed(*types):
    """Any value of these JSON types (fields that change nothing here, e.g. `user`, `metadata`)."""
    return (lambda v: v is None or (type(v) in types)), "any " + "/".join(t.__name__ for t in types)


_OFF = _values(None)
# fields both endpoints share: OpenAI's and vLLM's sampling extras
_BOTH = {
    "best_of": _values(None, 1), "use_beam_search": _values(None, False), "length_penalty": _values(None, 1),
    # structured outputs are implemented (protocol.py fields); llguidance is the one backend, whatever is named
    "guided_decoding_backend": _typed(str), "structural_tag": _OFF,
    "prompt_logprobs": _OFF, "allowed_token_ids": _OFF, "bad_words": _values(None, []),
    "truncate_prompt_tokens": _OFF, "spaces_between_special_tokens": _values(None, True),
    "logits_processors": _OFF, "return_tokens_as_token_ids": _values(None, False),
    "return_token_ids": _values(None, False), "priority": _values(None, 0), "kv_transfer_params": _OFF,
    "vllm_xargs": _OFF, "echo": _values(None, False), "store": _values(None, False),
    "service_tier": _values(None, "auto", "default"),
    # hints that change nothing here, accepted with any value of their type
    "request_id": _typed(str), "cache_salt": _typed(str), "metadata": _typed(dict),
    "prompt_cache_key": _typed(str), "safety_identifier": _typed(str),
}
_CHAT = dict(_BOTH, **{
    "functions": _values(None, []), "function_call": _values(None, "none", "auto"),
    "modalities": _values(None, ["text"]), "audio": _OFF, "prediction": _OFF, "web_search_options": _OFF,
    "reasoning_effort": _OFF, "verbosity": _OFF, "chat_template": _OFF, "chat_template_kwargs": _values(None, {}),
    "documents": _OFF, "mm_processor_kwargs": _OFF, "include_reasoning": _values(None, True),
    "add_special_tokens": _values(None, False),
})
_COMPLETION = dict(_BOTH, **{
    "top_logprobs": _values(None, 0), "suffix": _values(None, ""), "add_special_tokens": _values(None, True),
    "prompt_embeds": _OFF,
})
# chat message fields beyond role/content/name
_MESSAGE = {"function_call": _OFF, "refusal": _OFF, "audio": _OFF}
NEUTRAL_FIELDS = {"chat": _CHAT, "completion": _COMPLETION, "message": _MESSAGE}  # for docs and tests


def check_fields(extra: dict, kind: str, where: str = "") -> None:
    """`extra`: the body's fields that are not implemented (pydantic's model_extra). Each must be a known field
    at its neutral value; `kind` is "chat", "completion" or "message" (`where` prefixes a message's path)."""
    table = NEUTRAL_FIELDS[kind]
    for key, value in extra.items():
        name = f"{where}{key}"
        param = name.split(".", 1)[0]
        if key not in table:
            raise APIError(400, f"{name}: unknown field (not part of this endpoint's request)", param=param)
        ok, accepted = table[key]
        if not ok(value):
            raise APIError(400, f"{name} is not supported by this server (accepted: {accepted})", param=param)
