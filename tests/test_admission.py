"""Memory-aware admission: requests wait while their batch's caches would pass the budget,
the reservation covers what mlx-lm's batch caches really hold, and a request too large for
the budget alone fails with a typed error while the others run."""

from __future__ import annotations

import threading

import time

import pytest

from mlx_tandem import Engine, InvalidRequestError, RequestTooLargeError, SamplingParams
from mlx_tandem.memory import CACHE_STEP, MemoryLedger, derive_budget, device_memory_bytes

from .numerics import same_greedy_rows
from .reference import reference_greedy
from .spies import encoder_passes


def _prompt(n: int, start: int = 100) -> list[int]:
    return [start + (i * 7) % 900 for i in range(n)]


def _ledger(path, **opts) -> MemoryLedger:
    """The ledger an engine on ``path`` builds (its footprint probe), with no budget applied."""
    engine = Engine(str(path), show_progress=False, **opts).start_sync()
    try:
        return engine._core._memory
    finally:
        engine.close_sync()


def _cache_bytes(lane) -> int:
    """What a lane's batch caches hold now: the decode batch, the prompt batch, and (text
    lane) prompt caches restored from the prefix cache that wait for their prefill."""
    gen = lane._gen
    caches = [c for batch in (gen._generation_batch, gen._prompt_batch) if batch is not None
              for c in (batch.prompt_cache or [])]
    if lane.name == "text":  # mlx-lm's queue entries: (uid, tokens, max_tokens, cache, ...)
        caches += [c for seq in gen._unprocessed_sequences for c in (seq[3] or [])]
    return sum(c.nbytes for c in caches)


class _Recorder:
    """Wraps a lane to record, after every step, who runs, what the caches of every lane
    hold and what the ledger reserves; checks that the reservation never passes the budget."""

    def __init__(self, engine: Engine, lane: str = "text"):
        self.core = engine._core
        self.lane = self.core._lanes[lane]
        self.steps: list[tuple[frozenset, int, int]] = []  # (running ids, real bytes, reserved bytes)
        self.added: list[str] = []
        step, add = self.lane.step, self.lane.add

        def recording_step():
            out = step()
            real = sum(_cache_bytes(lane) for lane in self.core._lanes.values())
            memory = self.core._memory
            assert memory.reserved() <= memory.budget
            self.steps.append((frozenset(self.core._running), real, memory.reserved()))
            return out

        def recording_add(request, *waiting):
            add(request, *waiting)
            self.added.append(request.request_id)

        self.lane.step, self.lane.add = recording_step, recording_add

    def max_running(self, *, while_running: str | None = None) -> int:
        return max((len(ids) for ids, _, _ in self.steps if while_running is None or while_running in ids),
                   default=0)


def _burst(engine: Engine, requests: list[tuple[str, list[int], int]]):
    """Submit ``(request_id, prompt ids, max_tokens)`` so that the owner thread takes them in one go."""
    release = threading.Event()
    held = engine._core.call(release.wait)
    streams = [engine.open_complete_stream_sync(ids, SamplingParams(max_tokens=n), request_id=rid)
               for rid, ids, n in requests]
    release.set()
    held.result(10)
    # The loop takes the burst, then admits, then reads its inbox again: the second call
    # runs after the burst's first admission.
    engine._core.call(lambda: None).result(10)
    engine._core.call(lambda: None).result(10)
    return streams


@pytest.mark.parametrize("kind,mtp", [("llama", "off"), ("qwen3_5", "off"), ("qwen3_5", "on")])
def test_the_reservation_covers_what_the_batch_caches_hold(kind, mtp, tiny_models):
    """Against mlx-lm's real batch caches (right-aligned rows, 256-token steps, recurrent
    state, the MTP head's cache), step by step: the ledger never reserves less than the
    caches hold."""
    path = tiny_models.get(kind)
    engine = Engine(str(path), show_progress=False, mtp=mtp).start_sync()
    try:
        rec = _Recorder(engine)
        sizes = [(5, 30), (40, 200), (300, 60), (700, 100), (20, 250), (90, 10)]
        streams = _burst(engine, [(f"r{i}", _prompt(n, 100 + i), m) for i, (n, m) in enumerate(sizes)])
        for s in streams:
            s.collect()
        live = [(real, reserved) for ids, real, reserved in rec.steps if ids and real]
        assert live and all(real <= reserved for real, reserved in live), live
        assert max(len(ids) for ids, _, _ in rec.steps) == len(sizes)  # they ran together
        # Not wildly conservative either: at some step the caches fill most of the reservation
        # (the rest is the 256-token block not yet used, and speculation's recurrent copies).
        assert max(real / reserved for real, reserved in live) > 0.7
        assert engine.stats()["memory"]["reserved_bytes"] == 0
    finally:
        engine.close_sync()


