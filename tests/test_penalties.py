"""OpenAI's presence and frequency penalties, over the whole answer and never the prompt (as
OpenAI and vLLM apply them), and mlx-lm's repetition penalty over its window: batched rows
decode as mlx-lm's single-request generate_step does with a reference processor."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlx_tandem import Engine, InvalidRequestError, SamplingParams

from .prompts import chat_prompts
from .reference import reference_greedy

PENALTIES = [dict(presence_penalty=2.0), dict(frequency_penalty=1.5), dict(presence_penalty=-1.0, frequency_penalty=0.7),
             dict(presence_penalty=1.0, repetition_penalty=1.2, repetition_context_size=40)]


def _answer_penalties(presence: float, frequency: float):
    """The reference: counts the tokens sampled since its first call (generate_step's first
    call holds the prompt's tail, each later one one more token) with numpy."""
    import mlx.core as mx

    start = None

    def processor(tokens, logits):
        nonlocal start
        start = len(tokens) if start is None else start
        counts = np.bincount(np.array(tokens[start:], dtype=np.int64), minlength=logits.shape[-1])
        return logits - mx.array((frequency * counts + presence * (counts > 0))[None], dtype=logits.dtype)

    return processor


def _reference(path, prompt_ids: list[int], max_tokens: int, penalties: dict) -> list[int]:
    processors = make_logits_processors(repetition_penalty=penalties.get("repetition_penalty"),
                                        repetition_context_size=penalties.get("repetition_context_size", 20))
    processors.append(_answer_penalties(penalties.get("presence_penalty", 0.0), penalties.get("frequency_penalty", 0.0)))
    return reference_greedy(path, prompt_ids, max_tokens, processors)


async def test_penalised_rows_decode_as_mlx_lm_does_alone(llama_engine, llama_path):
    prompts = chat_prompts(8)
    ids = [llama_engine.apply_chat_template(p) for p in prompts]
    settings = [PENALTIES[i % len(PENALTIES)] for i in range(len(prompts))]
    # 48 tokens: an answer longer than the repetition window, whose early tokens still count.
    outs = await asyncio.gather(*(llama_engine.complete(i, {"max_tokens": 48, **s}) for i, s in zip(ids, settings)))
    plain = await asyncio.gather(*(llama_engine.complete(i, {"max_tokens": 48}) for i in ids))
    for i, (out, s) in enumerate(zip(outs, settings)):
        assert out.token_ids == _reference(llama_path, ids[i], 48, s), (i, s)
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain))  # the penalties act


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(presence_penalty="1"),
                                 dict(frequency_penalty=float("nan"))])
def test_penalties_out_of_openais_range_are_typed_errors(bad):
    with pytest.raises(InvalidRequestError, match=next(iter(bad))):
        SamplingParams(**bad)
    # None is "off", as OpenAI reads a null penalty.
    assert SamplingParams.coerce({"presence_penalty": None, "frequency_penalty": None}) == SamplingParams()


def test_the_adapters_pass_the_penalties(llama_path):
    from langchain_mlx_tandem import ChatMLX
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.mlx_tandem import MLXTandemLLM

    prompt = chat_prompts(1)[0][-1]["content"]
    with Engine(llama_path, show_progress=False) as engine:
        want = engine.chat_sync([{"role": "user", "content": prompt}],
                                SamplingParams(max_tokens=16, presence_penalty=2.0, frequency_penalty=1.0)).text
    assert ChatMLX(model=str(llama_path), max_tokens=16, presence_penalty=2.0).invoke(
        prompt, frequency_penalty=1.0).content == want
    llm = MLXTandemLLM(model=str(llama_path), max_tokens=16, presence_penalty=2.0, frequency_penalty=1.0)
    assert llm.chat([ChatMessage(role="user", content=prompt)]).message.content == want


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_penalised_rows_draft_with_mtp_and_decode_as_without_it(qwen3_5_mtp_path, mode):
    """A penalty is a pure function of the token context, so a penalised row drafts: each
    drafted and verified position is penalised with the context a plain step there would
    hold (spec/batch.PenaltyWalk). Its tokens (and logprobs) equal MTP off, beside greedy
    rows that speculate and a row held to a grammar."""
    from mlx_tandem.testing.mtp_distill import default_prompts

    prompts = default_prompts(8)
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"]}}}

    async def run(mtp):
        async with Engine(qwen3_5_mtp_path, show_progress=False, mtp=mtp) as engine:
            outs = await asyncio.gather(
                *(engine.complete(p, {"max_tokens": 16, **PENALTIES[i % len(PENALTIES)]}) for i, p in enumerate(prompts)),
                *(engine.complete(p, {"max_tokens": 16}) for p in prompts),  # greedy rows keep it speculating
                engine.chat([{"role": "user", "content": prompts[0]}],
                            {"max_tokens": 24, "presence_penalty": 1.0, "logprobs": True}, response_format=schema))
            # Mild penalties keep the answers the head was distilled on: their drafts are
            # accepted (strong ones rewrite the answer, where it drafts poorly).
            before = engine.stats()["mtp"]["accepted"]
            mild = await asyncio.gather(*(engine.complete(p, {"max_tokens": 16, "presence_penalty": 0.1,
                                                                 "repetition_penalty": 1.01}) for p in prompts[:3]))
            return outs + mild, engine.stats()["mtp"]["accepted"] - before

    plain, _ = asyncio.run(run("off"))
    spec, accepted_alone = asyncio.run(run(mode))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [lp.logprob for lp in spec[16].logprobs] == pytest.approx([lp.logprob for lp in plain[16].logprobs], abs=2e-3)
    if mode == "on":
        assert accepted_alone > 0  # the penalised rows drafted: alone they are all there is


def test_cached_prompts_and_image_rows_penalise_the_answer_only(qwen3_5_vl_path):
    """A row restored from the prefix cache and an image row (its prompt expanded by the
    processor) count from where their answers start: each decodes as the same request with
    the reference processor in place of the built-in penalties."""
    from .test_routing import _data_uri, _image, _img_part, _text, _user

    system = {"role": "system", "content": "You answer questions about the weather. " * 12}
    text = [system, {"role": "user", "content": "Is it going to rain tomorrow?"}]
    image = [system, _user(_img_part(_data_uri(_image(3, 64))), _text("What is in this picture?"))]
    s = dict(presence_penalty=-2.0, frequency_penalty=-2.0)  # the random model repeats nothing unpushed
    with Engine(qwen3_5_vl_path, show_progress=False) as engine:
        # Each twice: the second image request is restored from the vision lane's cache,
        # whose token context then holds only the prompt's suffix (found by a review).
        for messages in (text, text, image, image):
            got = engine.chat_sync(messages, {"max_tokens": 40, **s})
            want = engine.chat_sync(messages, {"max_tokens": 40, "logits_processors": [_answer_penalties(**{
                "presence": s["presence_penalty"], "frequency": s["frequency_penalty"]})]})
            assert got.token_ids == want.token_ids
            assert got.token_ids != engine.chat_sync(messages, {"max_tokens": 40}).token_ids  # they act
        assert engine.stats()["prefix_cache"]["hits"] > 0
        assert got.usage.cached_tokens > 0  # the last image request was restored
