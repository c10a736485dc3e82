"""Streaming: UTF-8-safe deltas, no lost spaces, stop strings across token boundaries."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.detokenizer import CallMarkers, StopStringMatcher

from .forcing import forcing_processor

USER = [{"role": "user", "content": "say it"}]
TEXTS = [
    "Hello, 世界! 🙂🚀 naïve café — 東京 and 北京欢迎你 👍🏽",
    " leading space,  two  spaces, trailing space ",
    "def f(x):\n    return x  # 🐍\n\n\tdone",
]


def _forced(engine, text, **kw):
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    eos = engine.loaded.eos_token_ids[0]
    return ids, SamplingParams(max_tokens=len(ids) + 5, logits_processors=[forcing_processor(ids, eos)], **kw)


@pytest.mark.parametrize("text", TEXTS)
async def test_streamed_text_round_trips_exactly(engine, text):
    ids, params = _forced(engine, text)
    deltas = [d async for d in engine.stream_chat(USER, params)]
    assert all("\ufffd" not in d.text for d in deltas), [d.text for d in deltas]
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == ids
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].usage.completion_tokens == len(ids) + 1  # the EOS counts as generated
    if not text.isascii():
        # Characters split over byte tokens were held back (a delta with ids but no text).
        assert any(d.token_ids and d.text == "" for d in deltas)


def _boundary_stop(engine, text):
    """A stop string that starts inside one token and ends inside the next."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    pieces = [engine.tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    for k in range(2, len(ids) - 1):
        a, b, c = pieces[k - 1], pieces[k], pieces[k + 1]
        if len(b) - len(a) >= 2 and len(c) - len(b) >= 2 and b.isascii() and c.isascii():
            return b[-2:] + c[len(b):len(b) + 2]
    raise AssertionError("no suitable boundary")