def test_a_specprefill_request_reserves_its_drafts_cache(llama_path, tiny_models):
    """The draft scores the whole prompt in a cache of its own, beside the row's dense part:
    the reservation covers it too where it is larger than the row (here a draft with twice
    the target's attention cache per token, as a Qwen3 draft has beside a hybrid Qwen3.5)."""
    draft = tiny_models.get("draft", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2)
    engine = Engine(str(llama_path), show_progress=False, specprefill_draft=str(draft),
                    specprefill_threshold=256, prefill_step_size=64).start_sync()
    try:
        lane = engine._core._lanes["text"]
        seen_draft = []

        def sparse_bytes() -> int:
            total = 0
            for pending in lane._sparse.values():
                job = pending.job
                total += sum(c.nbytes for c in job.cache)
                if job.scorer is not None and job.scorer.cache is not None:
                    seen_draft.append(sum(c.nbytes for c in job.scorer.cache))
                    total += seen_draft[-1]
            return total

        rec = _Recorder(engine)
        step = lane.step

        def with_sparse():  # measured before the step: a finished job's caches leave in it
            before = sparse_bytes()
            memory = engine._core._memory
            assert before + _cache_bytes(lane) <= memory.reserved(), (before, memory.reserved())
            return step()

        lane.step = with_sparse
        # Alone: a row that shares its batch is reserved as long as the longest, which hides it.
        out = _burst(engine, [("long", _prompt(900, 300), 4)])[0].collect()
        assert out.finish_reason == "length"
        assert engine.stats()["specprefill"]["requests"] == 1 and max(seen_draft) > 0
        assert rec.steps and engine.stats()["memory"]["reserved_bytes"] == 0
    finally:
        engine.close_sync()


def test_densely_prefilled_few_shot_examples_reserve_no_more_than_a_system_prompt(qwen3_5_path, tiny_models):
    """While the draft scores, the target's row holds only what it restored: the dense part
    comes after. It was counted beside the draft, so once shared examples became dense a
    request that had fitted was too large for good (an audit: 3.64 MB against 3.45 MB, over
    a 3.5 MB budget). Same requests, examples dense (history points) or not: the same
    reservations until the examples are cached, each covering the caches really held. (A
    request that restores the examples holds more while the draft scores: really held.)"""
    from .test_specprefill import _few_shot_reports

    draft = tiny_models.get("draft", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2)
    reserved = {}
    for history in (False, True):
        engine = Engine(str(qwen3_5_path), show_progress=False, specprefill_draft=str(draft),
                        specprefill_threshold=256, specprefill_keep_pct=0.5, prefill_step_size=64,
                        prefix_cache_min_tokens=8, prefix_cache_history=history).start_sync()
        try:
            memory, lane = engine._core._memory, engine._core._lanes["text"]
            sides, real_reserve = [], memory.reserve

            def reserve(request_id, lane_name, tokens, side_bytes=0):
                sides.append(side_bytes)
                return real_reserve(request_id, lane_name, tokens, side_bytes)

            memory.reserve = reserve
            step = lane.step

            def checked():
                held = sum(sum(c.nbytes for c in p.job.cache) + (
                    sum(c.nbytes for c in p.job.scorer.cache) if p.job.scorer and p.job.scorer.cache else 0)
                    for p in lane._sparse.values())
                assert held + _cache_bytes(lane) <= memory.reserved()
                return step()

            lane.step = checked
            cached = [engine.chat_sync(_few_shot_reports(f"Report {i}"), {"max_tokens": 4}).usage.cached_tokens
                      for i in range(3)]
            reserved[history] = (sides, cached)
        finally:
            engine.close_sync()
    (plain, cached_plain), (dense, cached_dense) = reserved[False], reserved[True]
    assert cached_dense[2] > cached_plain[2]  # the examples were dense and cached
    assert dense[:2] == plain[:2], (dense, plain)


