"""Incremental, UTF-8-safe detokenization with stop strings, one instance per request.

Pure Python (no mlx). Text is released only when it is complete characters and cannot be
the start of a stop string; a stop string that spans token boundaries is found and never
emitted.
"""

from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    """Holds back the text that could still become a stop string."""

    def __init__(self, stop: Sequence[str]):
        self._stop = tuple(s for s in stop if s)
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Consume new text. Returns (text safe to emit, whether a stop string was hit)."""
        if not self._stop:
            return text, False
        self._buffer += text
        hit = min(
            ((i, s) for s in self._stop if (i := self._buffer.find(s)) >= 0),
            default=None,
        )
        if hit is not None:
            out = self._buffer[: hit[0]]
            self._buffer = ""
            return out, True
        keep = self._held_back_length()
        cut = len(self._buffer) - keep
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self._buffer = self._buffer, ""
        return out

    def _held_back_length(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of a stop string."""
        best = 0
        buf = self._buffer
        for s in self._stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


class RequestDetokenizer:
    """Token ids in, safe text deltas out.

    Wraps mlx-lm's streaming detokenizer (BPE/SPM/naive, chosen by mlx-lm for the
    tokenizer), which holds back incomplete UTF-8 sequences and knows each tokenizer
    family's space handling. ``detokenizer`` must be this request's own instance
    (``TokenizerWrapper.detokenizer`` returns a fresh copy on every access).
    """

    def __init__(self, detokenizer, stop: Sequence[str] = ()):
        self._detok = detokenizer
        self._stop = StopStringMatcher(stop)
        self._emitted = 0
        self.stopped = False

    def _new_text(self) -> str:
        text = self._detok.text
        new = text[self._emitted :]
        self._emitted = len(text)
        return new

    def add(self, token: int) -> str:
        """Add one generated token; returns the text that may be emitted now."""
        self._detok.add_token(token)
        out, self.stopped = self._stop.feed(self._new_text())
        return out

    def finish(self) -> str:
        """The end of generation (length or EOS): flush everything held back."""
        if self.stopped:
            return ""
        self._detok.finalize()
        out, self.stopped = self._stop.feed(self._new_text())
        if not self.stopped:
            out += self._stop.flush()
        return out
