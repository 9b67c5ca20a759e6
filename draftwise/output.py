"""Request text: incremental detokenization and stop strings for one request.

Turns the engine's token ids into UTF-8-safe text deltas, detects stop strings (the text is cut before the
stop string, as vLLM does, or just after it with include_stop_str_in_output) and holds back exactly the
trailing characters that could still grow into a stop string (the longest suffix of the text that is a
prefix of one), so a stream never shows text it later has to take back and never holds back more. Knows
nothing of models or HTTP.
"""
from __future__ import annotations

from draftwise.tokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        self.text = ""  # full text so far (cut at a stop string once one is found)
        self._sent = 0  # characters of `text` already handed out as deltas
        self.stopped = False

    @classmethod
    def for_params(cls, tokenizer, params) -> "TextStream":
        """The stream a request with these SamplingParams needs."""
        return cls(tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens)

    def add(self, token_id: int) -> bool:
        """Add one token; returns True when a stop string completed (the text is cut before it, or after it)."""
        if self.stopped:
            return True
        before = len(self.text)
        self.text += self._detok.add([token_id])
        if len(self.text) == before:
            return False
        found = None  # (start, end) of the earliest stop string that ends in the new text
        for s in self.stop:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (found is None or i < found[0]):
                found = (i, i + len(s))
        if found is not None:
            self.text = self.text[: found[1] if self.include_stop else found[0]]
            self.stopped = True
        return self.stopped

    def _held(self) -> int:
        """How many trailing characters might still become a stop string: the longest suffix of the text that is
        a proper prefix of a stop string (0 when none)."""
        text, best = self.text, 0
        for s in self.stop:
            first = s[0]
            # candidate starts: where the stop string's first character occurs in the last len(s) - 1 characters
            lo = max(len(text) - len(s) + 1, 0)
            i = text.find(first, lo)
            while i >= 0:
                n = len(text) - i
                if n <= best:
                    break  # later starts are shorter suffixes
                if s.startswith(text[i:]):
                    best = n
                    break
                i = text.find(first, i + 1)
        return best

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out; keeps back a possible stop-string prefix unless the request is over."""
        end = len(self.text) if (final or self.stopped) else max(self._sent, len(self.text) - self._held())
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def finish(self) -> str:
        """Flush any bytes held by the detokenizer and return the remaining delta."""
        if not self.stopped:
            self.text += self._detok.finish()
        return self.delta(final=True)