def test_a_request_too_large_only_with_specprefills_draft_cache_is_prefilled_plainly(llama_path, tiny_models):
    """SpecPrefill is a speed-up: where its draft's cache pushes a request over the budget
    while its own row fits, it runs with a plain prefill (its answer a cold run's), and the
    prefix cache counts its lookup once. Only a request that asked for SpecPrefill fails."""
    draft = tiny_models.get("draft", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2)
    options = dict(show_progress=False, specprefill_draft=str(draft), specprefill_threshold=256,
                   prefill_step_size=64)
    prompt = _prompt(900, 300)
    engine = Engine(str(llama_path), **options).start_sync()
    try:
        memory, seen = engine._core._memory, []
        real_reserve = memory.reserve
        memory.reserve = lambda rid, lane, tokens, side=0: (seen.append((tokens, side)), real_reserve(rid, lane, tokens, side))
        engine.complete_sync(prompt, {"max_tokens": 4})
        (tokens, side), = seen
        alone = memory.alone_bytes("text", tokens)
    finally:
        engine.close_sync()
    assert side > 0
    engine = Engine(str(llama_path), request_memory_bytes=alone + side // 2, **options).start_sync()
    try:
        out = engine.complete_sync(prompt, {"max_tokens": 4})
        stats = engine.stats()
        with pytest.raises(RequestTooLargeError):
            engine.complete_sync(_prompt(900, 301), {"max_tokens": 4, "specprefill": True})  # not cached
    finally:
        engine.close_sync()
    assert out.token_ids == reference_greedy(llama_path, prompt, 4)
    assert stats["specprefill"]["requests"] == 0 and stats["prefix_cache"]["misses"] == 1


def test_a_specprefill_request_waiting_for_memory_is_not_started_again_each_step(llama_path, tiny_models):
    """A SpecPrefill request that fits alone but not beside a running row once its draft's
    cache is counted waits at its place. Its draft's size is known only once the lane took
    it; it is remembered, so the request is not handed to the lane (a prefix-cache lookup,
    a SparsePrefill job) and taken back on every step while it waits: that ran 180 times a
    second here and counted each lookup in the prefix cache's stats. Its answer is the one
    it gives alone."""
    draft = tiny_models.get("draft", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2)
    opts = dict(show_progress=False, specprefill_draft=str(draft), specprefill_threshold=10**6,
                prefill_step_size=64)
    long_prompt, short_prompt = _prompt(600, 300), _prompt(10, 200)
    engine = Engine(str(llama_path), **opts).start_sync()
    try:
        memory = engine._core._memory
        lookahead = engine.options.specprefill_lookahead
        waiting_row = memory.row_tokens("text", len(long_prompt), 8)
        side = memory.scoring_bytes("text", waiting_row, len(long_prompt) + lookahead, 0)
        running_row = memory.row_tokens("text", len(short_prompt), 3000)
        budget = memory.footprint("text").lane_bytes(2, max(running_row, waiting_row)) + side // 2
        assert side > 0 and memory.alone_bytes("text", waiting_row) + side <= budget
        expected = engine.complete_sync(long_prompt, SamplingParams(max_tokens=8, specprefill=True)).token_ids
    finally:
        engine.close_sync()

    engine = Engine(str(llama_path), request_memory_bytes=budget, **opts).start_sync()
    try:
        rec = _Recorder(engine)
        running = engine.open_complete_stream_sync(short_prompt, SamplingParams(max_tokens=3000), request_id="running")
        next(iter(running))
        waiting = engine.open_complete_stream_sync(long_prompt, SamplingParams(max_tokens=8, specprefill=True),
                                                   request_id="waiting")
        steps = len(rec.steps)
        while len(rec.steps) < steps + 20:  # the running row decodes on while the other waits
            time.sleep(0.01)
        assert engine.stats()["memory"]["waiting_for_memory"] == 1
        running.cancel()
        out = waiting.collect()
        assert out.token_ids == expected and engine.stats()["specprefill"]["requests"] == 1
        # Taken once to be measured, once to start; its lookup counted once (the one it used).
        assert rec.added.count("waiting") == 2
        lookups = engine.stats()["prefix_cache"]
        assert lookups["hits"] + lookups["misses"] == 2
    finally:
        engine.close_sync()


def _pause_after_first_step(lane):
    """Make the lane's first step wait until released, so a request can join mid-prefill."""
    step, paused, resume, steps = lane.step, threading.Event(), threading.Event(), [0]

    def pausing_step():
        out = step()
        steps[0] += 1
        if steps[0] == 1:
            paused.set()
            resume.wait(10)
        return out

    lane.step = pausing_step
    return paused, resume


@pytest.mark.parametrize("case", ["prefix_point", "row_leaves", "joins_mid_prefill"])
def test_the_reservation_covers_buffers_grown_from_uneven_ends(case, llama_path):
    """mlx-lm grows a batch buffer in 256-slot steps from wherever its last chunk ended, and
    ``filter`` keeps the spare slots of a row that left, so a buffer can hold up to 255 slots
    past its longest row. Three ways to get there, none covered by rounding to 256:
    a prompt prefilled in two pieces cut at its system-prompt cache point; a short row left
    with a long row's spare slots; a row joining another's prefill between its chunks."""
    engine = Engine(str(llama_path), show_progress=False, mtp="off").start_sync()
    try:
        rec = _Recorder(engine)
        if case == "prefix_point":
            msgs = [{"role": "system", "content": "a" * 80}, {"role": "user", "content": "b" * 280}]
            engine.chat_sync(msgs, SamplingParams(max_tokens=4))
        elif case == "row_leaves":
            for s in _burst(engine, [("A", _prompt(513), 10), ("B", _prompt(240, 300), 15)]):
                s.collect()
        else:
            paused, resume = _pause_after_first_step(rec.lane)
            b = engine.open_complete_stream_sync(_prompt(787), SamplingParams(max_tokens=17), request_id="B")
            assert paused.wait(10)
            a = engine.open_complete_stream_sync(_prompt(600, 300), SamplingParams(max_tokens=10), request_id="A")
            resume.set()
            a.collect(), b.collect()
        live = [(real, reserved) for _, real, reserved in rec.steps if real]
        assert live and all(real <= reserved for real, reserved in live), live
    finally:
        engine.close_sync()


def test_requests_wait_for_memory_and_answer_as_if_alone(qwen3_5_path):
    """Five requests, a budget for two of their batch rows: never more than two run, the
    others wait (counted), and every answer equals the one-at-a-time greedy reference."""
    ledger = _ledger(qwen3_5_path)
    prompts = [_prompt(20 + 9 * i, 200 + i) for i in range(5)]
    longest = max(ledger.row_tokens("text", len(p), 24) for p in prompts)
    budget = ledger.footprints["text"].lane_bytes(2, longest)
    expected = [reference_greedy(qwen3_5_path, p, 24) for p in prompts]

    engine = Engine(str(qwen3_5_path), show_progress=False, request_memory_bytes=budget).start_sync()
    try:
        rec = _Recorder(engine)
        streams = _burst(engine, [(f"r{i}", p, 24) for i, p in enumerate(prompts)])
        assert engine.stats()["memory"]["waiting_for_memory"] == 3
        outs = [s.collect() for s in streams]
        same_greedy_rows([o.token_ids for o in outs], expected, judge=qwen3_5_path, prompts=prompts)
        assert rec.max_running() == 2
        mem = engine.stats()["memory"]
        assert (mem["budget_bytes"], mem["waits"], mem["reserved_bytes"], mem["waiting_for_memory"]) == (budget, 3, 0, 0)
    finally:
        engine.close_sync()


def test_one_long_request_makes_its_whole_batch_long(qwen3_5_path):
    """mlx-lm pads every row of a batch to the longest, so while a long request runs fewer
    short ones fit beside it than fit on their own."""
    ledger = _ledger(qwen3_5_path)
    short = ledger.row_tokens("text", 10, 16)
    long = ledger.row_tokens("text", 400, 16)
    assert short <= CACHE_STEP < long <= 2 * CACHE_STEP
    budget = ledger.footprints["text"].lane_bytes(4, short)
    beside_long = max(n for n in range(1, 5) if ledger.footprints["text"].lane_bytes(n, long) <= budget)
    assert beside_long < 4

    engine = Engine(str(qwen3_5_path), show_progress=False, request_memory_bytes=budget).start_sync()
    try:
        rec = _Recorder(engine)
        reqs = [("long", _prompt(400), 16)] + [(f"s{i}", _prompt(10, 300 + i), 16) for i in range(6)]
        for s in _burst(engine, reqs):
            assert s.collect().finish_reason in ("length", "stop")
        assert rec.max_running(while_running="long") == beside_long
        assert rec.max_running() == 4
        assert all(real <= reserved for _, real, reserved in rec.steps)
    finally:
        engine.close_sync()


def test_small_requests_do_not_overtake_one_waiting_for_memory(qwen3_5_path):
    """First come, first served: a large request waiting for memory holds back a small one
    behind it that would fit now, so large requests are never starved."""
    ledger = _ledger(qwen3_5_path)
    small = ledger.row_tokens("text", 10, 200)
    big = ledger.row_tokens("text", 400, 8)
    budget = ledger.footprints["text"].lane_bytes(2, small)
    assert ledger.footprints["text"].lane_bytes(2, big) > budget >= ledger.alone_bytes("text", big)

    engine = Engine(str(qwen3_5_path), show_progress=False, request_memory_bytes=budget).start_sync()
    try:
        rec = _Recorder(engine)
        first = engine.open_complete_stream_sync(_prompt(10), SamplingParams(max_tokens=200), request_id="A")
        next(iter(first))  # A runs
        later = _burst(engine, [("B", _prompt(400, 150), 8), ("C", _prompt(10, 500), 8)])
        for s in [first, *later]:
            s.collect()
        assert rec.added == ["A", "B", "C"]
        assert not any({"A", "C"} <= ids for ids, _, _ in rec.steps)  # C fitted beside A, yet waited
    finally:
        engine.close_sync()


def test_stats_pair_the_queue_with_the_ledger_of_the_same_moment(llama_path):
    """A reader polling ``stats()`` from another thread while requests queue for memory and
    are cancelled never sees counts from one update beside the ledger from another (it saw
    more waiting for memory than waiting, and rows running with nothing reserved)."""
    import asyncio

    ledger = _ledger(llama_path)
    budget = ledger.footprints["text"].lane_bytes(1, ledger.row_tokens("text", 20, 100))
    engine = Engine(str(llama_path), show_progress=False, prefix_cache_bytes=0,
                    request_memory_bytes=budget).start_sync()
    done, torn, polls = threading.Event(), [], [0]

    def poll():
        while not done.is_set():
            s = engine.stats()
            mem, polls[0] = s["memory"], polls[0] + 1
            if mem["waiting_for_memory"] > s["waiting"] or (s["running"] == 0) != (mem["reserved_bytes"] == 0):
                torn.append((s["running"], s["waiting"], mem["reserved_bytes"], mem["waiting_for_memory"]))

    async def churn():
        for _ in range(6):
            streams = [await engine.open_complete_stream(_prompt(20, 100 + i), SamplingParams(max_tokens=100))
                       for i in range(12)]
            await asyncio.sleep(0.02)
            for s in reversed(streams):  # the queued ones one by one, then the running one
                s.cancel()
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.02)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        asyncio.run(churn())
    finally:
        done.set()
        reader.join()
        engine.close_sync()
    assert polls[0] > 1000 and torn == [], torn[:5]


