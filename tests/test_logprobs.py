"""Log-probabilities of the answer's tokens (``SamplingParams.logprobs``/``top_logprobs``):
the distribution mlx-lm's single-request generate_step samples from, the same in a batch,
with MTP on, on the vision lane and through both adapters."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mlx_tandem import Engine, InvalidRequestError, SamplingParams

from .prompts import chat_prompts
from .reference import reference_steps

TOL = 2e-3  # float32, a batch of other rows vs one request alone (docs/design.md, "Backends and numerics")


def _reference(path, prompt_ids: list[int], max_tokens: int) -> list[tuple[int, np.ndarray]]:
    """(token, the log-probabilities it was drawn from) one request at a time, greedy."""
    import mlx.core as mx

    return [(t, np.array(lp.astype(mx.float32))) for t, lp in reference_steps(path, prompt_ids, max_tokens)]


def _banned(dist: np.ndarray, ids) -> np.ndarray:
    """``dist`` without ``ids``, normalized again: what a sampler that bans them draws from."""
    dist = dist.copy()
    dist[list(ids)] = -np.inf
    return dist - np.logaddexp.reduce(dist[np.isfinite(dist)])


def _check_against(out, ref, top: int) -> None:
    assert out.token_ids == [t for t, _ in ref]
    assert len(out.logprobs) == len(out.token_ids)
    for lp, (tok, dist) in zip(out.logprobs, ref):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(dist[tok]), abs=TOL)
        assert len(lp.top_logprobs) == top
        want = np.sort(dist)[::-1][:top]
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(list(want), abs=TOL)
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)
        for t in lp.top_logprobs:
            assert t.logprob == pytest.approx(float(dist[t.token_id]), abs=TOL)
        assert lp.top_logprobs[0].token_id == tok  # greedy: the drawn token is the most likely


async def test_logprobs_are_what_mlx_lm_samples_from_alone_and_batched(engine, model_path):
    prompts = chat_prompts(6)
    ids = [engine.apply_chat_template(p) for p in prompts]
    params = SamplingParams(max_tokens=24, logprobs=True, top_logprobs=5)
    # Batched (six rows of different lengths), then each alone.
    batched = await asyncio.gather(*(engine.complete(i, params) for i in ids))
    for i, out in zip(ids, batched):
        _check_against(out, _reference(model_path, i, 24), top=5)
    alone = await engine.complete(ids[0], params)
    assert alone.token_ids == batched[0].token_ids
    assert [lp.logprob for lp in alone.logprobs] == pytest.approx([lp.logprob for lp in batched[0].logprobs], abs=TOL)


async def test_logprobs_are_per_token_of_the_output_and_only_when_asked(llama_engine):
    prompt = chat_prompts(1)[0]
    plain = await llama_engine.chat(prompt, {"max_tokens": 20})
    assert plain.logprobs is None
    out = await llama_engine.chat(prompt, {"max_tokens": 20, "logprobs": True})
    assert out.token_ids == plain.token_ids
    assert all(lp.top_logprobs == () for lp in out.logprobs)
    # Each token's bytes, joined, are the answer's text (a byte-level tokenizer splits characters).
    tok = llama_engine.tokenizer
    assert b"".join(lp.bytes for lp in out.logprobs).decode("utf-8", "replace") == tok.decode(out.token_ids)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    # A stop string cuts the text; the tokens and their logprobs stay paired, through the stop's.
    stop = tok.decode(out.token_ids[5:7]).strip()
    if stop:
        cut = await llama_engine.chat(prompt, {"max_tokens": 20, "logprobs": True, "stop": [stop]})
        assert cut.finish_reason == "stop"
        assert [lp.token_id for lp in cut.logprobs] == cut.token_ids
        assert [lp.logprob for lp in cut.logprobs] == [lp.logprob for lp in out.logprobs[: len(cut.token_ids)]]


async def test_a_chat_without_tools_reports_the_call_marker_as_never_drawn(qwen3_5_engine, qwen3_5_path):
    """Its sampler bans the call marker (as OpenAI's API, a chat without tools calls
    nothing): the marker is out of the distribution, so it is never among the most likely
    and the others' log-probabilities are normalized without it (an audit: the demo model
    put most of its mass there, and a greedy pick read -9 while it was top-1)."""
    marker = qwen3_5_engine.encode("<tool_call>")
    assert len(marker) == 1
    for prompt in chat_prompts(3):
        ids = qwen3_5_engine.apply_chat_template(prompt)
        out = await qwen3_5_engine.chat(prompt, {"max_tokens": 16, "logprobs": True, "top_logprobs": 20})
        ref = [(t, d) for t, d in _reference(qwen3_5_path, ids, 40) if t != marker[0]]
        # The reference may open a call where the engine may not: compare up to there.
        agree = next((i for i, (t, _) in enumerate(ref) if i >= len(out.token_ids) or t != out.token_ids[i]),
                     len(ref))
        for lp, (tok, dist) in zip(out.logprobs[:agree], ref[:agree]):
            want = _banned(dist, marker)
            assert marker[0] not in [t.token_id for t in lp.top_logprobs]
            assert lp.logprob == pytest.approx(float(want[tok]), abs=TOL)
            assert [t.logprob for t in lp.top_logprobs] == pytest.approx(list(np.sort(want)[::-1][:20]), abs=TOL)


async def test_streamed_deltas_carry_their_tokens_logprobs(qwen3_5_engine):
    prompt = chat_prompts(2)[1]
    params = {"max_tokens": 24, "logprobs": True, "top_logprobs": 2}
    whole = await qwen3_5_engine.chat(prompt, params)
    pieces = []
    async with await qwen3_5_engine.open_chat_stream(prompt, params) as stream:
        async for delta in stream:
            assert len(delta.logprobs) == len(delta.token_ids)
            pieces.extend(delta.logprobs)
    # MTP "auto" may speculate in one run and not the other: the same tokens, the values to rounding.
    assert [(lp.token_id, lp.bytes, [t.token_id for t in lp.top_logprobs]) for lp in pieces] == \
        [(lp.token_id, lp.bytes, [t.token_id for t in lp.top_logprobs]) for lp in whole.logprobs]
    assert [lp.logprob for lp in pieces] == pytest.approx([lp.logprob for lp in whole.logprobs], abs=TOL)


async def test_an_answer_cut_after_its_call_keeps_its_tokens_and_logprobs_paired(qwen3_5_engine):
    """``parallel_tool_calls=False`` ends the answer at its call, cutting the delta that
    brought the call's end (streams.py): the logprobs are cut with the tokens."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}}}]
    prompt = [{"role": "user", "content": "Look it up."}]
    out = await qwen3_5_engine.chat(prompt, {"max_tokens": 64, "logprobs": True}, tools=tools,
                                    tool_choice="lookup", parallel_tool_calls=False)
    assert out.finish_reason == "tool_calls" and out.tool_calls
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    # Under the call's grammar the drawn token is always allowed, so never -inf.
    assert all(np.isfinite(lp.logprob) for lp in out.logprobs)


