"""Requests that arrive together with one system prompt prefill it once.

A row in prefill claims the prefixes it will store; a request sharing one waits for the
snapshot and starts from it. Each answer is compared with a cold one-request reference, and
the claims must always be given back (a leaked claim would hold its waiters for good).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from mlx_tandem import Engine, SamplingParams
from mlx_tandem.request import Request

from .reference import reference_greedy
from .test_prefix_cache import SYSTEM, TOOLS, _user


def _chats(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(i)}] for i in range(n)]


async def _wave(path, n: int, **options):
    """``n`` chats sharing a system prompt, submitted at once (one coalesced admission)."""
    chats = _chats(n)
    async with Engine(path, show_progress=False, prefix_cache_min_tokens=8, coalesce_ms=300,
                      **options) as engine:
        ids = [engine.apply_chat_template(c, tools=TOOLS) for c in chats]
        system = {k: p for p, k in engine._front.renderer.cache_points(chats[0], ids[0], tools=TOOLS)}["system"]
        outs = await asyncio.gather(*[engine.chat(c, SamplingParams(max_tokens=8), tools=TOOLS) for c in chats])
        stats = engine.stats()
        claims = engine.run_on_owner_thread(lambda: len(engine._core._lanes["text"]._claims))
    return ids, system, outs, stats, claims


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
async def test_concurrent_requests_prefill_their_shared_system_prompt_once(kind, request):
    path = request.getfixturevalue(f"{kind}_path")
    ids, system, outs, stats, claims = await _wave(path, 5)
    for i, (out, p) in enumerate(zip(outs, ids)):
        assert out.token_ids == reference_greedy(path, p, 8), f"chat {i} diverged from its cold run"
    cached = sorted(out.usage.cached_tokens for out in outs)
    # One request prefilled the system prompt; every other one started from its snapshot.
    assert cached[0] < system <= cached[1]
    assert stats["prefix_cache"]["prefill_waits"] >= 1
    # What the forward passes prefilled: each prompt less its cached tokens and its last one
    # (mlx-lm feeds that as the first decode input).
    assert stats["prefill_tokens"] == sum(len(p) - 1 for p in ids) - sum(cached)
    assert claims == 0


async def test_without_waiting_each_request_prefills_its_own_copy(qwen3_5_path):
    ids, system, outs, stats, claims = await _wave(qwen3_5_path, 3, prefix_cache_wait_for_prefill=False)
    for out, p in zip(outs, ids):
        assert out.token_ids == reference_greedy(qwen3_5_path, p, 8)
    assert stats["prefix_cache"]["prefill_waits"] == 0
    assert all(out.usage.cached_tokens < system for out in outs)  # all admitted together, all missed
    assert stats["prefill_tokens"] == sum(len(p) - 1 for p in ids)


async def test_requests_held_for_a_shared_prefix_do_not_count_against_max_waiting(qwen3_5_path):
    """A request kept back a step for a system prompt another row is storing could start
    now: counted as waiting, a burst of four with ``max_waiting=2`` and free slots failed
    with QueueFullError (review h164; ChatMLX's ``n`` shares its whole prompt, so it failed
    too). All four run, and match their cold runs."""
    ids, system, outs, stats, claims = await _wave(qwen3_5_path, 4, max_waiting=2, max_batch_size=8)
    for out, p in zip(outs, ids):
        assert out.token_ids == reference_greedy(qwen3_5_path, p, 8)
    assert stats["prefix_cache"]["prefill_waits"] >= 2 and stats["failed"] == 0
    assert sorted(out.usage.cached_tokens for out in outs)[1] >= system
    assert claims == 0


async def test_a_claim_is_given_back_when_its_row_leaves_before_storing(qwen3_5_path):
    """A waiter goes on when the row it waits for is removed (cancelled, failed) mid-prefill,
    or the lane is reset; it then prefills the prefix itself."""
    chats = _chats(2)
    async with Engine(qwen3_5_path, show_progress=False, prefix_cache_min_tokens=8) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        points = [engine._front.renderer.cache_points(c, p) for c, p in zip(chats, ids)]
        lane = engine._core._lanes["text"]

        def requests():
            return [Request(f"r{i}", p, SamplingParams(), sink=None, max_tokens=4, cache_points=pts)
                    for i, (p, pts) in enumerate(zip(ids, points))]

        def check(leave):
            first, second = requests()
            assert not lane.defer(second)  # nothing claimed yet
            lane.add(first)  # inserted, not stepped: its prefill has not started
            waits = lane.defer(second)
            leave(first)
            return waits, lane.defer(second), len(lane._claims)

        removed = engine.run_on_owner_thread(lambda: check(lambda r: lane.remove([r.request_id])))
        reset = engine.run_on_owner_thread(lambda: check(lambda r: lane.reset()))
        # The engine goes on: the claimed prefix was never stored, so this is a cold prefill.
        out = await engine.chat(chats[1], SamplingParams(max_tokens=6))
    assert removed == (True, False, 0) and reset == (True, False, 0)
    assert out.usage.cached_tokens == 0 and out.token_ids == reference_greedy(qwen3_5_path, ids[1], 6)


async def test_when_the_row_waited_for_leaves_the_first_waiter_to_start_claims_again(qwen3_5_path):
    """The row claiming a prefix is cancelled before storing it: the waiters go on, the
    first to start claims the prefix again, and the others wait for that claim instead of
    each prefilling the prefix (an audit: five waiters each prefilled a 3.9K-token
    document). A wave whose first row is cancelled then prefills the prefix once more."""
    chats = _chats(4)
    async with Engine(qwen3_5_path, show_progress=False, prefix_cache_min_tokens=8) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        points = [engine._front.renderer.cache_points(c, p) for c, p in zip(chats, ids)]
        system = {k: p for p, k in points[0]}["system"]
        lane = engine._core._lanes["text"]
        requests = [Request(f"r{i}", p, SamplingParams(), sink=None, max_tokens=4, cache_points=pts)
                    for i, (p, pts) in enumerate(zip(ids, points))]

        def check():
            first, second, third, fourth = requests
            lane.add(first)
            waits = [lane.defer(r) for r in (second, third, fourth)]
            lane.remove([first.request_id])  # cancelled before its prefill stored anything
            assert not lane.defer(second)  # its claim is given back: the first waiter starts
            lane.add(second)  # and claims the prefix again
            again = [lane.defer(r) for r in (third, fourth)]
            lane.remove([second.request_id])
            return waits, again, len(lane._claims)

        assert engine.run_on_owner_thread(check) == ([True] * 3, [True, True], 0)
        # End to end: the first of a wave cancelled mid-prefill; the answers are cold runs'.
        first = await engine.open_chat_stream(chats[0], SamplingParams(max_tokens=6))
        rest = [asyncio.ensure_future(engine.chat(c, SamplingParams(max_tokens=6))) for c in chats[1:]]
        await asyncio.sleep(0)
        first.cancel()
        outs = await asyncio.gather(*rest)
        stats = engine.stats()["prefix_cache"]
    for out, p in zip(outs, ids[1:]):
        assert out.token_ids == reference_greedy(qwen3_5_path, p, 6)
    assert max(out.usage.cached_tokens for out in outs) >= system and stats["entries"] >= 1


async def test_a_request_waits_only_when_the_claim_adds_enough(qwen3_5_path):
    """Waiting costs a step: a claimed prefix no longer than the cached one by
    ``prefix_cache_min_tokens`` is not worth it. (Both rows hold one prompt: without shared
    points, the second gives the first no point of its own where they part.)"""
    chats = _chats(2)
    async with Engine(qwen3_5_path, show_progress=False, prefix_cache_min_tokens=8,
                      prefix_cache_shared=False) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        points = [engine._front.renderer.cache_points(c, p) for c, p in zip(chats, ids)]
        system = {k: p for p, k in points[0]}["system"]
        await engine.chat(chats[0], SamplingParams(max_tokens=2))  # stores the system prompt
        lane = engine._core._lanes["text"]

        def probe(extra: int):
            # A row about to store a prefix ``extra`` tokens past the cached system prompt.
            first = Request("a", ids[1], SamplingParams(), sink=None, max_tokens=2,
                            cache_points=[(system + extra, "turn")])
            second = Request("b", ids[1], SamplingParams(), sink=None, max_tokens=2,
                             cache_points=[(system, "system"), (system + extra, "turn")])
            lane.add(first)
            claims, waits = len(lane._claims), lane.defer(second)
            lane.remove(["a"])
            return claims, waits

        assert engine.run_on_owner_thread(lambda: probe(4)) == (1, False)
        assert engine.run_on_owner_thread(lambda: probe(8)) == (1, True)  # prefix_cache_min_tokens


def _forget_the_floor(engine: Engine) -> None:
    """As for a model whose cache layout the footprint cannot read (``complete`` False): the
    cache knows no snapshot it would refuse until it refuses one."""
    engine.run_on_owner_thread(lambda: engine._core._lanes["text"].prefix_cache._refusals.clear())


async def test_where_the_budget_refuses_the_snapshot_the_waiters_go_on_together(qwen3_5_path):
    """Each request waits once: released without a snapshot, the waiters all start in the
    next admission, instead of each waiting for the one before it to prefill the prefix."""
    chats = _chats(4)
    async with Engine(qwen3_5_path, show_progress=False, prefix_cache_min_tokens=8, coalesce_ms=300,
                      prefix_cache_bytes=1) as engine:  # nothing fits: every store is refused
        _forget_the_floor(engine)
        ids = [engine.apply_chat_template(c) for c in chats]
        lane, core = engine._core._lanes["text"], engine._core
        added_at = {}
        real_add = lane.add

        def add(request, *waiting):
            added_at[request.request_id] = core.stats.steps
            return real_add(request, *waiting)

        lane.add = add
        outs = await asyncio.gather(*[engine.chat(c, SamplingParams(max_tokens=6)) for c in chats])
        stats = engine.stats()["prefix_cache"]
    for out, p in zip(outs, ids):
        assert out.token_ids == reference_greedy(qwen3_5_path, p, 6) and out.usage.cached_tokens == 0
    assert stats["entries"] == 0 and stats["prefill_waits"] == 3
    first, *waiters = sorted(added_at.values())
    assert first < waiters[0] == waiters[-1]  # one wait, then all three at once


@pytest.mark.parametrize("floor", ["known", "learned"])
async def test_once_the_budget_refused_a_prefix_no_request_waits_for_it_again(qwen3_5_path, floor):
    """A snapshot too large for the budget is not claimed again: later waves run as if the
    cache were off (no waits, the prompt not cut), with the same answers. Where the
    model's footprint gives the floor, the first wave knows it too (it waited once)."""
    async with Engine(qwen3_5_path, show_progress=False, prefix_cache_min_tokens=8, coalesce_ms=300,
                      prefix_cache_bytes=1) as engine:
        if floor == "learned":
            _forget_the_floor(engine)
        lane = engine._core._lanes["text"]
        waits, cut = [], []
        for wave in range(3):
            chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(3 * wave + i)}]
                     for i in range(3)]
            ids = [engine.apply_chat_template(c) for c in chats]
            outs = await asyncio.gather(*[engine.chat(c, SamplingParams(max_tokens=6)) for c in chats])
            for out, p in zip(outs, ids):
                assert out.token_ids == reference_greedy(qwen3_5_path, p, 6)
            waits.append(engine.stats()["prefix_cache"]["prefill_waits"])
            probe = Request("probe", ids[0], SamplingParams(), sink=None,
                            cache_points=engine._front.renderer.cache_points(chats[0], ids[0]))
            cut.append(engine.run_on_owner_thread(lambda: lane._snapshot_points(probe, 0)))
        stats = engine.stats()["prefix_cache"]
    # Learned: the first wave waited and learned it, no wait after; known: no wait at all.
    assert waits == ([2, 2, 2] if floor == "learned" else [0, 0, 0])
    assert cut == [[], [], []] and stats["entries"] == 0 and stats["refused"] >= 1