def test_a_request_too_large_for_the_budget_fails_alone(qwen3_5_path):
    ledger = _ledger(qwen3_5_path)
    budget = ledger.alone_bytes("text", ledger.row_tokens("text", 10, 64))
    engine = Engine(str(qwen3_5_path), show_progress=False, request_memory_bytes=budget).start_sync()
    try:
        ok = engine.open_complete_stream_sync(_prompt(10), SamplingParams(max_tokens=64))
        with pytest.raises(RequestTooLargeError, match="request_memory_bytes") as info:
            engine.complete_sync(_prompt(10), SamplingParams(max_tokens=2 * CACHE_STEP))
        assert isinstance(info.value, InvalidRequestError)
        assert ok.collect().token_ids == reference_greedy(qwen3_5_path, _prompt(10), 64)
        assert engine.complete_sync(_prompt(10), SamplingParams(max_tokens=4)).finish_reason in ("length", "stop")
    finally:
        engine.close_sync()


def test_the_default_budget_is_the_device_share_left_after_the_weights(llama_path):
    engine = Engine(str(llama_path), show_progress=False, memory_fraction=0.5, prefix_cache_bytes=1 << 20).start_sync()
    try:
        budget = engine.stats()["memory"]["budget_bytes"]
        device = device_memory_bytes()
        # The weights (and anything else alive in this process) are what separates them.
        assert device // 2 - (1 << 20) - (1 << 30) < budget < device // 2 - (1 << 20)
    finally:
        engine.close_sync()
    assert derive_budget(None, 0.5, in_use=100, prefix_cache_bytes=50, device_bytes=1000) == 350
    assert derive_budget(None, 0.1, in_use=100, prefix_cache_bytes=50, device_bytes=1000) == 0
    assert derive_budget(12345, 0.1, in_use=100, prefix_cache_bytes=50, device_bytes=1000) == 12345


