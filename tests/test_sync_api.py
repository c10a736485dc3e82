"""Synchronous twins: from plain threads, from an event loop's worker thread, from the loop itself."""

from __future__ import annotations

import asyncio
import threading

from mlx_tandem import SamplingParams

from .prompts import chat_prompts
from .reference import reference_greedy


def test_chat_sync_from_many_plain_threads_batches(llama_engine, llama_path):
    prompts = chat_prompts(8)
    expected = [reference_greedy(llama_path, llama_engine.apply_chat_template(p), 16) for p in prompts]
    results = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def work(i):
        barrier.wait()
        results[i] = llama_engine.chat_sync(prompts[i], SamplingParams(max_tokens=16))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.token_ids for r in results] == expected


def test_stream_chat_sync_matches_chat_sync(llama_engine):
    prompt = chat_prompts(1)[0]
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=7)
    deltas = list(llama_engine.stream_chat_sync(prompt, params))
    whole = llama_engine.chat_sync(prompt, params)
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert deltas[-1].finish_reason == whole.finish_reason


async def test_sync_api_inside_a_running_loop(llama_engine):
    prompt = chat_prompts(1)[0]
    params = SamplingParams(max_tokens=12)
    expected = await llama_engine.chat(prompt, params)
    loop = asyncio.get_running_loop()
    # From the loop's worker threads (what run_in_executor / to_thread callers do) ...
    in_executor = await asyncio.gather(*[loop.run_in_executor(None, llama_engine.chat_sync, prompt, params)
                                         for _ in range(4)])
    assert all(r.token_ids == expected.token_ids for r in in_executor)
    # ... and directly on the loop thread: it blocks this loop, but the engine never needs it.
    direct = llama_engine.chat_sync(prompt, params)
    assert direct.token_ids == expected.token_ids


def test_complete_sync_raw_prompt(llama_engine, llama_path):
    ids = llama_engine.tokenizer.encode("def add(a, b):", add_special_tokens=False)
    out = llama_engine.complete_sync(ids, SamplingParams(max_tokens=8))
    assert out.token_ids == reference_greedy(llama_path, ids, 8)
    text_out = llama_engine.complete_sync("def add(a, b):", SamplingParams(max_tokens=8))
    assert text_out.token_ids == out.token_ids