async def test_stop_string_across_token_boundaries_is_found_and_not_emitted(engine):
    text = "The answer is forty two, and the next line explains everything else."
    stop = _boundary_stop(engine, text)
    ids, params = _forced(engine, text, stop=["NEVER", stop])
    deltas = [d async for d in engine.stream_chat(USER, params)]
    out = "".join(d.text for d in deltas)
    assert out == text[: text.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    # Sync and non-streaming paths agree.
    result = await engine.chat(USER, _forced(engine, text, stop=[stop])[1])
    assert result.text == out and result.finish_reason == "stop"


async def test_length_finish_flushes_held_back_text(engine):
    text = "abc abc abc abc abc abc"
    ids, _ = _forced(engine, text)
    eos = engine.loaded.eos_token_ids[0]
    params = SamplingParams(max_tokens=len(ids), stop=["abc abc abc abc abc abc!"],
                            logits_processors=[forcing_processor(ids, eos)])
    out = await engine.chat(USER, params)
    assert out.finish_reason == "length"
    assert out.text == text  # the partial stop-string match is released at the end


async def test_stop_string_before_an_incomplete_character_stops_at_its_token(engine):
    """A token that decodes to whole characters and the start of another: the whole ones go
    out at once, so a stop string among them stops generation at that token with "stop".
    (The whole text was held back until the end: the stop was found only in the final
    flush, generation ran to max_tokens, and the finish read "length".)"""
    decode = engine.tokenizer.decode
    tok, head = next((i, t.rstrip("\ufffd")) for i in range(engine.loaded.vocab_size)
                     if (t := decode([i])).endswith("\ufffd") and t.rstrip("\ufffd").strip())
    eos = engine.loaded.eos_token_ids[0]
    ids = [tok] * 6
    params = SamplingParams(max_tokens=6, stop=[head], logits_processors=[forcing_processor(ids, eos)])
    deltas = [d async for d in engine.stream_chat(USER, params)]
    assert "".join(d.text for d in deltas) == ""
    assert deltas[-1].finish_reason == "stop" and deltas[-1].usage.completion_tokens == 1
    # Without the stop string the same tokens stream out whole, the held-back bytes included.
    free = [d async for d in engine.stream_chat(USER, SamplingParams(
        max_tokens=6, logits_processors=[forcing_processor(ids, eos)]))]
    assert "".join(d.text for d in free) == decode(ids)
    assert free[0].token_ids == (tok,) and free[0].text == head  # released at its own token
    # A stop string completed only by the final flush (a max_tokens cut mid-character leaves
    # U+FFFD) still finishes with "stop".
    cut = await engine.chat(USER, SamplingParams(max_tokens=1, stop=["\ufffd"],
                                                 logits_processors=[forcing_processor(ids, eos)]))
    assert (cut.text, cut.finish_reason) == (head, "stop")


@pytest.mark.parametrize("pieces,stop,expected,hit", [
    (["hel", "lo wor", "ld"], ["lo w"], "hel", True),
    (["ab", "c", "d"], ["cd", "bcx"], "ab", True),
    (["a", "b", "c"], ["x"], "abc", False),
    (["STOP", "more"], ["STOP"], "", True),
    (["foo", "ba"], ["bar"], "foo", False),  # "ba" held back, not yet emitted
])
def test_stop_matcher(pieces, stop, expected, hit):
    assert _feed(StopStringMatcher(stop), pieces) == (expected, hit)


def _feed(matcher: StopStringMatcher, pieces) -> tuple[str, bool]:
    """The text a matcher lets out of ``pieces``, and whether a stop string ended it."""
    out = ""
    for p in pieces:
        text, hit = matcher.feed(p)
        out += text
        if hit:
            return out, True
    return out, False


CALL = CallMarkers("<tool_call>", "</tool_call>")


@pytest.mark.parametrize("pieces,stop,expected,hit", [
    # Inside a call nothing is matched; the call is passed on whole, then matching resumes.
    (["a <tool_call>\n{\"x\": 1}\n</tool_call>", "\nafter"], ["}", "\n"],
     "a <tool_call>\n{\"x\": 1}\n</tool_call>", True),
    # Markers split across deltas: held back until they are known.
    (["<tool", "_call>{}", "</tool_", "call>", " done}"], ["}"], "<tool_call>{}</tool_call> done", True),
    # A stop before the call still ends the answer there.
    (["x}", "<tool_call>{}</tool_call>"], ["}"], "x", True),
    (["<tool_call>{}</tool_call>", "<tool_call>{}</tool_call>"], ["}"],
     "<tool_call>{}</tool_call><tool_call>{}</tool_call>", False),
    # Cut inside a call (a max_tokens end): the text so far goes out, but for a partial close.
    (["<tool_call>{\"a\": \"}</tool"], ["}"], "<tool_call>{\"a\": \"}", False),
])
def test_stop_matcher_never_cuts_a_tool_call(pieces, stop, expected, hit):
    m = StopStringMatcher(stop, exempt=CALL)
    out, was_hit = _feed(m, pieces)
    assert (out, was_hit) == (expected, hit)
    if not hit:
        assert out + m.flush()[0] == "".join(pieces)


def test_an_end_marker_inside_a_json_argument_is_call_text_to_the_matcher():
    """A JSON call whose argument spells the end marker (the grammar takes it): the marker
    inside the string ended the call to the matcher, which then cut the rest of the call at
    a stop string. With ``json_body`` the call runs to its real end, for any split."""
    text = '<tool_call>\n{"name": "w", "arguments": {"t": "a</tool_call>b} \\"q\\" }"}}\n</tool_call> after} x'
    expected = text[: text.index(" after}") + len(" after")]
    for size in (len(text), 1, 3, 7):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        m = StopStringMatcher(["}"], exempt=dataclasses.replace(CALL, json_body=True))
        assert _feed(m, pieces) == (expected, True), size
    # Without it (a body that is not JSON) the first marker ends the call, as before.
    assert _feed(StopStringMatcher(["}"], exempt=CALL), [text])[0] == text[: text.index("b}") + 1]


def test_a_call_start_its_token_did_not_write_is_text_to_the_matcher():
    """With ``call_start_id``, the matcher exempts a call only from where the start token
    wrote its marker; a mention before it is text, a stop after the mention still matches."""
    text = "Use <tool_call> tags} <tool_call>{\"a\": \"}\"}</tool_call> end} x"
    real = text.rindex("<tool_call>")
    by_token = dataclasses.replace(CALL, call_start_id=7)
    for size in (len(text), 1, 4):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert _feed(StopStringMatcher(["}"], by_token, call_starts=[real]), pieces) == ("Use <tool_call> tags", True)
        # With the mention cut short by no stop, the real call is still exempt.
        out = _feed(StopStringMatcher(["end}"], by_token, call_starts=[real]), pieces)
        assert out == (text[: text.index("end}")], True), size


THINKING = CallMarkers("<tool_call>", "</tool_call>", "<think>", "</think>")


@pytest.mark.parametrize("pieces,markers,expected,hit", [
    # A call marker inside reasoning is reasoning text, as the output parser reads it: the
    # stop after it, in reasoning or in the answer, still ends the answer.
    (["<think>no <tool_call> here.</think>Answer} more"], THINKING, "<think>no <tool_call> here.</think>Answer", True),
    (["<think>a <tool_", "call> b} c"], THINKING, "<think>a <tool_call> b", True),
    (["a <tool_call> b.</think>Answer} more"], dataclasses.replace(THINKING, starts_in_reasoning=True),
     "a <tool_call> b.</think>Answer", True),
    # After the reasoning a call is exempt as before.
    (["<think>x</think><tool_call>{}</tool_call> done}"], THINKING, "<think>x</think><tool_call>{}</tool_call> done", True),
    # <think> opens reasoning only before any text: after text, a call marker is a call.
    (["text <think> <tool_call>{}</tool_call>}"], THINKING, "text <think> <tool_call>{}</tool_call>", True),
    (["text", " <think> <tool_call>{}", "</tool_call>}"], THINKING, "text <think> <tool_call>{}</tool_call>", True),
    # Whitespace before <think> is no text; a marker split across deltas is held back.
    (["\n <thi", "nk>a <tool_call> b}"], THINKING, "\n <think>a <tool_call> b", True),
])
def test_stop_matcher_reads_reasoning_as_the_parser_does(pieces, markers, expected, hit):
    """A literal <tool_call> a model writes while reasoning switched stop matching off until
    a </tool_call> followed, so stop strings no longer ended the answer."""
    m = StopStringMatcher(["}"], exempt=markers)
    assert _feed(m, pieces) == (expected, hit)


@pytest.mark.parametrize("stop,expected", [
    ("</think>\n\n", "<think>\nhi\n"),  # begins with the marker, ends after it
    (">\n", "<think"),  # inside the marker
    ("<think>\nhi", ""),  # begins with the opening marker
    ("hi\n</think>\n\nThe", "<think>\n"),  # reasoning, the marker and the answer
])
def test_a_stop_string_runs_on_past_a_reasoning_marker_with_tools_as_without(stop, expected):
    """Reasoning markers are text to stop strings. With tools (a matcher that knows the
    markers) a completed marker was let out at once, so a stop that began before or inside
    it and ended after it was never found, unless the text came in one piece."""
    text = "<think>\nhi\n</think>\n\nThe answer."
    pieces = ["<think>", "\n", "hi", "\n", "</think>", "\n\n", "The", " answer", "."]
    for split in (pieces, list(text), [text]):
        for markers in (None, THINKING):
            assert _feed(StopStringMatcher([stop], exempt=markers), split) == (expected, True), (split, markers)


def _match_in_pieces(matcher, text: str, sizes) -> tuple[str, bool]:
    """``text`` fed to ``matcher`` in pieces of ``sizes`` characters: (text out, stopped)."""
    out, pos = "", 0
    for n in sizes:
        piece, hit = matcher.feed(text[pos:pos + n])
        out, pos = out + piece, pos + n
        if hit:
            return out, True
    rest, hit = matcher.flush()
    return out + rest, hit


@pytest.mark.parametrize("text", [
    'Sure.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> after <b>',
    '<think>hmm, a <tool_call> in thought</think>Then <tool_call>{"x": 1}</tool_call> tail',
    'no markers at all, <tool_ only a start',
])
@pytest.mark.parametrize("stop", ["<", "call", "o", "think", "_", "/", ">"])
def test_stop_matching_does_not_depend_on_how_a_marker_is_tokenized(text, stop):
    """A model may write a marker in several tokens ("<", "tool", "_call", ">"). A stop string
    inside a marker still forming ended the answer there ("Sure.<tool_" for the stop
    "call"), where the same text in one piece (a one-token marker) kept the call."""
    import random

    def run(sizes):
        return _match_in_pieces(StopStringMatcher([stop], exempt=THINKING), text, sizes)

    whole = run([len(text)])
    rng = random.Random(0)
    splits = [[1] * len(text)] + [[rng.randint(1, 4) for _ in range(len(text))] for _ in range(20)]
    for sizes in splits:
        assert run(sizes) == whole, sizes


@pytest.mark.parametrize("exempt", [None, THINKING])
def test_stops_contained_in_one_another_cut_the_same_however_the_text_is_grouped(exempt):
    """The stop that ends first wins, the earlier start on a tie: what a text written a
    character at a time meets first. With ``[" the", "h"]`` the earliest start won, and
    " the end" became "" when " the" came in one token, " t" a character at a time (an
    audit). Random texts and stop sets, whole, in random pieces and a character at a time."""
    import random

    def run(text, stops, sizes):
        return _match_in_pieces(StopStringMatcher(stops, exempt=exempt), text, sizes)

    assert run(" the end", [" the", "h"], [8]) == run(" the end", [" the", "h"], [1] * 8) == (" t", True)
    assert run("a the", ["the", "he"], [5]) == ("a ", True)  # both end at "e": the earlier start
    rng = random.Random(0)
    pieces = ["a", "t", "h", "e", " ", "<", "/", ">", "think", "</think>", "<tool_call>", "</tool_call>", "é", "😀"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 10)))
        stops = ["".join(rng.choice(["t", "h", "e", " ", "<", "/", ">", "think>", "é"]) for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.randint(2, 3))]
        whole = run(text, stops, [len(text)])
        assert run(text, stops, [1] * len(text)) == whole, (text, stops)
        assert run(text, stops, [rng.randint(1, 4) for _ in range(len(text))]) == whole, (text, stops)