@pytest.mark.parametrize("info,expected", [
    # What MLX 0.32's device_info says on each backend (CUDA: read on an H200).
    ({"max_recommended_working_set_size": 48 << 30, "memory_size": 64 << 30}, 48 << 30),  # Metal
    ({"total_memory": 150754820096, "free_memory": 149557477376, "architecture": "sm_90"}, 150754820096),  # CUDA
    ({"architecture": "x86_64", "device_name": "AMD EPYC"}, None),  # CPU: the machine's memory
])
def test_device_memory_is_read_per_backend(monkeypatch, info, expected):
    import os

    import mlx.core as mx

    monkeypatch.setattr(mx, "device_info", lambda: dict(info))
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert device_memory_bytes() == (physical if expected is None else expected)


@pytest.mark.parametrize("opts", [dict(request_memory_bytes=0), dict(request_memory_bytes=1.5),
                                  dict(request_memory_bytes=True), dict(memory_fraction=0),
                                  dict(memory_fraction=1.5)])
def test_bad_memory_options(opts):
    with pytest.raises(InvalidRequestError):
        Engine("x", **opts)


def _unexpanded(engine, msgs) -> int:
    """The prompt's length with one placeholder per image, as the front end measures it
    before the vision lane expands the images (apply_chat_template counts them expanded)."""
    return len(engine._front.renderer.render(msgs))