async def test_a_specprefill_job_claims_its_system_prompt_once_it_prefills_it(llama_path, draft_path):
    """Jobs advance one at a time, oldest first, each scoring its whole prompt before its
    dense part: a request waiting on a job still queued or scoring waited for all of that
    (an audit measured 25 times its TTFT). The claim comes when the dense part starts, and
    is given back when it is stored."""
    from .test_specprefill import _engine, _gauge_reports

    long_chat = _gauge_reports()[0]
    short_chat = [long_chat[0], {"role": "user", "content": "Any floods?"}]
    async with _engine(llama_path, draft_path, specprefill_keep_pct=0.5) as engine:
        ids = [engine.apply_chat_template(c) for c in (long_chat, short_chat)]
        points = [engine._front.renderer.cache_points(c, p) for c, p in zip((long_chat, short_chat), ids)]
        system = {k: p for p, k in points[0]}["system"]
        lane = engine._core._lanes["text"]

        def walk():
            job_req = Request("s", ids[0], SamplingParams(), sink=None, max_tokens=2, cache_points=points[0])
            waiter = Request("w", ids[1], SamplingParams(), sink=None, max_tokens=2, cache_points=points[1])
            lane.add(job_req)
            job = lane._sparse["s"].job
            seen = []  # (scored, dense part pending, claims, would the waiter wait)
            while "s" in lane._sparse:
                seen.append((job.runs is not None, job.dense_pending, len(lane._claims), lane.defer(waiter)))
                lane._advance_sparse()
            lane.remove(["s"])
            return seen, lane.prefix_cache.contains(ids[0][:system])

        seen, stored = engine.run_on_owner_thread(walk)
    assert stored
    scoring = [s for s in seen if not s[0]]
    dense = [s for s in seen if s[0] and s[1]]
    assert scoring and all(claims == 0 and not waits for _, _, claims, waits in scoring)
    assert dense and all(claims == 1 and waits for _, _, claims, waits in dense)
    assert all(claims == 0 for scored, pending, claims, _ in seen if scored and not pending)