def _stop_cut_outside_calls(text: str, stops) -> tuple[str, bool]:
    """The reference cut for a format with call markers (and no reasoning): every place a
    stop begins outside a call (from ``<tool_call>`` to the end of its ``</tool_call>``, or
    the text's end) and ends by the end of the start marker of a call it runs into, the one
    that ends first, the earlier start on a tie."""
    calls, pos = [], 0
    while (start := text.find("<tool_call>", pos)) >= 0:
        close = text.find("</tool_call>", start + len("<tool_call>"))
        pos = len(text) if close < 0 else close + len("</tool_call>")
        calls.append((start, start + len("<tool_call>"), pos))
    hits = [(i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)
            and not any(a <= i < c or (i < a < i + len(s) and i + len(s) > m) for a, m, c in calls)]
    return (text[:min(hits)[1]], True) if hits else (text, False)


def test_a_stop_that_begins_before_a_call_counts_up_to_its_start_marker_however_the_text_is_grouped():
    """A stop that begins before a call's start and ends in its marker (".\n<tool_call>")
    ends the answer there; one that runs on into the call ("\n<tool_call>\n") does not, as
    the call's text is never matched. It was found in a text that came whole and missed
    when ``<tool_call>`` came as one token, and a stop inside the marker ("<t") hid one
    that began before it (review h163); a stop running over a whole call then hid one
    after it, and one running from reasoning into a call matched whole only (review
    h166). Against a reference, whole, in random pieces and a character
    at a time."""
    import random

    def run(text, stops, sizes):
        return _match_in_pieces(StopStringMatcher(stops, exempt=CALL), text, sizes)

    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> }'
    tokens = [5, 1, 11, 1, len(text) - 33, 1, 12, 2]
    for stops, expected in ((["\n<tool_call>\n"], (text, False)), ([".\n<tool_call>"], ("Sure", True)),
                            (["\n<tool", "<t"], ("Sure.", True)), (["<tool_call>"], (text, False)),
                            ([text[2:-1] + "Z", "}"], (text[:-1], True))):
        for sizes in ([len(text)], [1] * len(text), tokens):
            assert run(text, stops, sizes) == expected, (stops, sizes)
    # From reasoning over its end marker into a call: the call's text is not matched either.
    for text, stop, exempt in (("</think>{<tool_call>x", "hink>{<tool_call>x", dataclasses.replace(THINKING, starts_in_reasoning=True)),
                               ("<think></think><tool_call>x", "></think><tool_call>x", THINKING)):
        for sizes in ([len(text)], [1] * len(text)):
            assert _match_in_pieces(StopStringMatcher([stop], exempt=exempt), text, sizes) == (text, False)
    rng = random.Random(0)
    pieces = ["a", "b", " ", "\n", "{", "}", "<", ">", "<tool_call>", "</tool_call>"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        spans = [(i := rng.randrange(len(text)), i + rng.randint(1, 30)) for _ in range(rng.randint(1, 3))]
        stops = [text[i:j] for i, j in spans] + [rng.choice(["b}", "\n<", "a\n", "l>"])]
        expected = _stop_cut_outside_calls(text, stops)
        for sizes in ([len(text)], [1] * len(text), [rng.randint(1, 5) for _ in range(len(text))]):
            assert run(text, stops, sizes) == expected, (text, stops, sizes)


@pytest.mark.parametrize("stop", ["</think>", "<think>", "</thi", "think", "k>"])
@pytest.mark.parametrize("text", ["<think>\nI think.\n</think>\n\nThe answer is 4.", "Answer first. <think>x</think>"])
def test_stop_strings_in_reasoning_markers_do_not_depend_on_tools(stop, text):
    """Only calls are exempt: a stop such as "</think>" cut the answer without tools (the
    matcher knows no markers then) and was swallowed by the marker with tools."""
    plain = _feed(StopStringMatcher([stop]), [text])
    assert plain[1]
    for sizes in ([len(text)], [1] * len(text), [3] * len(text)):
        pieces, pos = [], 0
        for k in sizes:
            pieces.append(text[pos:pos + k])
            pos += k
        assert _feed(StopStringMatcher([stop], exempt=THINKING), [p for p in pieces if p]) == plain, sizes


ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.mark.parametrize("stop", [["}"], ["\n"], ["<tool_call>"], ["</tool_call>"]])
async def test_stop_strings_end_the_text_but_never_cut_a_tool_call(qwen3_5_engine, stop):
    """A stop string that the call's markup or JSON holds ("}", a newline after the opening
    marker in Qwen's format) cut every call into an invalid one. The call is parsed as
    without the stop, and a stop in the text after it still ends the answer."""
    engine = qwen3_5_engine
    m = engine._front.grammar.marker  # a grammar stands in for a model that calls, then writes on
    call = f'{m("<tool_call>")} "\\n{{\\"name\\": \\"add\\", \\"arguments\\": {{\\"a\\": 2, \\"b\\": 3}}}}\\n" {m("</tool_call>")}'
    fmt = {"type": "lark", "grammar": f'start: "ok " {call} "\\nthen}}\\nmore"'}
    plain = await engine.chat(USER, SamplingParams(max_tokens=60), tools=[ADD], response_format=fmt)
    out = await engine.chat(USER, SamplingParams(max_tokens=60, stop=stop), tools=[ADD], response_format=fmt)
    assert [(c.name, c.arguments) for c in plain.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("add", {"a": 2, "b": 3})], out
    assert not out.invalid_tool_calls and out.finish_reason == "tool_calls"
    assert len(out.token_ids) < len(plain.token_ids) or stop[0].startswith("<")  # stopped after the call


NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


@pytest.mark.parametrize("stop", [[], ["}"], ["b"]])
async def test_a_call_spelling_its_end_marker_in_an_argument_is_one_call(qwen3_5_engine, stop):
    """A JSON argument may spell the call's end marker (a grammar takes it: it matches the
    marker by token id). Read by text, the call ended inside the string, was invalid, and
    its rest leaked into the content; a stop string could then cut it."""
    engine = qwen3_5_engine
    m = engine._front.grammar.marker  # a grammar stands in for a model that calls, then writes on
    body = json.dumps('\n{"name": "note", "arguments": {"text": "a</tool_call>b}"}}\n')
    fmt = {"type": "lark", "grammar": f'start: "ok " {m("<tool_call>")} {body} {m("</tool_call>")} "\\nthen}} more"'}
    out = await engine.chat(USER, SamplingParams(max_tokens=80, stop=stop), tools=[NOTE], response_format=fmt)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("note", {"text": "a</tool_call>b}"})], out
    assert not out.invalid_tool_calls and out.finish_reason == "tool_calls"
    assert out.content == {"}": "ok then", "b": "ok then} more"}.get(stop[0] if stop else "", "ok then} more")