def _image_chat(seed: int) -> list[dict]:
    import numpy as np
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(seed).random((128, 128, 3)) * 255).astype("uint8"))
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "what?"}]}]


def _alone_and_unexpanded(path, msgs):
    """The chat's answer alone (8 tokens) and its prompt's length before image expansion."""
    engine = Engine(str(path), show_progress=False).start_sync()
    try:
        return engine.chat_sync(msgs, SamplingParams(max_tokens=8)), _unexpanded(engine, msgs)
    finally:
        engine.close_sync()


def test_an_image_request_is_measured_with_its_expanded_prompt(qwen3_5_vl_path):
    """The vision lane learns a prompt's image tokens only when it takes the request: one
    that fits before the images are expanded and not after fails typed, leaves nothing
    behind in the lane, and the engine keeps serving both lanes."""
    msgs = _image_chat(seed=0)
    ledger = _ledger(qwen3_5_vl_path)
    engine = Engine(str(qwen3_5_vl_path), show_progress=False,
                    request_memory_bytes=ledger.alone_bytes("vision", CACHE_STEP)).start_sync()
    try:
        small = engine.chat_sync(msgs, SamplingParams(max_tokens=4))
        image_tokens = small.usage.prompt_tokens - _unexpanded(engine, msgs)
        assert image_tokens > 0
        # Before expansion its row fits the budget alone, after it no longer does.
        max_tokens = CACHE_STEP - ledger.row_tokens("vision", _unexpanded(engine, msgs), 0) - image_tokens // 2
        with pytest.raises(RequestTooLargeError):
            engine.chat_sync(msgs, SamplingParams(max_tokens=max_tokens))
        assert engine._core._lanes["vision"].num_active == 0
        assert engine.chat_sync(msgs, SamplingParams(max_tokens=4)).token_ids == small.token_ids
        assert engine.complete_sync(_prompt(10), SamplingParams(max_tokens=4)).finish_reason in ("length", "stop")
        assert engine.stats()["memory"]["reserved_bytes"] == 0
    finally:
        engine.close_sync()


