"""Cancellation frees the slot within one engine step; the others are undisturbed."""

from __future__ import annotations

import asyncio

from mlx_tandem import SamplingParams

from .prompts import chat_prompts
from .reference import reference_greedy


def _running_ids(engine) -> set[str]:
    # Runs on the owner thread after every earlier command (aborts included) was applied.
    return engine.run_on_owner_thread(lambda: set(engine._core._running))


async def test_closing_half_of_16_streams(engine, model_path):
    prompts = chat_prompts(16)
    params = SamplingParams(max_tokens=20)
    expected = [reference_greedy(model_path, engine.apply_chat_template(p), 20) for p in prompts]
    aborted_before = engine.stats()["aborted"]

    streams = [await engine.open_chat_stream(p, params) for p in prompts]
    firsts = [await s.__anext__() for s in streams]
    cancelled = streams[1::2]
    for s in cancelled:
        await s.aclose()
    running = _running_ids(engine)
    assert not running & {s.request_id for s in cancelled}

    kept = [await s.collect() for s in streams[0::2]]
    for i, out in zip(range(0, 16, 2), kept):
        assert out.token_ids == expected[i]
    for first, exp in zip(firsts[1::2], expected[1::2]):
        assert list(first.token_ids) == exp[: len(first.token_ids)]
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["aborted"] - aborted_before == 8


async def test_cancelling_the_awaiting_task(engine):
    params = SamplingParams(max_tokens=2000)
    task = asyncio.create_task(engine.chat(chat_prompts(1)[0], params))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if engine.stats()["running"]:
            break
    assert engine.stats()["running"] == 1
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert _running_ids(engine) == set()
    assert engine.stats()["running"] == 0


async def test_cancelling_a_reader_of_a_stream_with_a_timeout_is_never_lost(engine):
    """A stream opened with ``timeout=`` waited with asyncio.wait_for, which before Python
    3.12 swallows a cancel that lands as its get completes: task.cancel() returned True and
    the task read on to the end. Items already queued make that landing deterministic."""
    async def read_all(stream):
        return [d async for d in stream]

    for ticks in range(1, 5):  # (at 0 the task never starts reading: the stream is the caller's)
        stream = await engine.open_chat_stream(chat_prompts(1)[0], SamplingParams(max_tokens=2000), timeout=60)
        await stream.__anext__()
        for _ in range(100):  # let deltas queue up in the sink
            await asyncio.sleep(0.005)
        task = asyncio.create_task(read_all(stream))
        for _ in range(ticks):
            await asyncio.sleep(0)
        assert task.cancel()
        try:
            await task
            raise AssertionError(f"the cancel after {ticks} ticks was lost")
        except asyncio.CancelledError:
            pass
        assert stream.request_id not in _running_ids(engine)


async def test_breaking_out_of_a_stream_aborts(engine):
    params = SamplingParams(max_tokens=2000)
    async for _ in engine.stream_chat(chat_prompts(1)[0], params):
        break
    # The async generator is closed when collected; make that deterministic.
    import gc

    gc.collect()
    await asyncio.sleep(0)
    for _ in range(100):
        if not _running_ids(engine):
            break
        await asyncio.sleep(0.01)
    assert _running_ids(engine) == set()


def test_closing_a_sync_stream(llama_path):
    from mlx_tandem import Engine

    with Engine(llama_path, show_progress=False) as engine:
        stream = engine.stream_chat_sync(chat_prompts(1)[0], SamplingParams(max_tokens=2000))
        next(stream)
        stream.close()
        assert _running_ids(engine) == set()
        assert engine.stats()["aborted"] == 1


async def test_collecting_a_cancelled_stream_returns_what_arrived_as_aborted(engine):
    stream = await engine.open_chat_stream(chat_prompts(1)[0], SamplingParams(max_tokens=50))
    first = await stream.__anext__()
    await stream.aclose()
    out = await stream.collect()
    assert out.finish_reason == "abort"
    assert out.token_ids == list(first.token_ids) and out.text == first.text


def test_collecting_a_closed_sync_stream_returns_what_arrived_as_aborted(llama_path):
    from mlx_tandem import Engine

    with Engine(llama_path, show_progress=False) as engine:
        stream = engine.open_chat_stream_sync(chat_prompts(1)[0], SamplingParams(max_tokens=50))
        first = next(stream)
        stream.close()
        out = stream.collect()
        assert out.finish_reason == "abort" and out.token_ids == list(first.token_ids)