@pytest.mark.parametrize("stop", [[], ["tag"]])
async def test_a_call_marker_spelled_in_ordinary_tokens_is_text(qwen3_5_engine, stop):
    """A call opens only where the marker's own special token wrote it, as the call grammars
    write and open it. "<tool_call>" spelled in ordinary tokens (the answer mentions the tag)
    opened a call in the parser and in the stop matcher: the rest of the sentence became an
    invalid call, a real call after it was lost inside it, and a stop string after the
    mention was taken for the call's text and never matched (an audit)."""
    engine = qwen3_5_engine
    m = engine._front.grammar.marker  # a grammar stands in for a model that mentions, then calls
    assert m("<tool_call>").startswith("<[")  # one special token here
    body = json.dumps('\n{"name": "note", "arguments": {"text": "hi"}}\n')
    fmt = {"type": "lark", "grammar": f'start: "Use the <tool_call> tag. " {m("<tool_call>")} {body} '
                                      f'{m("</tool_call>")} " done"'}
    params = SamplingParams(max_tokens=80, stop=stop)
    out = await engine.chat(USER, params, tools=[NOTE], response_format=fmt)
    deltas = [d async for d in engine.stream_chat(USER, params, tools=[NOTE], response_format=fmt)]
    if stop:  # the stop ends the text at the mention, which is no call
        assert out.text == out.content == "Use the <tool_call> ", out
        assert not out.tool_calls and not out.invalid_tool_calls and out.finish_reason == "stop"
    else:
        assert out.content == "Use the <tool_call> tag. done", out
        assert [(c.name, c.arguments) for c in out.tool_calls] == [("note", {"text": "hi"})], out
        assert not out.invalid_tool_calls and out.finish_reason == "tool_calls"
    assert "".join(d.content or "" for d in deltas) == out.content
    assert [(c.name, c.arguments) for d in deltas for c in d.tool_calls] == [(c.name, c.arguments) for c in out.tool_calls]
    assert deltas[-1].finish_reason == out.finish_reason
    # An answer ended at its first call keeps no offset of a start past its end.
    twice = {"type": "lark", "grammar": fmt["grammar"].replace('" done"', f"{m('<tool_call>')} {body} {m('</tool_call>')}")}
    deltas = [d async for d in engine.stream_chat(USER, SamplingParams(max_tokens=80), tools=[NOTE],
                                                  response_format=twice, parallel_tool_calls=False)]
    text = "".join(d.text for d in deltas)
    assert text.endswith("</tool_call>") and text.count("<tool_call>") == 2  # the mention and one call
    assert [c for d in deltas for c in d.call_starts] == [text.rindex("<tool_call>")]


