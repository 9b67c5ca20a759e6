"""Request text: incremental detokenization and stop strings for one request.

Turns the engine's token ids into UTF-8-safe text deltas, detects stop strings (the text is cut before the
stop string, as vLLM does) and holds back the few trailing characters that might still grow into a stop
string, so a stream never shows text it later has to take back. Knows nothing of models or HTTP.
"""
from __future__ import annotations

from draftwise.tokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self._detok = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # full text so far (cut at a stop string once one is found)
        self._sent = 0  # characters of `text` already handed out as deltas
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Add one token; returns True when a stop string completed (the text is cut before it)."""
        if self.stopped:
            return True
        start = max(0, len(self.text) - self._hold)
        self.text += self._detok.add([token_id])
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0:
                self.text = self.text[:i]
                self.stopped = True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out; keeps back a possible stop-string prefix unless the request is over."""
        end = len(self.text) if (final or self.stopped) else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def finish(self) -> str:
        """Flush any bytes held by the detokenizer and return the remaining delta."""
        if not self.stopped:
            self.text += self._detok.finish()
        return self.delta(final=True)
