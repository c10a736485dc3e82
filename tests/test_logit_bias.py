"""OpenAI's ``logit_bias``: batched rows decode as mlx-lm's single-request generate_step with
mlx-lm's own bias processor; -100 bans a token, 100 forces it; typed errors for bad input."""

from __future__ import annotations

import asyncio

import pytest

from mlx_tandem import Engine, InvalidRequestError, SamplingParams

from .prompts import chat_prompts
from .reference import reference_greedy


def _reference(path, prompt_ids: list[int], max_tokens: int, bias: dict) -> list[int]:
    from mlx_lm.sample_utils import make_logits_processors

    return reference_greedy(path, prompt_ids, max_tokens, make_logits_processors(logit_bias=bias))


async def test_biased_rows_decode_as_mlx_lm_does_alone(llama_engine, llama_path):
    prompts = chat_prompts(6)
    ids = [llama_engine.apply_chat_template(p) for p in prompts]
    plain = await asyncio.gather(*(llama_engine.complete(i, {"max_tokens": 24}) for i in ids))
    # Each row pushes its own plain answer's second token down and another token up.
    biases = [{o.token_ids[1]: -5.0, (o.token_ids[1] + 7) % 1000: 4.0 + i} for i, o in enumerate(plain)]
    outs = await asyncio.gather(*(llama_engine.complete(i, {"max_tokens": 24, "logit_bias": b})
                                  for i, b in zip(ids, biases)))
    for i, (out, bias) in enumerate(zip(outs, biases)):
        assert out.token_ids == _reference(llama_path, ids[i], 24, bias), i
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain))  # the biases act


async def test_minus_100_bans_a_token_and_100_forces_one(qwen3_5_engine):
    prompt = chat_prompts(1)[0]
    plain = await qwen3_5_engine.chat(prompt, {"max_tokens": 16})
    first = plain.token_ids[0]
    banned = await qwen3_5_engine.chat(prompt, {"max_tokens": 16, "logit_bias": {str(first): -100},
                                                "logprobs": True, "top_logprobs": 5})
    assert first not in banned.token_ids
    assert all(t.token_id != first for lp in banned.logprobs for t in lp.top_logprobs)  # after the bias
    forced = await qwen3_5_engine.chat(prompt, {"max_tokens": 6, "logit_bias": {42: 100}})
    assert forced.token_ids == [42] * 6


@pytest.mark.parametrize("bad", [{1: 101}, {1: float("nan")}, {-1: 1.0}, {"x": 1.0}, {True: 1.0}, {1.5: 2.0},
                                 [1, 2], "bias", {"²": 1.0}, {"٣": 1.0}])  # digits int() refuses, or reads
def test_bad_logit_bias_is_a_typed_error(bad):
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=bad)


def test_logit_bias_keys_may_be_json_strings_and_ids_are_checked_against_the_vocabulary(llama_engine):
    assert SamplingParams(logit_bias={"7": 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1))
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llama_engine.chat_sync(chat_prompts(1)[0], {"logit_bias": {10**7: 1.0}})


def test_biased_rows_draft_with_mtp_and_decode_as_without_it(qwen3_5_mtp_path):
    """A bias is history-free, as a ban: a biased row drafts, every drafted and verified
    position biased as its processor biases a plain step; its tokens and logprobs equal
    MTP off, beside unbiased rows and one held to a JSON schema."""
    from mlx_tandem.testing.mtp_distill import default_prompts

    prompts = default_prompts(6)
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"]}}}

    async def run(mode):
        async with Engine(qwen3_5_mtp_path, show_progress=False, mtp=mode) as engine:
            biased = [{"max_tokens": 16, "logit_bias": {5 + i: 3.0, 40 + i: -2.0}, "logprobs": True} for i in range(3)]
            outs = await asyncio.gather(*(engine.complete(p, b) for p, b in zip(prompts, biased)),
                                        *(engine.complete(p, {"max_tokens": 16}) for p in prompts[3:]),
                                        engine.chat([{"role": "user", "content": prompts[0]}],
                                                    {"max_tokens": 24, "logit_bias": {7: 2.0}},
                                                    response_format=schema))
            # A strong bias takes the answer where the head (distilled on unbiased answers)
            # drafts poorly; a mild one keeps the answer, and its drafts are accepted.
            before = engine.stats()["mtp"]["accepted"]
            mild = [{"max_tokens": 16, "logit_bias": {2000 + i: -100}, "logprobs": True} for i in range(3)]
            alone = await asyncio.gather(*(engine.complete(p, b) for p, b in zip(prompts, mild)))
            return outs + alone, engine.stats()["mtp"]["accepted"] - before

    plain, _ = asyncio.run(run("off"))
    spec, accepted_alone = asyncio.run(run("on"))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for s, p in zip(spec, plain):
        if p.logprobs is not None:
            assert [lp.logprob for lp in s.logprobs] == pytest.approx([lp.logprob for lp in p.logprobs], abs=2e-3)
    assert accepted_alone > 0  # the biased rows drafted: alone they are all there is


def test_the_adapters_pass_the_logit_bias(llama_path):
    from langchain_mlx_tandem import ChatMLX
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.mlx_tandem import MLXTandemLLM

    prompt = chat_prompts(1)[0][-1]["content"]
    bias = {11: 6.0, 12: 5.0}
    with Engine(llama_path, show_progress=False) as engine:
        want = engine.chat_sync([{"role": "user", "content": prompt}], {"max_tokens": 12, "logit_bias": bias}).text
        assert want != engine.chat_sync([{"role": "user", "content": prompt}], {"max_tokens": 12}).text
    assert ChatMLX(model=str(llama_path), max_tokens=12, logit_bias=bias).invoke(prompt).content == want
    assert ChatMLX(model=str(llama_path), max_tokens=12).invoke(prompt, logit_bias=bias).content == want
    llm = MLXTandemLLM(model=str(llama_path), max_tokens=12, logit_bias=bias)
    assert llm.chat([ChatMessage(role="user", content=prompt)]).message.content == want