# ---------------------------------------------------------------------------- reasoning usage
def _spelled(engine, text: str) -> list[int]:
    """``text`` in ordinary tokens: markers cut in two, so no special token stands for them."""
    ids = []
    for piece in text.replace("</think>", "</\x00think>").split("\x00"):
        ids += engine.tokenizer.encode(piece, add_special_tokens=False)
    return ids


# (prompt, answer, marker spelled in ordinary tokens). "opened": the prompt ends in <think>,
# as Qwen3.5's template does with thinking on (the factory's leaves it to the answer).
@pytest.mark.parametrize("prompt,answer,spell", [
    ("on", "<think>Count the legs.</think>A cat has four legs.", False),
    ("opened", "Four legs, so four.</think>\n\nA cat has four legs.", False),
    ("on", "<think>Four legs.</think>Four.", True),
    ("opened", "Still thinking about legs and more legs and", False),  # cut at max_tokens
    ("off", "A cat has four legs.", False),
])
async def test_usage_counts_the_tokens_spent_reasoning(qwen3_5_engine, prompt, answer, spell):
    """usage.reasoning_tokens: the answer's tokens through the end of ``</think>`` (the
    marker is found as its token, or as the text of a delta when spelled otherwise); every
    token when cut inside the reasoning; 0 without reasoning. Streamed and whole agree."""
    engine = qwen3_5_engine
    chat, opts = USER, {"reasoning": prompt == "on"}
    if prompt == "opened":
        chat = USER + [{"role": "assistant", "content": "<think>\n"}]
        opts = {"template_kwargs": {"continue_final_message": True}}
    ids = _spelled(engine, answer) if spell else engine.tokenizer.encode(answer, add_special_tokens=False)
    cut = "</think>" not in answer and prompt == "opened"
    eos = engine.loaded.eos_token_ids[0]

    def params():
        return SamplingParams(max_tokens=len(ids) - 2 if cut else len(ids) + 5,
                              logits_processors=[forcing_processor(ids, eos)])

    deltas = [d async for d in engine.stream_chat(chat, params(), **opts)]
    got = [t for d in deltas for t in d.token_ids]
    assert got[: len(ids) - 2] == ids[: len(ids) - 2]
    if cut:
        expected = len(got)
    elif "</think>" not in answer:
        expected = 0
    else:
        marker = _spelled(engine, "</think>") if spell else engine.tokenizer.encode("</think>", add_special_tokens=False)
        assert spell == (len(marker) > 1)
        expected = next(i + len(marker) for i in range(len(got)) if got[i: i + len(marker)] == marker)
    assert deltas[-1].usage.reasoning_tokens == expected, (deltas[-1].usage, got)
    whole = await engine.chat(chat, params(), **opts)
    assert whole.usage.reasoning_tokens == expected
    assert (whole.reasoning != "") == (expected > 0), whole


