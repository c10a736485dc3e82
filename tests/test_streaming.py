"""Streaming: UTF-8-safe deltas, no lost spaces, stop strings across token boundaries."""

from __future__ import annotations

import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.detokenizer import StopStringMatcher

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
    m = StopStringMatcher(stop)
    out, was_hit = "", False
    for p in pieces:
        text, was_hit = m.feed(p)
        out += text
        if was_hit:
            break
    assert out == expected and was_hit == hit
