"""Continuous batching is exact: batched greedy == one-at-a-time greedy, token for token
(on a GPU backend up to near-ties in the logits: tests/numerics.py)."""

from __future__ import annotations

import asyncio

from mlx_tandem import Engine, SamplingParams

from .numerics import same_greedy
from .prompts import chat_prompts
from .reference import reference_greedy


def _max_tokens(i: int) -> int:
    return 4 + (i * 5) % 23  # 4..26, different per request


async def test_batched_greedy_equals_one_at_a_time(engine, model_path):
    await _batched_equals_alone(engine, model_path)


async def test_batched_greedy_equals_one_at_a_time_on_a_mixture_of_experts_checkpoint(qwen3_5_moe_vl_path):
    """Qwen3.5-MoE's layout (a vision checkpoint; its text served by the zero-copy text
    lane): each token routes to its own experts, whatever rows share its batch."""
    async with Engine(qwen3_5_moe_vl_path, show_progress=False) as engine:
        await _batched_equals_alone(engine, qwen3_5_moe_vl_path)


async def _batched_equals_alone(engine, model_path):
    prompts = chat_prompts(20)
    prompt_ids = [engine.apply_chat_template(p) for p in prompts]
    expected = [reference_greedy(model_path, ids, _max_tokens(i)) for i, ids in enumerate(prompt_ids)]

    before = engine.stats()["max_batch_size"]
    outs = await asyncio.gather(*[
        engine.chat(p, SamplingParams(max_tokens=_max_tokens(i))) for i, p in enumerate(prompts)
    ])
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.prompt_token_ids == prompt_ids[i]
        assert out.usage.prompt_tokens == len(prompt_ids[i])
        if same_greedy(out.token_ids, exp, judge=model_path, prompt_ids=prompt_ids[i],
                       what=f"request {i} against the one-at-a-time reference"):
            assert out.finish_reason == ("length" if len(exp) == _max_tokens(i) else "stop")
            assert out.text == engine.tokenizer.decode(exp)
    # They really ran together.
    assert engine.stats()["max_batch_size"] >= max(before, 16)


async def test_requests_join_while_others_decode(engine, model_path):
    first = chat_prompts(8)
    late = chat_prompts(16)[8:]
    prompt_ids = [engine.apply_chat_template(p) for p in first + late]
    expected = [reference_greedy(model_path, ids, 24) for ids in prompt_ids]

    params = SamplingParams(max_tokens=24)
    streams = [await engine.open_chat_stream(p, params) for p in first]
    # Let the first wave start decoding before the second wave arrives.
    for s in streams:
        await s.__anext__()
    late_tasks = [asyncio.create_task(engine.chat(p, params)) for p in late]
    first_outs = [await s.collect() for s in streams]
    late_outs = await asyncio.gather(*late_tasks)
    for i, out in enumerate(first_outs + list(late_outs)):
        same_greedy(out.token_ids, expected[i], judge=model_path, prompt_ids=prompt_ids[i], what=f"request {i}")


async def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    prompt = chat_prompts(1)[0]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234)
    alone = await engine.chat(prompt, params)
    # Same request inside a batch of differently-configured requests.
    others = [
        engine.chat(p, SamplingParams(max_tokens=24, temperature=0.7 + 0.1 * i, top_p=0.9, seed=i))
        for i, p in enumerate(chat_prompts(7))
    ]
    greedy = [engine.chat(p, SamplingParams(max_tokens=24)) for p in chat_prompts(4)]
    together, *rest = await asyncio.gather(engine.chat(prompt, params), *others, *greedy)
    assert together.token_ids == alone.token_ids
    other_seed = await engine.chat(prompt, params.with_updates(seed=99))
    assert other_seed.token_ids != alone.token_ids


async def test_unseeded_sampling_differs_between_engines_in_one_process(llama_path):
    """Each owner thread draws from a key of its own: mlx 0.32 starts every new thread from
    the same key, so a second engine (beside the first, or after it closed) gave the same
    "random" answers."""
    prompts = chat_prompts(4)
    params = SamplingParams(max_tokens=12, temperature=1.0)

    async def answers(engine):
        return [out.token_ids for out in await asyncio.gather(*[engine.chat(p, params) for p in prompts])]

    async with Engine(llama_path, show_progress=False) as engine:
        first = await answers(engine)
    async with Engine(llama_path, show_progress=False) as b, Engine(llama_path, show_progress=False, mtp="off") as c:
        second, third = await asyncio.gather(answers(b), answers(c))
    assert first != second and first != third and second != third


async def test_per_request_temperatures_in_one_batch(engine, model_path):
    """Greedy rows stay exact while sampled rows share the batch."""
    prompts = chat_prompts(8)
    expected = [reference_greedy(model_path, engine.apply_chat_template(p), 16) for p in prompts[::2]]
    params = [SamplingParams(max_tokens=16) if i % 2 == 0 else
              SamplingParams(max_tokens=16, temperature=0.5 + i / 10, top_k=50, min_p=0.05)
              for i in range(8)]
    outs = await asyncio.gather(*[engine.chat(p, sp) for p, sp in zip(prompts, params)])
    assert [o.token_ids for o in outs[::2]] == expected
    assert all(1 <= len(o.token_ids) <= 16 or o.finish_reason == "stop" for o in outs[1::2])