@contextlib.asynccontextmanager
async def _mistral_engine(llama_path):
    """The llama factory engine reading Mistral's tool calls (mlx-lm's parser: a lone start
    marker, no end marker; the factory tokenizer spells ``[TOOL_CALLS]`` in several tokens)."""
    from mlx_lm.tool_parsers import mistral

    from mlx_tandem import Engine

    async with Engine(llama_path, show_progress=False) as engine:
        engine._front.format = dataclasses.replace(
            engine._front.format, tool_call_start=mistral.tool_call_start, tool_call_end=mistral.tool_call_end,
            tool_parser=mistral.parse_tool_call, tool_format="mistral", template_has_tools=True)
        yield engine


async def test_calls_of_a_format_without_an_end_marker(llama_path):
    """Mistral's calls (mlx-lm's parser: no end marker) run to the end of the answer, and
    stop strings must not cut them either: the exemption was only built for formats with
    an end marker, so stop="," cut the call at its first comma into an invalid one. Nor
    could such a call be forced ("no tool-call markers")."""
    async with _mistral_engine(llama_path) as engine:
        for stop in ([","], ["}"], ["NEVER"]):
            _, params = _forced(engine, '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', stop=stop)
            out = await engine.chat(USER, params, tools=[ADD])
            assert [(c.name, c.arguments) for c in out.tool_calls] == [("add", {"a": 1, "b": 2})], stop
            assert out.finish_reason == "tool_calls" and out.content == ""
        # Calls can be forced in this format too (a JSON list after the marker, which
        # mlx-lm's parser reads), and a JSON response_format still lets the model call.
        for choice in ("required", "add"):
            out = await engine.chat(USER, {"max_tokens": 80}, tools=[ADD], tool_choice=choice)
            assert out.text.startswith("[TOOL_CALLS][{") and len(out.tool_calls) == 1 and not out.invalid_tool_calls
            assert out.tool_calls[0].name == "add" and set(out.tool_calls[0].arguments) == {"a", "b"}
        call = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
        schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
        _, params = _forced(engine, call)
        out = await engine.chat(USER, params, tools=[ADD],
                                response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        # (the forced text's spacing differs from the grammar's JSON, which then picks the values)
        assert [(c.name, set(c.arguments)) for c in out.tool_calls] == [("add", {"a", "b"})]




async def test_a_forced_call_cut_off_in_its_marker_or_before_its_first_call_is_one_cut_call(llama_path):
    """A forced call whose start marker is spelled in several tokens (Mistral's
    ``[TOOL_CALLS]`` in a tokenizer without it as a token), cut off by max_tokens inside the
    marker, left ``[TOOL_CAL`` as the content; cut right after ``[`` its call vanished (no
    call, no content). Each budget now gives one cut call and no content, streamed or not."""
    async with _mistral_engine(llama_path) as engine:
        spelled = len(engine.tokenizer.encode('[TOOL_CALLS][{"', add_special_tokens=False))
        assert spelled > 5  # the marker is several tokens here
        for n in range(1, spelled + 1):
            out = await engine.chat(USER, {"max_tokens": n}, tools=[ADD], tool_choice="required")
            assert len(out.token_ids) == n and out.finish_reason == "length", (n, out)
            assert out.content == "" and not out.tool_calls, (n, out)
            assert len(out.invalid_tool_calls) == 1 and out.invalid_tool_calls[0].truncated, (n, out)
            deltas = [d async for d in engine.stream_chat(USER, {"max_tokens": n}, tools=[ADD], tool_choice="required")]
            assert "".join(d.content for d in deltas) == "", n
            assert len([c for d in deltas for c in d.invalid_tool_calls]) == 1, n
        # Unforced, the same text is the model's: it may be content ("[" starts a list too).
        ids, params = _forced(engine, "[TOOL_CAL")
        out = await engine.chat(USER, dataclasses.replace(params, max_tokens=len(ids)), tools=[ADD])
        assert out.finish_reason == "length" and out.content == "[TOOL_CAL" and not out.invalid_tool_calls, out



@pytest.mark.parametrize("block", [
    '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]',
    'add[ARGS]{"a": 1, "b": 2}add[ARGS]{"a": 3, "b": 4}',
])
async def test_one_call_a_turn_ends_a_format_without_an_end_marker_at_its_first_call(llama_path, block):
    """parallel_tool_calls=False: Mistral's calls run to the end of the answer, so the row
    decoded every call of its block (the output kept the first). It now ends where the
    first call is whole: the same call, fewer tokens, streamed or not."""
    async with _mistral_engine(llama_path) as engine:
        ids, params = _forced(engine, "[TOOL_CALLS]" + block)
        whole = await engine.chat(USER, params, tools=[ADD])
        assert [c.arguments for c in whole.tool_calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
        first = block[: block.index("}}" if block.startswith("[") else "}") + (2 if block.startswith("[") else 1)]
        for stream in (False, True):
            _, params = _forced(engine, "[TOOL_CALLS]" + block)  # (a forcing processor counts its steps)
            if stream:
                deltas = [d async for d in engine.stream_chat(USER, params, tools=[ADD], parallel_tool_calls=False)]
                calls = [c for d in deltas for c in d.tool_calls]
                text, n, finish = "".join(d.text for d in deltas), sum(len(d.token_ids) for d in deltas), \
                    deltas[-1].finish_reason
            else:
                out = await engine.chat(USER, params, tools=[ADD], parallel_tool_calls=False)
                calls, text, n, finish = out.tool_calls, out.text, len(out.token_ids), out.finish_reason
            assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2})]
            assert finish == "tool_calls" and text == "[TOOL_CALLS]" + first, (stream, text)
            assert n < len(ids) and n == len(engine.tokenizer.encode(text, add_special_tokens=False)), (n, len(ids))


