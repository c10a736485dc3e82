"""Incremental, UTF-8-safe detokenization with stop strings, one instance per request.

Pure Python (no mlx). Text is released only when it is complete characters and cannot be
the start of a stop string; a stop string that spans token boundaries is found and never
emitted.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence


class StopStringMatcher:
    """Holds back the text that could still become a stop string.

    ``exempt`` is an (open, close) pair of markers, a tool call's markup: text between them
    is never matched. Stop strings end the text answer; a call is structured output that a
    stop such as "}" or "\n" would cut into an invalid call (every call, for "\n" in Qwen's
    format, where a newline follows ``<tool_call>``).
    """

    def __init__(self, stop: Sequence[str], exempt: Optional[tuple[str, str]] = None):
        self._stop = tuple(s for s in stop if s)
        self._exempt = exempt if exempt and all(exempt) else None
        self._in_exempt = False
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Consume new text. Returns (text safe to emit, whether a stop string was hit)."""
        if not self._stop:
            return text, False
        self._buffer += text
        out = ""
        while True:
            buf = self._buffer
            if self._in_exempt:  # inside a call: pass it on up to its close marker
                close = self._exempt[1]
                j = buf.find(close)
                if j < 0:
                    cut = len(buf) - partial_marker_length(buf, (close,))
                    self._buffer = buf[cut:]
                    return out + buf[:cut], False
                out += buf[:j + len(close)]
                self._buffer = buf[j + len(close):]
                self._in_exempt = False
                continue
            hit = min(((i, s) for s in self._stop if (i := buf.find(s)) >= 0), default=None)
            opening = buf.find(self._exempt[0]) if self._exempt else -1
            if hit is not None and (opening < 0 or hit[0] < opening):
                self._buffer = ""
                return out + buf[:hit[0]], True
            if opening >= 0:
                end = opening + len(self._exempt[0])
                out += buf[:end]
                self._buffer = buf[end:]
                self._in_exempt = True
                continue
            markers = self._stop + ((self._exempt[0],) if self._exempt else ())
            cut = len(buf) - partial_marker_length(buf, markers)
            self._buffer = buf[cut:]
            return out + buf[:cut], False

    def flush(self) -> str:
        out, self._buffer = self._buffer, ""
        return out


def partial_marker_length(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``markers``:
    the text to hold back until it is known whether a marker (or stop string) begins there."""
    best = 0
    for s in markers:
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

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 exempt: Optional[tuple[str, str]] = None):
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent = 0  # characters already emitted past the prefix text, while the read offset waits
        self._stop = StopStringMatcher(stop, exempt)
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
