"""OpenAI request and response shapes for /v1/completions and /v1/chat/completions.

Owns validation of the JSON a client sends (pydantic, strict types: "0.5" is not a number, true is not an
integer), the mapping onto draftwise SamplingParams, and building response / SSE chunk dicts. Knows nothing
of the engine or its thread; sizes come in as arguments.
"""
from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftwise.config import ConfigError
from draftwise.sampling import SamplingParams
from draftwise.server.errors import APIError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
# Accepted for compatibility; anything but their neutral value is refused rather than silently ignored.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": None, "top_logprobs": None,
            "echo": False, "best_of": 1, "logit_bias": None, "suffix": None, "tools": None, "response_format": None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

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
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


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
    for key, neutral in _NEUTRAL.items():
        value = (req.model_extra or {}).get(key, neutral)
        if value not in (neutral, None, {}, []):
            raise APIError(400, f"{key} is not supported by this server", param=key)
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
    """Messages as plain {role, content} dicts for the chat template; text parts are joined."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, "only text content parts are supported", param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": m.role, "content": content or ""})
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
              stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos)
    try:
        return SamplingParams(**kw)
    except ConfigError as e:
        word = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=word if word in kw else None) from None


# ---- responses ------------------------------------------------------------------------------------
def usage(num_prompt: int, num_output: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


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

    def chunk(self, text: str, finish_reason: str | None, include_usage: bool) -> dict:
        payload = ({"content": text} if text else {}) if self.chat else text
        return self._chunk([self._choice(payload, finish_reason)], include_usage)

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