# ---------------------------------------------------------------------------- grouping
@pytest.mark.parametrize("invalid_first", [False, True])
@pytest.mark.parametrize("end_tokens", [1, 3, "merged"])
def test_an_answer_ended_at_its_call_is_the_same_however_its_tokens_are_grouped(end_tokens, invalid_first):
    """parallel_tool_calls=False ends the answer at its call. A speculative step can bring
    the call's end and what follows (EOS, more text) in one delta; a plain step brings them
    one by one. The output (tokens, text, usage, call) must not depend on it, also where the
    end marker is several tokens that begin in an earlier delta, or where its last token
    carries what follows ("call>\\n\\n"): the tokens through it are kept, the text to the
    marker's end (the marker's own ids never appear there, and whole deltas were kept).
    ``invalid_first``: an invalid call comes first, whose end does not end the answer; a
    delta holding both was cut at the first marker, before the call it reported."""
    from mlx_lm.tool_parsers.json_tools import parse_tool_call

    from mlx_tandem.chat_format import ChatFormat
    from mlx_tandem.chat_output import ChatOutputParser
    from mlx_tandem.outputs import StreamDelta
    from mlx_tandem.request import Request, SyncSink
    from mlx_tandem.streams import SyncStream

    end = {1: [(9, "</tool_call>")], 3: [(9, "</"), (10, "tool_"), (11, "call>")],
           "merged": [(9, "</"), (10, "tool_"), (12, "call>\n\n")]}[end_tokens]
    fmt = ChatFormat(tool_call_start="<tool_call>", tool_call_end="</tool_call>",
                     tool_call_end_ids=(9,) if end_tokens == 1 else (9, 10, 11),  # how the marker encodes alone
                     tool_format="json_tools", tool_parser=parse_tool_call, template_has_tools=True)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    lead = [(7, "<tool_call>"), (8, "\nnot json\n"), (9, "</tool_call>"), (3, "\n")] if invalid_first else []
    pieces = [*lead, (7, "<tool_call>"), (5, '\n{"name": "add", "arguments": {"a": 1}}\n'), *end,
              (6, "\n<tool"), (4, "_call>")]
    n = len(lead) + 2 + len(end)  # the tokens through the call's end

    class Core:
        early = 0

        def finish_early(self, req, kept_tokens):
            assert kept_tokens == n
            self.early += 1

        def abort(self, req):
            pass

    def run(groups, finish_last):
        core = Core()
        req = Request("r", [1, 2, 3], SamplingParams(), None)
        stream = SyncStream(core, req, SyncSink(), ChatOutputParser(
            fmt, tools=tools, parse_tool_calls=True, max_tool_calls=1))
        for k, group in enumerate(groups):
            last = k == len(groups) - 1
            ends = [len("".join(t for _, t in group[: j + 1])) for j in range(len(group))]
            delta = StreamDelta("r", "".join(t for _, t in group), tuple(i for i, _ in group),
                                finish_reason="stop" if last and finish_last else None, text_ends=tuple(ends))
            stream._accept(delta)
            if stream._done:
                break
        out = stream._output()
        return out, core.early

    plain, early = run([[p] for p in pieces], finish_last=False)
    assert early == 1 and plain.finish_reason == "tool_calls"
    assert plain.token_ids == [i for i, _ in pieces[:n]]
    assert plain.text == "".join(t for _, t in pieces[:n]).removesuffix("\n\n")
    for groups in ([pieces[:2], pieces[2:n + 1]], [pieces[:1], pieces[1:]], [pieces],
                   [pieces[:n - 1], pieces[n - 1:]], [pieces[:3], pieces[3:]]):
        grouped, _ = run(groups, finish_last=True)
        assert (grouped.token_ids, grouped.text, grouped.usage, grouped.finish_reason) == \
            (plain.token_ids, plain.text, plain.usage, plain.finish_reason)
        assert [(c.name, c.arguments) for c in grouped.tool_calls] == [("add", {"a": 1})]


