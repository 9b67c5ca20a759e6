"""Tool calling on the chat route: the request's `tools` / `tool_choice` / `parallel_tool_calls`, and the model's
output read back as OpenAI `tool_calls`, whole (`parse_calls`) or as stream deltas (`ToolCallStream`).

Owns checking those fields (a 400 naming the field), what the chat template gets (`template_tools`: the tool
objects as sent, which the model's own template renders; none under `tool_choice: "none"`), which choices
constrain the output (`required` and a named function: structured.constraint.tool_call_constraint, so every
call validates against its function's parameters schema), and parsing the Hermes / Qwen2.5 markup
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A call that does not parse (unknown name, bad
JSON, arguments not an object) leaves the whole output as content: under `auto` a malformed call is text, never
an error. Knows nothing of the engine, tokens or HTTP.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from draftwise.config import ConfigError
from draftwise.server.errors import APIError
from draftwise.structured.constraint import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Constraint, tool_call_constraint

_OPEN, _CLOSE = TOOL_CALL_OPEN.strip(), TOOL_CALL_CLOSE.strip()  # "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)
# the form the template shows and the constraint writes: name first, arguments last
_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(.*)\}\s*', re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's function-name rule


@dataclass(frozen=True)
class ToolChoice:
    """The request's tools and what it asks of the model: `mode` "auto" (may call), "required" (must call one
    of them) or "named" (must call `name`, once); `parallel`: more than one call allowed."""

    tools: tuple[dict, ...]  # the tool objects as sent ({"type": "function", "function": {...}})
    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def functions(self) -> list[dict]:
        """The function objects a call may name (all of them, or the named one)."""
        fs = [t["function"] for t in self.tools]
        return [f for f in fs if f["name"] == self.name] if self.mode == "named" else fs

    def constraint(self, tokenizer) -> Constraint | None:
        """The grammar a required or named choice puts on the output; None under auto. The markup is written as
        the tokenizer's own `<tool_call>` / `</tool_call>` tokens where it has them."""
        if self.mode == "auto":
            return None
        ids = (tokenizer.token_to_id(_OPEN), tokenizer.token_to_id(_CLOSE))
        try:
            return tool_call_constraint(self.functions, self.parallel, None if None in ids else ids)
        except ConfigError as e:  # a parameters schema the grammar engine cannot take
            raise APIError(400, f"tools: {e}", param="tools") from None


def read_tool_choice(tools: list | None, tool_choice, parallel_tool_calls: bool | None) -> ToolChoice | None:
    """The request's tool fields checked: None when the model gets no tools (none sent, or tool_choice none)."""
    if tool_choice not in (None, "none", "auto") and not tools:  # none / auto without tools: nothing to do
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if not tools:
        return None
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise APIError(400, f"tools.{i}: expected {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"tools.{i}.function.name must be 1-64 letters, digits, _ . or -", param="tools")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools.{i}.function.parameters must be a JSON schema object", param="tools")
        names.append(name)
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice(tuple(tools), "auto", parallel=parallel)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolChoice(tuple(tools), "required", parallel=parallel)
    f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(f, dict):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', param="tool_choice")
    if f.get("name") not in names:
        raise APIError(400, f"tool_choice names {str(f.get('name'))[:64]!r}, which is not one of the tools",
                       param="tool_choice")
    return ToolChoice(tuple(tools), "named", f["name"], parallel=False)  # forcing one function: one call (vLLM)


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls as chat templates expect them: each call's arguments an object, not a JSON string
    (as transformers and vLLM hand them over). A string that is not JSON stays as it is."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                f = dict(c.get("function") or {})
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except json.JSONDecodeError:
                        pass
                fixed.append(dict(c, function=f))
            m = dict(m, tool_calls=fixed)
        out.append(m)
    return out