async def test_a_claim_never_outlives_its_rows_prompt(qwen3_5_path):
    """Should a row's point not be met where it was expected, its claim goes when the row's
    prompt is done, not when its answer is: its waiters would wait for the whole answer."""
    chats = _chats(1)
    async with Engine(qwen3_5_path, show_progress=False, prefix_cache_min_tokens=8) as engine:
        ids = engine.apply_chat_template(chats[0])
        points = engine._front.renderer.cache_points(chats[0], ids)
        lane = engine._core._lanes["text"]

        def walk():
            lane.add(Request("a", ids, SamplingParams(), sink=None, max_tokens=40, cache_points=points))
            (caching,) = lane._caching.values()
            caching.points = [(p + 1, kind) for p, kind in caching.points]  # no segment ends there
            claims_before = len(lane._claims)
            for _ in range(100):  # the prompt takes a few steps
                if any(ev.tokens for ev in lane.step()[0]):
                    break
            claims_decoding = len(lane._claims)
            lane.remove(["a"])
            return claims_before, claims_decoding

        assert engine.run_on_owner_thread(walk) == (len(points), 0)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
async def test_requests_sharing_few_shot_examples_prefill_them_once(kind, request):
    """Few-shot examples written as messages are no system prompt: requests arriving
    together with the same examples and different questions each prefilled them. The
    renderer makes no point there for the first request to hold them (prompt.py: a history
    is found from its second request on), but the first sees the others queued behind it,
    stores the prefix they share (a "shared" point) and they wait for its snapshot."""
    from .test_prefix_cache import _few_shot

    path = request.getfixturevalue(f"{kind}_path")
    chats = [_few_shot(_user(i)) for i in range(4)]
    async with Engine(path, show_progress=False, prefix_cache_min_tokens=8, coalesce_ms=300) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        history = {k: p for p, k in engine._front.renderer.cache_points(chats[0], ids[0], history=True)}["history"]
        outs = await asyncio.gather(*[engine.chat(c, SamplingParams(max_tokens=8)) for c in chats])
        stats = engine.stats()
        claims = engine.run_on_owner_thread(lambda: len(engine._core._lanes["text"]._claims))
    for out, p in zip(outs, ids):
        assert out.token_ids == reference_greedy(path, p, 8)
    cached = [out.usage.cached_tokens for out in outs]
    # (llama's cache can be cut back: a request admitted after the first finished may start
    # from its answer's entry instead, past the examples)
    assert sum(c < history for c in cached) == 1, (cached, history)
    assert stats["prefill_tokens"] == sum(len(p) - 1 for p in ids) - sum(cached)
    assert claims == 0
    if kind == "qwen3_5":  # recurrent state: only the shared entry serves past the system prompt
        assert stats["prefix_cache"]["hits_by_kind"]["shared"] == 3, stats["prefix_cache"]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