async def test_a_token_holding_part_of_a_character_is_whole_in_its_bytes(qwen3_5_engine):
    """Byte-level BPE splits accented letters, CJK and emoji into byte tokens: alone each
    decodes to U+FFFD, and its ``bytes`` keep it whole, so joined they are the answer's
    UTF-8 (a review: the engine read the vocabulary through the wrong object, and every
    such token's bytes were U+FFFD's)."""
    text = "café 日本 😀"
    out = await qwen3_5_engine.chat([{"role": "user", "content": "Say it."}], {"max_tokens": 40, "logprobs": True},
                                    response_format={"type": "regex", "pattern": text})
    assert out.content == text
    assert any(lp.token == "\ufffd" for lp in out.logprobs)  # the tokenizer did split a character
    assert b"".join(lp.bytes for lp in out.logprobs).decode("utf-8") == text
    assert all(lp.token == lp.bytes.decode("utf-8", "replace") for lp in out.logprobs)


async def test_tokens_a_grammar_forbids_are_never_listed_as_likely(qwen3_5_engine):
    """Where a grammar allows fewer tokens than ``top_logprobs`` asks for, the list holds
    those: forbidden ones were listed at -inf (the lowest ids, in no order), which strict
    JSON encoders refuse and pydantic writes as null (review h153)."""
    out = await qwen3_5_engine.chat([{"role": "user", "content": "Pick."}],
                                    {"max_tokens": 16, "logprobs": True, "top_logprobs": 20},
                                    response_format={"type": "regex", "pattern": "(yes|no)"})
    tops = [lp.top_logprobs for lp in out.logprobs]
    assert out.content in ("yes", "no") and tops
    assert all(top and all(np.isfinite(t.logprob) for t in top) for top in tops)
    assert min(len(top) for top in tops) < 20  # the grammar did hold some position to fewer
    assert all(lp.token_id == top[0].token_id for lp, top in zip(out.logprobs, tops))  # greedy: the likeliest


