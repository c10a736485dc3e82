"""Incremental, UTF-8-safe detokenization with stop strings, one instance per request.

Pure Python (no mlx). Text is released only when it is complete characters and cannot be
the start of a stop string; a stop string that spans token boundaries is found and never
emitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class CallMarkers:
    """A chat format's markup, as the stop matcher must read it: stop strings are never
    matched between ``call_start`` and ``call_end``. Inside reasoning (``think_start`` ...
    ``think_end``, or from the start when the prompt opened it) a call marker is reasoning
    text, as ChatOutputParser reads it, so it switches nothing off."""

    call_start: str
    call_end: str
    think_start: str = ""
    think_end: str = ""
    starts_in_reasoning: bool = False
    #: The call's body is JSON: ``call_end`` inside one of its strings is the argument's text.
    json_body: bool = False
    #: The special token that is ``call_start``, where it is one: a call opens only where
    #: that token wrote it (the call grammars write it so, and open by it); spelled in
    #: ordinary tokens ("<tool" "_call>", a mention in a sentence) it is text.
    call_start_id: Optional[int] = None


class JsonStrings:
    """Whether the JSON text read so far is inside a string literal.

    A call with a JSON body may spell its own end marker in an argument
    (``{"text": "a</tool_call>b"}``: the grammar takes it, since it matches the marker by
    token id). Read by text, that marker ended the call, which became invalid, and the
    rest of it leaked into the content. vLLM's and mlx-lm's parsers (regex, text state
    machine) read it so too."""

    def __init__(self):
        self.inside = False
        self._escaped = False

    def feed(self, text: str) -> None:
        self.inside, self._escaped = self._scan(text)

    def inside_after(self, text: str) -> bool:
        return self._scan(text)[0]

    def _scan(self, text: str) -> tuple[bool, bool]:
        inside, escaped = self.inside, self._escaped
        for ch in text:
            if not inside:
                inside = ch == '"'
            elif escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                inside = False
        return inside, escaped


_TEXT, _REASONING, _CALL = "text", "reasoning", "call"


class StopStringMatcher:
    """Holds back the text that could still become a stop string.

    ``exempt`` (CallMarkers) is a chat format's tool-call markup: text between a call's
    markers is never matched. Stop strings end the text answer; a call is structured output
    that a stop such as "}" or "\n" would cut into an invalid call (every call, for "\n" in
    Qwen's format, where a newline follows ``<tool_call>``). Reasoning is followed as the
    output parser follows it: ``<think>`` opens it only before any text or call.
    """

    def __init__(self, stop: Sequence[str], exempt: Optional[CallMarkers] = None,
                 call_starts: Sequence[int] = ()):
        self._stop = tuple(s for s in stop if s)
        # A format without an end marker (Mistral's) has its call run to the end.
        self._m = exempt if exempt and exempt.call_start else None
        # Where in the text fed so far the call-start token wrote its marker (the
        # detokenizer's list, which it extends as tokens come), and how much was fed.
        self._call_starts = call_starts
        self._fed = 0
        thinks = bool(self._m and self._m.think_start and self._m.think_end)
        self._thinks = thinks
        self._state = _REASONING if thinks and self._m.starts_in_reasoning else _TEXT
        self._text_seen = False  # text or a call came before: <think> opens nothing any more
        self._buffer = ""
        # The buffer's first ``_done`` characters were read for markers already: the tail
        # of a reasoning marker held back because a stop string may run on past it.
        self._done = 0
        self._strings = JsonStrings() if self._m is not None and self._m.json_body else None
        m = self._m
        self._all_markers = tuple(mk for mk in (m.call_start, m.call_end, m.think_start, m.think_end) if mk) if m else ()

    def _markers(self) -> tuple[str, ...]:
        """The markers that change the state from here."""
        m = self._m
        if m is None:
            return ()
        if self._state == _CALL:
            return (m.call_end,) if m.call_end else ()
        if self._state == _REASONING:
            return (m.think_end,)
        if self._thinks and not self._text_seen:
            return (m.call_start, m.think_start)
        return (m.call_start,)

    def feed(self, text: str) -> tuple[str, bool]:
        """Consume new text. Returns (text safe to emit, whether a stop string was hit).

        Text that completes a marker is read a character at a time: the cut must not depend
        on how the text came in tokens, and where markers switch matching on and off
        between a stop's start and end (a stop running from reasoning over ``</think>`` into
        a call, review h166), reading a piece whole met them in another order. Other text,
        most of it, is read whole: nothing switches there (a marker still forming is held
        back alike either way)."""
        if not self._stop:
            return text, False
        if len(text) > 1 and self._all_markers and any(mk in self._buffer + text for mk in self._all_markers):
            out = ""
            for ch in text:
                piece, hit = self._feed(ch)
                out += piece
                if hit:
                    return out, True
            return out, False
        return self._feed(text)

    def _feed(self, text: str) -> tuple[str, bool]:
        self._buffer += text
        self._fed += len(text)
        out = ""
        while True:
            buf, done = self._buffer, self._done
            markers = self._markers()
            found = [(i, mk) for mk in markers if (i := self._find(buf, mk, done)) >= 0]
            # <think> counts only with nothing but whitespace before it (the parser's rule).
            found = [(i, mk) for i, mk in found if not (mk == self._m.think_start and self._state == _TEXT
                                                        and buf[done:i].strip())]
            marker = min(found, default=None)
            if marker is not None and self._state == _CALL and self._strings is not None \
                    and self._strings.inside_after(buf[:marker[0]]):
                # The end marker inside a JSON string: the call's text, matched by nothing.
                end = marker[0] + len(marker[1])
                self._strings.feed(buf[:end])
                out += buf[:end]
                self._buffer = buf[end:]
                continue
            if self._state != _CALL:  # stop strings: in text and reasoning, never in a call
                calls = tuple(mk for mk in markers if mk == self._m.call_start)
                # A call's start wins a stop that does not begin before it, or that runs on
                # past the marker into the call (the call's text is never matched:
                # ".\n<tool_call>" stops, "\n<tool_call>\n" does not); reasoning markers are
                # text to stop strings ("</think>" as a stop ends the reasoning there), as
                # they are for a request without tools, whose matcher knows no markers.
                if marker is not None and marker[1] in calls:
                    hit = first_stop(buf, self._stop, before=marker[0], end=marker[0] + len(marker[1]))
                else:
                    hit = first_stop(buf, self._stop)
                if marker is None or marker[1] in calls:
                    wins = hit is not None
                else:
                    wins = hit is not None and hit[0] < marker[0] + len(marker[1])
                if wins:
                    # A hit inside a call marker still forming (written in several tokens:
                    # "<", "tool", "_call", ">") waits until the marker completes or is ruled
                    # out, as it would have come whole from a one-token marker.
                    forming = len(buf) - partial_marker_length(buf, calls) if marker is None else len(buf)
                    if hit[0] < forming:
                        self._buffer, self._done = "", 0
                        return out + buf[:hit[0]], True
                    # Should the marker complete, a stop that begins before it wins, found
                    # already (ending after this one) or still forming.
                    before = first_stop(buf, self._stop, before=forming)
                    held = min(forming, len(buf) - partial_marker_length(buf, self._stop),
                               before[0] if before is not None else forming)
                    return out + self._hold(buf, held), False
            if marker is not None:
                i, mk = marker
                end = i + len(mk)
                if self._state == _TEXT and buf[done:i].strip():
                    self._text_seen = True
                if self._state == _CALL and self._strings is not None:
                    self._strings.feed(buf[:i])
                # Reasoning markers are text to stop strings: a stop may begin before or
                # inside one and end after it ("</think>\n\n"), so what could begin a stop
                # is held back, as a request without tools holds it. A call's markers end
                # stop matching (a stop wins only before the call).
                keep = 0 if self._state == _CALL or mk == self._m.call_start else \
                    partial_marker_length(buf[:end], self._stop)
                out += buf[:end - keep]
                self._buffer, self._done = buf[end - keep:], keep
                self._switch(mk)
                continue
            held = markers if self._state == _CALL else self._stop + markers
            return out + self._hold(buf, len(buf) - partial_marker_length(buf, held)), False

    def _find(self, buf: str, marker: str, start: int) -> int:
        """Where ``marker`` first stands in ``buf`` from ``start``; a call's start only
        where its token wrote it (``CallMarkers.call_start_id``)."""
        i = buf.find(marker, start)
        if marker != self._m.call_start or self._m.call_start_id is None:
            return i
        base = self._fed - len(buf)  # where the buffer begins in the text fed
        while i >= 0 and base + i not in self._call_starts:
            i = buf.find(marker, i + 1)
        return i

    def _hold(self, buf: str, cut: int) -> str:
        """Emit ``buf[:cut]``; hold the rest back."""
        if self._state == _TEXT and buf[self._done:cut].strip():
            self._text_seen = True
        if self._state == _CALL and self._strings is not None:
            self._strings.feed(buf[:cut])
        self._buffer, self._done = buf[cut:], max(0, self._done - cut)
        return buf[:cut]

    def _switch(self, marker: str) -> None:
        if self._state != _TEXT:  # a call's end, or </think>
            self._state = _TEXT
        elif marker == self._m.call_start:
            self._state, self._text_seen = _CALL, True
            if self._strings is not None:
                self._strings = JsonStrings()
        else:  # <think>, before any text
            self._state = _REASONING

    def flush(self) -> tuple[str, bool]:
        """The end of the text: what was held back, cut at a stop string in it (a marker
        that was still forming can no longer complete)."""
        buf, self._buffer, self._done = self._buffer, "", 0
        if self._stop and self._state != _CALL:
            hit = first_stop(buf, self._stop)
            if hit is not None:
                return buf[:hit[0]], True
        return buf, False


def first_stop(buf: str, stops: Sequence[str], before: Optional[int] = None,
               end: Optional[int] = None) -> Optional[tuple[int, str]]:
    """(start, stop) of the stop string that ends first in ``buf``, the earlier start on a
    tie: the one a text written a character at a time meets first, so the cut does not
    depend on how the text came in tokens (with ``[" the", "h"]``, " the end" stops at
    " t", where the earliest start cut it to "" when " the" came in one token). Only stops
    that begin before ``before`` and end by ``end`` (a call's start marker: a stop inside
    it hid one that began before the call, review h163)."""
    before = len(buf) if before is None else before
    end = len(buf) if end is None else end
    hits = [(i + len(s), i, s) for s in stops if 0 <= (i := buf.find(s, 0, end)) < before]
    if not hits:
        return None
    _, i, s = min(hits)
    return i, s


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
    works for byte-level BPE and SentencePiece alike because both decodes see the same
    leading context, and it holds back text ending in an incomplete UTF-8 sequence. (A
    byte-fallback run of invalid UTF-8 is the exception: HF's decoder then replaces the
    valid bytes before it too, which the stream had already sent; see docs/design.md.) (mlx-lm 0.32's BPEStreamingDetokenizer drops the first token's leading
    space, which ``decode`` keeps, so it is not used here.)
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 exempt: Optional[CallMarkers] = None):
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent = 0  # characters already emitted past the prefix text, while the read offset waits
        # Where the call-start token wrote its marker, in the answer's text (CallMarkers).
        self._start_marker = (exempt.call_start, exempt.call_start_id) if exempt and exempt.call_start_id is not None \
            else None
        self.call_starts: list[int] = []
        self._taken = 0
        self._text_len = 0
        self._stop = StopStringMatcher(stop, exempt, self.call_starts)
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
        text = self._delta(final=False)
        self._text_len += len(text)
        if self._start_marker is not None and token == self._start_marker[1]:
            at = text.rfind(self._start_marker[0])
            if at >= 0:
                self.call_starts.append(self._text_len - len(text) + at)
        out, self.stopped = self._stop.feed(text)
        return out

    def take_call_starts(self) -> tuple[int, ...]:
        """The call starts (offsets in the answer's text) found since the last take."""
        new, self._taken = self.call_starts[self._taken:], len(self.call_starts)
        return tuple(new)

    def finish(self) -> str:
        """The end of generation (length or EOS): flush everything held back."""
        if self.stopped:
            return ""
        out, self.stopped = self._stop.feed(self._delta(final=True))
        if not self.stopped:
            rest, self.stopped = self._stop.flush()
            out += rest
        return out