async def test_requests_about_one_document_arriving_together_prefill_it_once(kind, request):
    """One document in one message, different questions, all at once: no stored entry
    shares the document yet, but the requests queued behind the first do. The first finds
    the prefix they share, claims a "shared" point there and stores it; the others wait for
    it, as for any claim on a prefix of their prompt. Each answer equals its cold run."""
    from .test_prefix_cache import _about_the_document

    path = request.getfixturevalue(f"{kind}_path")
    chats = [_about_the_document(q) for q in ("Bag: how often?", "Clamps: how often?", "Filter: how often?",
                                              "Power: which circuit?", "Dust: where to?")]
    async with Engine(path, show_progress=False, coalesce_ms=300) as engine:  # min tokens: the default
        ids = [engine.apply_chat_template(c) for c in chats]
        outs = await asyncio.gather(*[engine.chat(c, SamplingParams(max_tokens=6)) for c in chats])
        stats = engine.stats()
        idle = engine.run_on_owner_thread(lambda: (len(engine._core._lanes["text"]._claims),
                                                   len(engine._core._lanes["text"]._in_prefill._by_uid)))
    for out, p in zip(outs, ids):
        assert out.token_ids == reference_greedy(path, p, 6)
    document_end = min(next(i for i, (a, b) in enumerate(zip(ids[0], p)) if a != b) for p in ids[1:])
    cached = [out.usage.cached_tokens for out in outs]
    assert sum(c < document_end for c in cached) == 1, (cached, document_end)  # the document once
    assert stats["prefill_tokens"] == sum(len(p) - 1 for p in ids) - sum(cached)
    assert idle == (0, 0)