@pytest.mark.parametrize("prefill,answer,reasoning,content", [
    # The prefill leaves a reasoning open: what follows is reasoning until </think>.
    ("<think>\nThe user asks", " about France.\n</think>\n\nParis.", "about France.", "Paris."),
    # A reasoning closed in the prefill: what follows is content.
    ("<think>\nShort.\n</think>\n\nThe capital is", " Paris.", "", " Paris."),
])
async def test_a_prefill_that_opens_reasoning_is_continued_as_reasoning(qwen3_5_engine, prefill, answer,
                                                                        reasoning, content):
    """continue_final_message with a prefill inside its reasoning: only a prompt ending in
    <think> itself was read as reasoning, so the rest of the reasoning and </think> went to
    the content."""
    engine = qwen3_5_engine
    chat = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": prefill}]
    ids = engine.tokenizer.encode(answer, add_special_tokens=False)
    eos = engine.loaded.eos_token_ids[0]
    out = await engine.chat(chat, SamplingParams(max_tokens=len(ids) + 5, logits_processors=[forcing_processor(ids, eos)]),
                            template_kwargs={"continue_final_message": True})
    assert (out.reasoning, out.content) == (reasoning, content)
    assert (out.usage.reasoning_tokens > 0) == bool(reasoning)


def test_reasoning_tokens_of_a_spelled_marker_do_not_depend_on_grouping():
    """</think> written in ordinary tokens: the reasoning counts through the token that
    completes its text. It counted to the end of the delta that closed it, so a speculative
    step that brought the answer's first token in the same delta counted it as reasoning."""
    from mlx_tandem.chat_format import ChatFormat
    from mlx_tandem.chat_output import ChatOutputParser
    from mlx_tandem.outputs import StreamDelta
    from mlx_tandem.request import Request, SyncSink
    from mlx_tandem.streams import SyncStream

    fmt = ChatFormat(think_start="<think>", think_end="</think>", think_end_ids=(99,))
    pieces = [(1, "<think>"), (2, "hm"), (3, "</"), (4, "think"), (5, ">"), (6, "\n\nYes"), (7, ".")]

    class Core:
        def finish_early(self, req):
            pass

        def abort(self, req):
            pass

    def run(groups):
        req = Request("r", [1, 2, 3], SamplingParams(), None)
        stream = SyncStream(Core(), req, SyncSink(), ChatOutputParser(fmt))
        for k, group in enumerate(groups):
            text, ends = "", []
            for _, t in group:
                text += t
                ends.append(len(text))
            stream._accept(StreamDelta("r", text, tuple(i for i, _ in group), text_ends=tuple(ends),
                                       finish_reason="stop" if k == len(groups) - 1 else None))
        return stream._output()

    one_by_one = run([[p] for p in pieces])
    assert one_by_one.usage.reasoning_tokens == 5 and one_by_one.reasoning == "hm"
    for cut in range(1, len(pieces)):
        for size in (2, 3, 4):
            groups = [pieces[:cut]] + [pieces[i:i + size] for i in range(cut, len(pieces), size)]
            assert run(groups).usage.reasoning_tokens == 5, groups

