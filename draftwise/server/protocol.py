"""OpenAI request and response shapes for /v1/completions and /v1/chat/completions.

Owns validation of the JSON a client sends (pydantic, strict types: "0.5" is not a number, true is not an
integer), the mapping onto draftwise SamplingParams (structured outputs included: OpenAI's `response_format`,
vLLM's `structured_outputs` and `guided_*`, read by structured/constraint.py; a bad schema, regex or grammar is a 400
with its message), chat messages for the template (tool results and earlier tool calls included; tools.py reads
`tools` / `tool_choice`), and building response / SSE chunk dicts (n choices, logprobs, tool calls). Knows
nothing of the engine or its thread; sizes and token texts come in as arguments.
"""
from __future__ import annotations

import json
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftwise.config import ConfigError
from draftwise.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob
from draftwise.server.errors import APIError
from draftwise.server.validation import check_fields
from draftwise.structured.constraint import from_request

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_N = 16  # samples per request (each takes a KV slot of its own once its prompt is in)
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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    min_tokens: int | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
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
    logprobs: int | None = None  # top alternatives per token (0: the chosen token's only)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None  # passed to the chat template, which may render it
    tool_calls: list[dict] | None = None  # an assistant's earlier calls: [{"id", "type", "function": {...}}]
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None  # tools.py checks them
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
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
    """Messages as plain {role, content[, name, tool_calls, tool_call_id]} dicts for the chat template. Known
    roles only; `developer` is rendered as `system` (as OpenAI treats it); text parts are joined with "\n" (as
    vLLM does); other parts are refused, never dropped. Tool calls only on assistant messages, each
    {"id", "type": "function", "function": {"name", "arguments": JSON string}}."""
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise APIError(400, f"messages.{i}.role: unknown role {m.role!r} (expected one of "
                                f"{', '.join(CHAT_ROLES)})", param="messages")
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                           param="messages")
        for j, c in enumerate(m.tool_calls or ()):
            f = c.get("function")
            if (c.get("type", "function") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str)
                    or not isinstance(f.get("arguments", ""), str)):
                raise APIError(400, f"messages.{i}.tool_calls.{j}: expected {{\"id\", \"type\": \"function\", "
                                    f"\"function\": {{\"name\": str, \"arguments\": str}}}}", param="messages")
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
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def sampling_params(req: _Common, max_tokens_default: int, constraint=None) -> SamplingParams:
    """The request's SamplingParams; `constraint`: what tool_choice puts on the output (instead of a
    response_format: both at once is a 400)."""
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in 1..{MAX_N}, got {req.n}", param="n")
    max_tokens = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    kw = dict(max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
              temperature=1.0 if req.temperature is None else req.temperature,
              top_p=1.0 if req.top_p is None else req.top_p,
              top_k=0 if req.top_k is None else req.top_k,
              seed=req.seed, stop=req.stop or [],
              stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
              include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
              n=req.n or 1, logprobs=_logprobs(req))
    kw.update({f: getattr(req, f) for f in _CONTROLS if getattr(req, f) is not None})
    fields = {f: getattr(req, f) for f in _STRUCTURED}
    try:
        kw["structured_outputs"] = from_request(fields)  # checked by the grammar engine: the message names it
    except ConfigError as e:
        raise APIError(400, str(e), param=next((f for f in _STRUCTURED if fields[f] is not None), None)) from None
    if constraint is not None:
        if kw["structured_outputs"] is not None:
            raise APIError(400, "tool_choice required or a named function cannot be combined with a "
                                "response_format / structured output constraint", param="tool_choice")
        kw["structured_outputs"] = constraint
    try:
        return SamplingParams(**kw)
    except ConfigError as e:
        word = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=word if word in kw else None) from None


_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_whitespace_pattern")
_CONTROLS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias")