def _call(block: str, allowed: set[str]) -> dict | None:
    """One `<tool_call>` block's body as an OpenAI tool call; None when it does not parse. The arguments string
    is the model's own text of the object (what a stream sends piece by piece)."""
    try:
        obj = json.loads(block)
    except (json.JSONDecodeError, RecursionError):  # whatever the model wrote: text, never an error
        return None
    if (not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in allowed
            or not isinstance(obj.get("arguments"), dict)):
        return None
    m = _CALL.fullmatch(block)
    args = m.group(2).rstrip() if m else json.dumps(obj["arguments"], ensure_ascii=False)
    return new_call(obj["name"], args)


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_calls(text: str, choice: ToolChoice) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output: the text before the first `<tool_call>` as content (None if
    only whitespace), and one call per block. Any block that does not parse, or text after the calls: the
    whole text is content and there are no calls; except under a constrained choice, where text after the last
    whole block can only be a call cut short by max_tokens, which is left out. Without `parallel`, only the
    first call is kept."""
    blocks = list(_BLOCK.finditer(text))
    if not blocks or (choice.mode == "auto" and text[blocks[-1].end():].strip()):
        return text, []
    allowed = {f["name"] for f in choice.functions}
    calls = [_call(b.group(1), allowed) for b in blocks]
    between = [text[a.end(): b.start()] for a, b in zip(blocks, blocks[1:])]
    if any(c is None for c in calls) or any(s.strip() for s in between):
        return text, []
    content = text[: blocks[0].start()].strip() or None
    return content, calls if choice.parallel else calls[:1]


class ToolCallStream:
    """Text deltas in, OpenAI delta pieces out: content until a `<tool_call>` may begin, then each call once its
    block is whole and parses (`{"index", "id", "type", "function": {"name", "arguments": ""}}`, then its
    arguments). A trusted stream (the output is constrained to valid calls) sends the arguments as they arrive
    instead. `finish()` returns what is left: a block that never closed or did not parse goes out as content."""

    def __init__(self, choice: ToolChoice, trusted: bool):
        self.choice, self.trusted = choice, trusted
        self.allowed = {f["name"] for f in choice.functions}
        self.buffer = ""  # text not sent yet
        self.calls: list[dict] = []  # calls sent (id, name, arguments so far)
        self.failed = False  # a block did not parse: from then on everything is content
        self._open: dict | None = None  # a trusted call whose arguments are streaming: its sent length

    def feed(self, text: str) -> list[dict]:
        """Delta pieces for `text`: {"content": str} or {"tool_calls": [piece]}."""
        self.buffer += text
        out = []
        while True:
            piece = self._next()
            if piece is None:
                return out
            out.append(piece)

    def _next(self) -> dict | None:
        if self.failed:
            text, self.buffer = self.buffer, ""
            return {"content": text} if text else None
        if self._open is not None:
            return self._stream_arguments()
        at = self.buffer.find(_OPEN)
        if at < 0:  # content, holding back what could start the markup
            keep = _partial_suffix(self.buffer, _OPEN)
            if self.calls or not self.buffer[: len(self.buffer) - keep]:
                return None  # after a call, only whitespace or another call may follow: wait for it
            text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            return {"content": text}
        if at > 0:
            if self.calls and self.buffer[:at].strip():
                self.failed = True
                return self._next()
            if not self.calls:
                text, self.buffer = self.buffer[:at], self.buffer[at:]
                return {"content": text} if text.strip() else self._next_after_drop(at)
            self.buffer = self.buffer[at:]
        if not self.choice.parallel and self.calls:
            return None  # one call only: what follows is dropped (finish() sends nothing)
        if self.trusted:
            m = re.match(re.escape(TOOL_CALL_OPEN) + r'\{"name": "([^"]*)", "arguments": ', self.buffer)
            if m is None:
                return None
            self.buffer = self.buffer[m.end():]
            self._open = {"sent": 0}
            return self._header(m.group(1), "")
        end = self.buffer.find(_CLOSE)
        if end < 0:
            return None
        block, self.buffer = self.buffer[len(_OPEN): end], self.buffer[end + len(_CLOSE):]
        call = _call(block, self.allowed)
        if call is None:
            self.buffer = f"{_OPEN}{block}{_CLOSE}{self.buffer}"
            self.failed = True
            return self._next()
        return self._header(call["function"]["name"], call["function"]["arguments"])

    def _next_after_drop(self, at: int) -> dict | None:
        self.buffer = self.buffer[at:]  # whitespace before the first call is not content
        return self._next()

    def _stream_arguments(self) -> dict | None:
        """A trusted call: send the arguments up to what could be the closing `}\\n</tool_call>`."""
        close = "}" + TOOL_CALL_CLOSE
        end = self.buffer.find(close)
        if end >= 0:
            text, self.buffer = self.buffer[:end], self.buffer[end + len(close):]
            self._open = None
        else:
            keep = _partial_suffix(self.buffer, close)
            text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        if not text:
            return None if self._open is not None else self._next()
        self.calls[-1]["function"]["arguments"] += text
        return {"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]}

    def _header(self, name: str, arguments: str) -> dict:
        call = new_call(name, arguments)
        self.calls.append(call)
        return {"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}

    def finish(self) -> list[dict]:
        """What is still held, as content (an unfinished or unparsable block, text after the calls: a stream
        cannot take back calls it sent), except further calls after the one a non-parallel choice allows."""
        text, self.buffer = self.buffer, ""
        if not text.strip() or (self.calls and not self.choice.parallel):
            return []
        return [{"content": text}]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (what might start it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