_HEADER = "Safety notice for every machine in the shop: wear goggles, keep guards on. " * 3
_DOC_B = _HEADER + "The dust extractor runs on a 16 A circuit; empty its bag weekly. " * 4
_DOC_C = _HEADER + "The band saw needs a sharp blade; tension it before every use. " * 4


def _about(doc: str, question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n{doc}\n\nQuestion: {question}"}]


def _parts(a, b) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


async def test_a_request_keeps_both_the_prefix_a_row_in_prefill_shares_and_the_one_the_queue_shares(qwen3_5_path):
    """A row in prefill holds document B; the request added next asks about B too, and the
    requests queued behind it ask about document C, which begins with B's header. Its points
    are where it parts from the row (B, for the next questions about B) and where it parts
    from the queue (the header, for the questions about C), not only the shorter one."""
    chats = {"row": _about(_DOC_B, "Bag?"), "new": _about(_DOC_B, "Circuit?"), "c1": _about(_DOC_C, "Blade?"),
             "c2": _about(_DOC_C, "Tension?")}
    async with Engine(qwen3_5_path, show_progress=False) as engine:
        ids = {k: engine.apply_chat_template(c) for k, c in chats.items()}
        requests = {k: Request(k, ids[k], SamplingParams(), sink=None, max_tokens=4,
                               cache_points=engine._front.renderer.cache_points(chats[k], ids[k])) for k in chats}
        lane = engine._core._lanes["text"]

        def add():
            lane.add(requests["row"])
            lane.add(requests["new"], [requests["c1"], requests["c2"]])
            points = [p for p, kind in requests["new"].cache_points if kind == "shared"]
            lane.remove(["row", "new"])
            return points

        points = engine.run_on_owner_thread(add)
    assert points == sorted([_parts(ids["new"], ids["c1"]), _parts(ids["new"], ids["row"])]), points


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
async def test_a_burst_about_two_documents_with_one_header_prefills_each_part_once(kind, request):
    """Two questions about document B and two about C, which begins with B's header, all at
    once: the first request stores the header and its own document, and the first about
    the other document stores that one. Each answer equals its cold run."""
    path = request.getfixturevalue(f"{kind}_path")
    chats = [_about(_DOC_B, "Bag?"), _about(_DOC_B, "Circuit?"), _about(_DOC_C, "Blade?"), _about(_DOC_C, "Tension?")]
    async with Engine(path, show_progress=False, coalesce_ms=300) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        outs = await asyncio.gather(*[engine.chat(c, SamplingParams(max_tokens=6)) for c in chats])
        stats = engine.stats()
    for out, p in zip(outs, ids):
        assert out.token_ids == reference_greedy(path, p, 6)
    cached = [out.usage.cached_tokens for out in outs]
    header, doc_b, doc_c = _parts(ids[0], ids[2]), _parts(ids[0], ids[1]), _parts(ids[2], ids[3])
    # (admitted in any order) One request prefilled the header, one of each pair its document.
    assert sum(c < header for c in cached) == 1, cached
    assert min(cached[:2]) < doc_b <= max(cached[:2]) and min(cached[2:]) < doc_c <= max(cached[2:]), cached
    assert stats["prefill_tokens"] == sum(len(p) - 1 for p in ids) - sum(cached)


async def test_a_row_that_came_alone_stores_the_document_for_the_requests_after_it(qwen3_5_path):
    """The first question about a document is admitted alone and starts its prefill; the
    next one finds it in prefill and gives it a point where their prompts part (its
    remaining prompt is cut there), then waits for that snapshot instead of prefilling
    the document beside it. Driven step by step on the owner thread."""
    from .test_prefix_cache import _about_the_document

    chats = [_about_the_document(q) for q in ("Bag: how often?", "Clamps: how often?")]
    async with Engine(qwen3_5_path, show_progress=False, prefill_step_size=16) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        requests = [Request(f"r{i}", p, SamplingParams(), sink=None, max_tokens=2,
                            cache_points=engine._front.renderer.cache_points(c, p)) for i, (c, p) in enumerate(zip(chats, ids))]
        lane = engine._core._lanes["text"]
        parts = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)

        def walk():
            first, second = requests
            lane.add(first)
            lane.step()  # 16 tokens of the first prompt fed
            waits = lane.defer(second)
            points = list(lane._caching[lane._rows.uid("r0")].points)
            steps = 0
            while lane.defer(second) and steps < 100:
                lane.step()
                steps += 1
            stored = lane.prefix_cache.contains(ids[1][:parts])
            lane.remove(["r0"])
            return waits, points, stored, len(lane._claims)

        waits, points, stored, claims = engine.run_on_owner_thread(walk)
    assert waits and (parts, "shared") in points and stored and claims == 0, (waits, points, parts)