@pytest.mark.parametrize("bad", [dict(top_logprobs=3), dict(logprobs=True, top_logprobs=21),
                                 dict(logprobs=True, top_logprobs=-1), dict(logprobs="yes"),
                                 dict(logprobs=True, top_logprobs=2.0)])
def test_bad_logprob_settings_are_typed_errors(bad):
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(**bad)


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_logprobs_with_mtp_equal_those_without(qwen3_5_mtp_path, mode):
    """A drafting row's accepted drafts report the verify's distribution at their place and
    the next token the verify's where acceptance stopped: the same as plain steps give,
    beside rows that speculate without logprobs and one that cannot draft (a penalty)."""
    from mlx_tandem.testing.mtp_distill import default_prompts

    prompts = default_prompts(6)
    asks = {"max_tokens": 20, "logprobs": True, "top_logprobs": 3}

    async def run(mtp):
        async with Engine(qwen3_5_mtp_path, show_progress=False, mtp=mtp) as engine:
            outs = await asyncio.gather(
                *(engine.complete(p, asks) for p in prompts[:3]),
                engine.complete(prompts[3], {**asks, "presence_penalty": 0.5}),
                *(engine.complete(p, {"max_tokens": 20}) for p in prompts[4:]))
            before = engine.stats()["mtp"]["accepted"]
            alone = await asyncio.gather(*(engine.complete(p, asks) for p in prompts[:3]))
            return outs + alone, engine.stats()["mtp"]["accepted"] - before

    plain, _ = asyncio.run(run("off"))
    spec, accepted_alone = asyncio.run(run(mode))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for s, p in zip(spec, plain):
        if p.logprobs is None:
            continue
        assert [lp.token_id for lp in s.logprobs] == s.token_ids
        assert [lp.logprob for lp in s.logprobs] == pytest.approx([lp.logprob for lp in p.logprobs], abs=TOL)
        for a, b in zip(s.logprobs, p.logprobs):
            assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=TOL)
            gaps = np.diff([t.logprob for t in b.top_logprobs])
            if len(gaps) == 0 or np.all(np.abs(gaps) > 1e-3):  # no near-tie to reorder
                assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
    if mode == "on":  # the logprob rows draft too: alone (the last three) they are all there is
        assert accepted_alone > 0


def test_a_bf16_checkpoint_kept_bf16_reports_logprobs_within_its_rounding(tiny_models, monkeypatch):
    """On a GPU a bf16 checkpoint stays bf16, and mlx-lm (0.32) takes a plain step's
    log-softmax in bf16: its rounded logsumexp shifted every value (0.026 here), where an
    MTP step's values, taken in float32, did not (review h167). Renormalized in float32,
    the two differ by the rounding of each value only: half a bf16 step of its size."""
    import math

    from mlx_tandem import _platform

    monkeypatch.setattr(_platform, "compute_dtype", lambda: None)  # what a GPU does
    path = tiny_models.get("qwen3_5", dtype="bfloat16")
    asks = {"max_tokens": 8, "logprobs": True, "top_logprobs": 4}

    async def run(mtp):
        async with Engine(path, show_progress=False, mtp=mtp, prefix_cache_bytes=0) as engine:
            assert engine._core.loaded.dtype.endswith("bfloat16")
            return await engine.complete("The quick brown fox jumps over the lazy dog and", asks)

    plain, spec = asyncio.run(run("off")), asyncio.run(run("on"))
    assert spec.token_ids == plain.token_ids

    def half_step(v: float) -> float:  # half a bf16 step (8 significant bits) at |v|
        return 2.0 ** (math.floor(math.log2(abs(v))) - 8) if v else 0.0

    for p, s in zip(plain.logprobs, spec.logprobs):
        assert abs(p.logprob - s.logprob) <= half_step(s.logprob) + 2e-3, (p.logprob, s.logprob)
        for a, b in zip(p.top_logprobs, s.top_logprobs):
            assert abs(a.logprob - b.logprob) <= half_step(b.logprob) + 2e-3, (a.logprob, b.logprob)