def _logprobs(req: _Common) -> int | None:
    """SamplingParams.logprobs: chat's `logprobs: true` + `top_logprobs`, completions' `logprobs: <int>`."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in 0..{MAX_LOGPROBS}", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


# ---- responses ------------------------------------------------------------------------------------
_TEXT_MARK = "\u0001draftwise-text\u0001"  # ResponseFormat.text_line's stand-in for a chunk's text


def sse_line(obj: dict) -> str:
    """One server-sent event of a JSON chunk."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(out) -> dict:  # out: api.RequestOutput
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens taken from the prefix cache."""
    num_prompt, num_output = len(out.prompt_token_ids), out.num_output_tokens
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


class ResponseFormat:
    """Response bodies and SSE chunks for one request, completion or chat flavoured; `token_text(id)` spells a
    token for logprobs."""

    def __init__(self, chat: bool, model: str, token_text=None):
        self.chat, self.model, self.token_text = chat, model, token_text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self._text_lines: dict[tuple[int, bool], tuple[str, str] | None] = {}  # text_line's (head, tail) per key

    def body(self, choices: list[dict], use: dict, extra: dict) -> dict:
        """The whole (non-streaming) response from `choice`s; `extra` goes under a `draftwise` key clients may
        ignore."""
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": use, "draftwise": extra}

    def choice(self, index: int, text: str | None, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None = None, tool_calls: list[dict] | None = None) -> dict:
        """One choice of a whole response (chat: a message, with `tool_calls` when the model called tools)."""
        lp = self.logprobs(logprobs)
        if not self.chat:
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish_reason}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's logprobs object: chat's {"content": [{token, logprob, bytes, top_logprobs}]}, completions'
        {tokens, token_logprobs, top_logprobs (the chosen token and the top ones, as vLLM), text_offset}."""
        if entries is None:
            return None
        spell = self.token_text
        if self.chat:
            def one(tid, lp):
                t = spell(tid)
                return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

            return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(i, v) for i, v in e.top])
                                for e in entries]}
        tokens = [spell(e.token_id) for e in entries]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{**{spell(i): v for i, v in e.top}, t: e.logprob} for e, t in zip(entries, tokens)],
                "text_offset": offsets}

    def first_chunks(self, include_usage: bool, n: int = 1) -> list[dict]:
        """Chat streams open with the assistant role for each choice (as OpenAI's do); completions have none."""
        if not self.chat:
            return []
        return [self._chunk([self._choice(i, {"role": "assistant", "content": ""}, None)], include_usage)
                for i in range(n)]

    def chunk(self, text: str, finish_reason: str | None, include_usage: bool, extension: dict | None = None,
              index: int = 0, logprobs: list[TokenLogprob] | None = None, tool_calls: list[dict] | None = None) -> dict:
        """One chunk of choice `index`; `extension` (token provenance, asked for by the request) goes under a
        `draftwise` key; `tool_calls`: OpenAI's delta pieces (chat)."""
        if self.chat:
            payload = {"content": text} if text else {}
            if tool_calls:
                payload["tool_calls"] = tool_calls
        else:
            payload = text
        out = self._chunk([self._choice(index, payload, finish_reason, self.logprobs(logprobs))], include_usage)
        if extension is not None:
            out["draftwise"] = extension
        return out

    def text_line(self, text: str, include_usage: bool, index: int = 0) -> str:
        """The SSE line of a chunk that carries only `text` (no finish, logprobs, provenance or tool calls) — the
        same characters as sse_line(self.chunk(text, None, include_usage, index=index)), with the JSON around the
        text built once per (index, include_usage) and only the text encoded per call (one per stream per step)."""
        key = (index, include_usage)
        parts = self._text_lines.get(key, False)
        if parts is False:  # split the full chunk of a marker text around the marker's encoding
            line = sse_line(self.chunk(_TEXT_MARK, None, include_usage, index=index))
            pieces = line.split(json.dumps(_TEXT_MARK, ensure_ascii=False))
            parts = (pieces[0], pieces[1]) if len(pieces) == 2 else None  # None: the marker is in a name too
            self._text_lines[key] = parts
        if parts is None or not text:  # (an empty chat delta is {}, not {"content": ""})
            return sse_line(self.chunk(text, None, include_usage, index=index))
        return parts[0] + json.dumps(text, ensure_ascii=False) + parts[1]

    def usage_chunk(self, use: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, just usage."""
        return self._chunk([], True, use)

    def _choice(self, index: int, payload, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        key = "delta" if self.chat else "text"
        return {"index": index, key: payload, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk(self, choices: list[dict], include_usage: bool, use: dict | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if include_usage:  # OpenAI sends "usage": null on every chunk but the last when usage is asked for
            out["usage"] = use
        return out
