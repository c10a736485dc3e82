"""OpenAI's presence and frequency penalties, applied as mlx-lm applies them: batched rows
decode as mlx-lm's single-request generate_step does with its own processors."""

from __future__ import annotations

import asyncio

import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlx_tandem import Engine, InvalidRequestError, SamplingParams

from .prompts import chat_prompts
from .reference import _load

PENALTIES = [dict(presence_penalty=2.0), dict(frequency_penalty=1.5), dict(presence_penalty=-1.0, frequency_penalty=0.7),
             dict(presence_penalty=1.0, repetition_penalty=1.2, repetition_context_size=40)]


def _reference(path, prompt_ids: list[int], max_tokens: int, penalties: dict) -> list[int]:
    import mlx.core as mx

    model, tokenizer = _load(str(path))
    window = penalties.get("repetition_context_size", 20)
    processors = make_logits_processors(
        repetition_penalty=penalties.get("repetition_penalty"), repetition_context_size=window,
        presence_penalty=penalties.get("presence_penalty"), presence_context_size=window,
        frequency_penalty=penalties.get("frequency_penalty"), frequency_context_size=window)
    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, logits_processors=processors):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


async def test_penalised_rows_decode_as_mlx_lm_does_alone(llama_engine, llama_path):
    prompts = chat_prompts(8)
    ids = [llama_engine.apply_chat_template(p) for p in prompts]
    settings = [PENALTIES[i % len(PENALTIES)] for i in range(len(prompts))]
    outs = await asyncio.gather(*(llama_engine.complete(i, {"max_tokens": 24, **s}) for i, s in zip(ids, settings)))
    plain = await asyncio.gather(*(llama_engine.complete(i, {"max_tokens": 24}) for i in ids))
    for i, (out, s) in enumerate(zip(outs, settings)):
        assert out.token_ids == _reference(llama_path, ids[i], 24, s), (i, s)
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


def test_penalised_rows_beside_speculating_rows_decode_as_without_mtp(qwen3_5_mtp_path):
    """A penalty reads every position's history, so its row does not draft (as with any
    processor); it shares the speculative batch and keeps its plain output."""
    from mlx_tandem.testing.mtp_distill import default_prompts

    prompts = default_prompts(8)

    async def run(mode):
        async with Engine(qwen3_5_mtp_path, show_progress=False, mtp=mode) as engine:
            outs = await asyncio.gather(
                *(engine.complete(p, {"max_tokens": 16, **PENALTIES[i % len(PENALTIES)]}) for i, p in enumerate(prompts)),
                *(engine.complete(p, {"max_tokens": 16}) for p in prompts))  # greedy rows keep it speculating
            return [o.token_ids for o in outs[:8]], engine.stats()["mtp"]

    plain, _ = asyncio.run(run("off"))
    spec, mtp = asyncio.run(run("on"))
    assert spec == plain
    assert mtp["spec_steps"] > 0 and mtp["accepted"] > 0, mtp