def test_image_rows_report_the_distribution_their_tokens_were_drawn_from(qwen3_5_vl_path):
    """The vision lane draws inside the row's processors: each token's logprobs must be the
    distribution of its own step (a user's processor, last before the draw, sees the same
    logits), alone and beside another image row, and restored from the prefix cache."""
    import mlx.core as mx

    from .test_routing import _data_uri, _image, _img_part, _text, _user

    def recorder():
        seen = []

        def processor(tokens, logits):
            seen.append(np.array((logits - mx.logsumexp(logits, axis=-1, keepdims=True)).reshape(-1)))
            return logits
        return seen, processor

    system = {"role": "system", "content": "You describe pictures in plain words. " * 12}
    image = [system, _user(_img_part(_data_uri(_image(5, 64))), _text("What is in this picture?"))]
    other = [_user(_img_part(_data_uri(_image(6, 96))), _text("Describe it in detail, please."))]
    with Engine(qwen3_5_vl_path, show_progress=False) as engine:
        for _ in range(2):  # the second one is restored from the vision prefix cache
            seen, proc = recorder()
            params = {"max_tokens": 16, "logprobs": True, "top_logprobs": 3, "logits_processors": [proc]}

            async def both():
                return await asyncio.gather(engine.chat(image, params), engine.chat(other, {"max_tokens": 20}))

            out, _ = asyncio.run(both())
            assert [lp.token_id for lp in out.logprobs] == out.token_ids
            assert len(seen) >= len(out.token_ids)
            marker = engine.encode("<tool_call>")  # banned after the user's processors: no tools
            for lp, dist in zip(out.logprobs, seen):
                dist = _banned(dist, marker)
                assert lp.logprob == pytest.approx(float(dist[lp.token_id]), abs=1e-5)
                assert lp.top_logprobs[0].token_id == lp.token_id  # greedy
                assert [t.token_id for t in lp.top_logprobs] == list(np.argsort(-dist, kind="stable")[:3])
        assert out.usage.cached_tokens > 0


def test_token_texts_read_sentencepiece_byte_pieces():
    """A SentencePiece byte-fallback vocabulary (Llama 2, Mistral): ``<0xC3>`` is one byte,
    ``▁`` a space; a byte piece alone is U+FFFD as text and whole in its bytes."""
    from tokenizers import Tokenizer, decoders, models

    from mlx_tandem.token_text import TokenTexts

    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581caf": 3, "t": 4}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    texts = TokenTexts(tok, lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert texts.token(3) == (" caf", b" caf")
    assert texts._byte_fallback and not texts._byte_level
    assert texts.token(1) == ("\ufffd", b"\xc3")
    assert b"".join(texts.token(i)[1] for i in (3, 1, 2)).decode() == " café"


def test_the_adapters_report_logprobs_as_their_conventions_say(llama_path):
    """ChatMLX: ChatOpenAI's ``response_metadata["logprobs"]["content"]``, whose streamed
    chunks add up to the whole; MLXTandemLLM: per token the drawn token, then the others."""
    from langchain_core.messages import HumanMessage
    from langchain_mlx_tandem import ChatMLX
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.mlx_tandem import MLXTandemLLM

    prompt = chat_prompts(1)[0][-1]["content"]
    with Engine(llama_path, show_progress=False) as engine:  # no MTP head: the same bits every run
        want = engine.chat_sync([{"role": "user", "content": prompt}],
                                SamplingParams(max_tokens=12, logprobs=True, top_logprobs=2))
    entries = [lp.to_openai() for lp in want.logprobs]
    assert set(entries[0]) == {"token", "logprob", "bytes", "top_logprobs"}

    llm = ChatMLX(model=str(llama_path), max_tokens=12, top_logprobs=2)
    message = llm.invoke(prompt, logprobs=True)
    assert message.response_metadata["logprobs"]["content"] == entries
    full = None
    for chunk in llm.bind(logprobs=True).stream(prompt):
        full = chunk if full is None else full + chunk
    assert full.response_metadata["logprobs"]["content"] == entries
    # generation_info too, streamed or not (LLMResult readers, callbacks), as ChatOpenAI's.
    for streaming in (False, True):
        result = ChatMLX(model=str(llama_path), max_tokens=12, top_logprobs=2, logprobs=True,
                         streaming=streaming).generate([[HumanMessage(prompt)]])
        assert result.generations[0][0].generation_info["logprobs"]["content"] == entries
    assert "logprobs" not in ChatMLX(model=str(llama_path), max_tokens=4).invoke(prompt).response_metadata

    li = MLXTandemLLM(model=str(llama_path), max_tokens=12, logprobs=True, top_logprobs=2)
    response = li.chat([ChatMessage(role="user", content=prompt)])
    assert [[p.token for p in per] for per in response.logprobs] == [
        [lp.token] + [t.token for t in lp.top_logprobs if t.token_id != lp.token_id] for lp in want.logprobs]
    assert [per[0].logprob for per in response.logprobs] == [lp.logprob for lp in want.logprobs]
    assert response.raw["logprobs"]["content"] == entries
    streamed = [per for r in li.stream_chat([ChatMessage(role="user", content=prompt)]) for per in r.logprobs]
    assert streamed == response.logprobs