async def test_questions_after_a_first_one_that_came_alone_prefill_the_document_once(qwen3_5_path):
    """End to end: the first question is already prefilling when three more arrive; each
    answer equals its cold run, and the document is prefilled once."""
    from .test_prefix_cache import _about_the_document

    chats = [_about_the_document(q) for q in ("Bag: how often?", "Clamps: how often?", "Filter: how often?",
                                              "Dust: where to?")]
    async with Engine(qwen3_5_path, show_progress=False, prefill_step_size=16, coalesce_ms=300) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        lane = engine._core._lanes["text"]
        step = lane.step

        def slow_step():  # the document takes 18 steps: the others arrive during them
            time.sleep(0.03)
            return step()

        lane.step = slow_step
        first = asyncio.ensure_future(engine.chat(chats[0], SamplingParams(max_tokens=6)))
        while engine.stats()["prefill_tokens"] == 0:  # its prefill has started
            await asyncio.sleep(0.005)
        rest = await asyncio.gather(*[engine.chat(c, SamplingParams(max_tokens=6)) for c in chats[1:]])
        outs = [await first, *rest]
        stats = engine.stats()
    for out, p in zip(outs, ids):
        assert out.token_ids == reference_greedy(qwen3_5_path, p, 6)
    document_end = min(next(i for i, (a, b) in enumerate(zip(ids[0], p)) if a != b) for p in ids[1:])
    cached = [out.usage.cached_tokens for out in outs]
    assert cached[0] == 0 and all(c >= document_end for c in cached[1:]), (cached, document_end)
    assert stats["prefill_tokens"] == sum(len(p) - 1 for p in ids) - sum(cached)


@pytest.mark.parametrize("wait", [True, False])
async def test_points_found_against_the_queue_are_found_again_when_a_request_is_added_again(qwen3_5_path, wait):
    """A request added again (held for memory, prefilled plainly) finds its "shared" points
    again: the queue it parted from has changed, and the points of its first add stayed.
    Without waiting (``prefix_cache_wait_for_prefill=False``) the queue makes none: those
    requests would prefill the same tokens beside it anyway."""
    chats = {"new": _about(_DOC_B, "Circuit?"), "c1": _about(_DOC_C, "Blade?")}
    async with Engine(qwen3_5_path, show_progress=False, prefix_cache_wait_for_prefill=wait) as engine:
        ids = {k: engine.apply_chat_template(c) for k, c in chats.items()}
        requests = {k: Request(k, ids[k], SamplingParams(), sink=None, max_tokens=4,
                               cache_points=engine._front.renderer.cache_points(chats[k], ids[k])) for k in chats}
        lane = engine._core._lanes["text"]

        def shared():
            return [p for p, kind in requests["new"].cache_points if kind == "shared"]

        def add_twice():
            lane.add(requests["new"], [requests["c1"]])
            first = shared()
            lane.remove(["new"])
            lane.add(requests["new"], [])
            second = shared()
            lane.remove(["new"])
            return first, second

        first, second = engine.run_on_owner_thread(add_twice)
    assert first == ([_parts(ids["new"], ids["c1"])] if wait else []) and second == [], (first, second)
