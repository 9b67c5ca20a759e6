"""Token provenance: the opt-in `draftwise` extension on streamed chunks (docs/ARCHITECTURE.md, "The playground").

A request carrying `"draftwise": {"provenance": true}` gets, on every streamed chunk that carries tokens,
`"draftwise": {"method", "steps": [{"k", "tokens": [{"text", "accepted"}, ...]}, ...]}` next to `choices`: per
engine step, its draft size k (0 = the prefill's first token or a plain step) and, per emitted token, its piece
of the chunk's text and whether it was an accepted draft guess. A chunk carries one step, except a request's
first, which also holds its first decoding step (the engine decodes a newly admitted request in the same step).
The pieces of a chunk concatenate to exactly that chunk's text delta.

Owns cutting one request's text deltas into per-token pieces. A token that completes no character yet (the first
bytes of a multi-byte UTF-8 character) gets "" and the token that completes it carries the character; text that
was held back (a possible stop-string prefix) and released later goes to the first token of the chunk that
releases it; a token whose text a stop string cut away gets "". Knows neither HTTP nor the engine's internals: it
sees the request's TextStream and, per step, how many tokens it emitted and how many were accepted guesses.
"""
from __future__ import annotations


class TokenProvenance:
    """One request's provenance. `add` stands in for the TextStream's `add` as the engine's `on_token` callback
    (it notes where the text ends after each token); `chunk` builds one chunk's extension object."""

    def __init__(self, stream, method: str):
        self.stream, self.method = stream, method
        self._ends: list[int] = []  # len(stream.text) after each token the stream saw
        self._num_split = 0  # tokens already given a piece
        self._sent = 0  # characters of text already handed out in pieces (== in deltas)

    def add(self, token_id: int) -> bool:
        stopped = self.stream.add(token_id)
        self._ends.append(len(self.stream.text))
        return stopped

    def pieces(self, num_tokens: int, delta: str) -> list[str]:
        """`delta` (the text a chunk hands out) cut into one piece per token of the chunk, in order."""
        if num_tokens == 0:
            self._sent += len(delta)
            return []
        lo, hi = self._sent, self._sent + len(delta)
        out, start = [], lo
        for i in range(self._num_split, self._num_split + num_tokens):
            # a token the stream never saw (EOS or a stop id ends a request before on_token) adds no text
            end = self._ends[i] if i < len(self._ends) else start
            end = hi if i == self._num_split + num_tokens - 1 else min(max(end, start), hi)
            out.append(delta[start - lo:end - lo])
            start = end
        self._num_split += num_tokens
        self._sent = hi
        return out

    def chunk(self, delta: str, steps: list[tuple[int, int, int]]) -> dict:
        """The extension object for one chunk: `delta` is its text, `steps` the engine outputs it carries as
        (tokens emitted, k, accepted guesses among them); the first `accepted` tokens of a step were guesses."""
        texts = self.pieces(sum(n for n, _, _ in steps), delta)
        out, i = [], 0
        for n, k, num_accepted in steps:
            out.append({"k": k, "tokens": [{"text": t, "accepted": j < num_accepted}
                                           for j, t in enumerate(texts[i:i + n])]})
            i += n
        return {"method": self.method, "steps": out}
