"""Incremental, UTF-8-safe detokenization with stop strings, one instance per request.

Pure Python (no mlx). Text is released only when it is complete characters and cannot be
the start of a stop string; a stop string that spans token boundaries is found and never
emitted.
"""

from __future__ import annotations

from typing import Callable, Sequence


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
    """Token ids in, safe text deltas out; the deltas concatenate to ``decode(all tokens)``.

    Incremental decoding by prefix window (the scheme vLLM uses): decode a short window
    of already-emitted tokens with and without the new ones and emit the difference. It
    works for any tokenizer family (byte-level BPE, SentencePiece) because both decodes
    see the same leading context, and it holds back text ending in an incomplete UTF-8
    sequence. (mlx-lm 0.32's BPEStreamingDetokenizer drops the first token's leading
    space, which ``decode`` keeps, so it is not used here.)
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent = 0  # characters already emitted past the prefix text, while the read offset waits
        self._stop = StopStringMatcher(stop)
        self.stopped = False

    def _delta(self, final: bool) -> str:
        window = self._tokens[self._prefix_offset:]
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._decode(window)
        start = len(prefix_text) + self._sent
        if new_text.endswith("\ufffd") and not final:
            # An incomplete UTF-8 sequence: hold back only it. The complete characters before
            # it go out now, so a stop string among them is found at this token, not at the end.
            ready = new_text.rstrip("\ufffd")
            if len(ready) <= start:
                return ""
            self._sent = len(ready) - len(prefix_text)
            return ready[start:]
        if len(new_text) <= start:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._sent = 0
        return new_text[start:]

    def add(self, token: int) -> str:
        """Add one generated token; returns the text that may be emitted now."""
        self._tokens.append(token)
        out, self.stopped = self._stop.feed(self._delta(final=False))
        return out

    def finish(self) -> str:
        """The end of generation (length or EOS): flush everything held back."""
        if self.stopped:
            return ""
        out, self.stopped = self._stop.feed(self._delta(final=True))
        if not self.stopped:
            out += self._stop.flush()
        return out