def test_an_image_request_waits_when_its_expanded_prompt_does_not_fit_beside_others(qwen3_5_vl_path, monkeypatch):
    """Measured with its images expanded, an image request that fits alone but not beside a
    running text request waits at its place and runs when the text request is done, with the
    answer it gives alone; the reservation never passes the budget, and the vision encoder
    runs once for it (not once when measured and again when it finally starts)."""
    encoded = encoder_passes(monkeypatch)
    msgs = _image_chat(seed=1)
    ledger = _ledger(qwen3_5_vl_path)
    text_tokens = ledger.row_tokens("text", 10, 200)
    alone, unexpanded = _alone_and_unexpanded(qwen3_5_vl_path, msgs)
    assert alone.usage.prompt_tokens > unexpanded and len(encoded) == 1
    encoded.clear()
    budget = ledger.alone_bytes("text", text_tokens) + ledger.alone_bytes("vision", ledger.row_tokens("vision", unexpanded, 8))

    engine = Engine(str(qwen3_5_vl_path), show_progress=False, request_memory_bytes=budget).start_sync()
    try:
        recs = [_Recorder(engine, "text"), _Recorder(engine, "vision")]
        text = engine.open_complete_stream_sync(_prompt(10), SamplingParams(max_tokens=200), request_id="T")
        next(iter(text))  # T runs
        image = engine.open_chat_stream_sync(msgs, SamplingParams(max_tokens=8), request_id="V")
        assert text.collect().finish_reason == "length"
        assert image.collect().token_ids == alone.token_ids
        assert not any({"T", "V"} <= ids for rec in recs for ids, _, _ in rec.steps)
        assert all(real <= reserved for rec in recs for _, real, reserved in rec.steps)
        assert engine.stats()["memory"]["waits"] == 1
        assert encoded == [alone.usage.prompt_tokens]
    finally:
        engine.close_sync()


def test_an_image_request_cancelled_while_waiting_for_memory_counts_its_expanded_prompt(qwen3_5_vl_path):
    """The request that waits for memory was measured with its images expanded, so a cancel
    before it starts reports the prompt it would have run, not one token per image."""
    msgs = _image_chat(seed=2)
    ledger = _ledger(qwen3_5_vl_path)
    alone, unexpanded = _alone_and_unexpanded(qwen3_5_vl_path, msgs)
    budget = (ledger.alone_bytes("text", ledger.row_tokens("text", 10, 200))
              + ledger.alone_bytes("vision", ledger.row_tokens("vision", unexpanded, 8)))
    engine = Engine(str(qwen3_5_vl_path), show_progress=False, request_memory_bytes=budget).start_sync()
    try:
        text = engine.open_complete_stream_sync(_prompt(10), SamplingParams(max_tokens=200))
        next(iter(text))
        image = engine.open_chat_stream_sync(msgs, SamplingParams(max_tokens=8))
        deadline = time.monotonic() + 60
        while engine.stats()["memory"]["waits"] == 0:  # until the loop has measured it and holds it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        image.cancel()
        out = image.collect()
        text.cancel()
    finally:
        engine.close_sync()
    assert out.finish_reason == "abort" and out.token_ids == []
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens > unexpanded


def test_image_rows_reserve_no_speculation(qwen3_5_vl_path):
    """The vision lane never speculates, so its rows reserve neither the MTP head's cache nor
    the verify step's recurrent copies: its reservation covers its caches and stays close
    to them, where the text lane's cost (with MTP) would be far above."""
    import numpy as np
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(2).random((128, 128, 3)) * 255).astype("uint8"))
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "what?"}]}]
    engine = Engine(str(qwen3_5_vl_path), show_progress=False).start_sync()
    try:
        rec = _Recorder(engine, "vision")
        engine.chat_sync(msgs, SamplingParams(max_tokens=8))
        live = [(real, reserved) for _, real, reserved in rec.steps if real]
        assert live and all(real <= reserved for real, reserved in live)
        assert max(real / reserved for real, reserved in live) > 0.75
        text, vision = (engine.stats()["memory"]["rows"][lane] for lane in ("text", "vision"))
        assert vision["kv_bytes_per_token"] < text["kv_bytes_per_token"]
        assert vision["state_bytes_per_row"] < text["state_bytes_per_row"]
    finally:
        engine.close_sync()


def test_a_budget_too_small_for_text_rows_only_says_so(qwen3_5_vl_path, caplog):
    """A vision row (no MTP head, no verify copies) costs less than a text row: a budget
    between the two serves images, and the start-up warning said every request would fail."""
    import logging

    ledger = _ledger(qwen3_5_vl_path)
    text, vision = ledger.alone_bytes("text", 1), ledger.alone_bytes("vision", 1)
    assert vision < text
    with caplog.at_level(logging.WARNING, logger="mlx_tandem"):
        Engine(str(qwen3_5_vl_path), show_progress=False, request_memory_bytes=(text + vision) // 2).start_sync().close_sync()
    assert "every text request will fail" in caplog.text and "every request" not in caplog.text

