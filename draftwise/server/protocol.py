"""OpenAI request and response shapes for /v1/completions and /v1/chat/completions.

Owns validation of the JSON a client sends (pydantic, strict types: "0.5" is not a number, true is not an
integer), the mapping onto draftwise SamplingParams (structured outputs included: OpenAI's `response_format`,
vLLM's `structured_outputs` and `guided_*`, read by structured/constraint.py; a bad schema, regex or grammar is a 400
with its message), and building response / SSE chunk dicts. Knows nothing of the engine or its thread; sizes
come in as arguments.
"""
from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftwise.config import ConfigError
from draftwise.sampling import SamplingParams
from draftwise.server.errors import APIError
from draftwise.server.validation import check_fields
from draftwise.structured.constraint import from_request

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
# Fields declared below are implemented; every other OpenAI / vLLM field is accepted only at its neutral value
# (validation.NEUTRAL_FIELDS) and refused with a 400 naming it otherwise, as is a field nobody defines.
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")  # developer is rendered as system (OpenAI)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class DraftwiseOptions(BaseModel):
    """The request's `draftwise` extension (off by default; plain OpenAI clients never send it): `provenance`
    adds per-token provenance to streamed chunks (server/provenance.py), `speculation: false` decodes this
    request plainly. Unknown keys are refused, so a typo is a 400 naming the field, not a silent no-op."""

    model_config = ConfigDict(strict=True, extra="forbid")
    provenance: bool = False
    speculation: bool = True


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    draftwise: DraftwiseOptions = Field(default_factory=DraftwiseOptions)  # draftwise extension (see above)
    # structured outputs (structured/constraint.py reads them; at most one may constrain the output)
    response_format: dict | None = None  # OpenAI: {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict | None = None  # vLLM: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: dict | str | None = None  # vLLM's older extras
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None  # passed to the chat template, which may render it


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # vLLM extension
    continue_final_message: bool = False  # vLLM extension: the model continues the last message


def parse(model_cls: type[BaseModel], body: object) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(x) for x in err["loc"]) or "body"
        raise APIError(400, f"{where}: {err['msg']}", param=param) from None
    check_fields(req.model_extra or {}, "chat" if isinstance(req, ChatRequest) else "completion")
    for i, m in enumerate(getattr(req, "messages", ())):
        check_fields(m.model_extra or {}, "message", where=f"messages.{i}.")
    return req


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """One prompt: text or token ids (a batch of one is unwrapped; larger batches are refused)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, "only one prompt per request is supported (send several requests instead)",
                           param="prompt")
        p = p[0]
    if isinstance(p, str) and not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(p, list) and not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return p


def chat_messages(req: ChatRequest) -> list[dict]:
    """Messages as plain {role, content[, name]} dicts for the chat template. Known roles only; `developer` is
    rendered as `system` (as OpenAI treats it); text parts are joined with "\n" (as vLLM does); other parts,
    tool messages and assistant tool calls are refused (this server does no tool calling), never dropped."""
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise APIError(400, f"messages.{i}.role: unknown role {m.role!r} (expected one of "
                                f"{', '.join(CHAT_ROLES)})", param="messages")
        if m.role == "tool" or (m.model_extra or {}).get("tool_calls"):
            raise APIError(400, f"messages.{i}: tool messages and tool calls are not supported (this server does "
                                f"no tool calling)", param="messages")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages.{i}.content: only text content parts are supported, got type "
                                        f"{str(part.get('type'))[:40]!r}", param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "\n".join(texts)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def sampling_params(req: _Common, max_tokens_default: int) -> SamplingParams:
    if req.n not in (None, 1):
        raise APIError(400, f"only n=1 is supported, got n={req.n}", param="n")
    max_tokens = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    kw = dict(max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
              temperature=1.0 if req.temperature is None else req.temperature,
              top_p=1.0 if req.top_p is None else req.top_p,
              top_k=0 if req.top_k is None else req.top_k,
              seed=req.seed, stop=req.stop or [],
              stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
              include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens)
    fields = {f: getattr(req, f) for f in _STRUCTURED}
    try:
        kw["structured_outputs"] = from_request(fields)  # checked by the grammar engine: the message names it
    except ConfigError as e:
        raise APIError(400, str(e), param=next((f for f in _STRUCTURED if fields[f] is not None), None)) from None
    try:
        return SamplingParams(**kw)
    except ConfigError as e:
        word = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=word if word in kw else None) from None


_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_whitespace_pattern")


# ---- responses ------------------------------------------------------------------------------------
def usage(out) -> dict:  # out: api.RequestOutput
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens taken from the prefix cache."""
    num_prompt, num_output = len(out.prompt_token_ids), out.num_output_tokens
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


class ResponseFormat:
    """Response bodies and SSE chunks for one request, completion or chat flavoured."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def body(self, text: str, finish_reason: str | None, use: dict, extra: dict) -> dict:
        """The whole (non-streaming) response; `extra` goes under a `draftwise` key clients may ignore."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": use, "draftwise": extra}

    def first_chunks(self, include_usage: bool) -> list[dict]:
        """Chat streams open with the assistant role (as OpenAI's do); completions have no preamble."""
        if not self.chat:
            return []
        return [self._chunk([self._choice({"role": "assistant", "content": ""}, None)], include_usage)]

    def chunk(self, text: str, finish_reason: str | None, include_usage: bool, extension: dict | None = None) -> dict:
        """One chunk; `extension` (token provenance, asked for by the request) goes under a `draftwise` key."""
        payload = ({"content": text} if text else {}) if self.chat else text
        out = self._chunk([self._choice(payload, finish_reason)], include_usage)
        if extension is not None:
            out["draftwise"] = extension
        return out

    def usage_chunk(self, use: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, just usage."""
        return self._chunk([], True, use)

    def _choice(self, payload, finish_reason: str | None) -> dict:
        key = "delta" if self.chat else "text"
        return {"index": 0, key: payload, "logprobs": None, "finish_reason": finish_reason}

    def _chunk(self, choices: list[dict], include_usage: bool, use: dict | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if include_usage:  # OpenAI sends "usage": null on every chunk but the last when usage is asked for
            out["usage"] = use
        return out
