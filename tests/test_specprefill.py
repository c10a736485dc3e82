"""SpecPrefill in the engine: exact at keep 1.0, true positions, isolated from other requests.

Scoring and chunk selection are tested on their own in test_specprefill_scoring.py.
"""

from __future__ import annotations

import asyncio
import random
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load

from mlx_tandem import Engine, InvalidRequestError, SamplingParams
from mlx_tandem.errors import EngineStepError, ModelLoadError
from mlx_tandem.spec.mtp_cache import MTPKVCache
from mlx_tandem.specprefill.job import SparsePrefill
from mlx_tandem.specprefill.positions import PositionedKVCache, PositionedRotatingKVCache, positioned

from .numerics import tolerance
from .reference import reference_greedy


@pytest.fixture(scope="module")
def llama_swa_path(tiny_models):
    """The factory llama with its first layer sliding-window attention (RotatingKVCache),
    the window past every prompt here, so a full prefill is the exact reference."""
    return tiny_models.get("llama", sliding_window=1024)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def _engine(path, draft_path, **kw) -> Engine:
    kw = {"show_progress": False, "specprefill_draft": str(draft_path), "specprefill_threshold": 256,
          "prefill_step_size": 64, "prefix_cache_min_tokens": 8, **kw}
    return Engine(path, **kw)


# --------------------------------------------------------------------------- positions
def _kv(n: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4)))
    return c


@pytest.mark.parametrize("shifted_first", [True, False])
def test_merge_keeps_each_rows_true_position(shifted_first):
    plain = positioned([_kv(3)])[0]
    shifted = PositionedKVCache.of(_kv(5), position_shift=7)
    rows = [shifted, plain] if shifted_first else [plain, shifted]
    batch = rows[0].merge(rows)
    want = [12, 3] if shifted_first else [3, 12]
    assert batch.offset.tolist() == want and batch.size() == 5
    # Decoding moves every row on by one, still at its own position.
    batch.update_and_fetch(mx.zeros((2, 2, 1, 4)), mx.zeros((2, 2, 1, 4)))
    assert batch.offset.tolist() == [w + 1 for w in want]
    # The MTP head's cache carries its shift through its own merge too.
    head = MTPKVCache()
    head.update_and_fetch(mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    head.position_shift = 4
    assert MTPKVCache.merge([MTPKVCache(), head]).offset.tolist()[1] == 6


@pytest.mark.parametrize("shifted_first", [True, False])
def test_a_sliding_window_layers_merge_keeps_each_rows_true_position(shifted_first):
    """A RotatingKVCache is no KVCache: its rows merged at the positions they stored, so a
    sparse-prefilled row's sliding-window layers decoded at the compact position (review
    h165). Its offset still counts what it stored: growth and rotation read it."""
    def rotating(n):
        c = RotatingKVCache(max_size=8)
        c.update_and_fetch(mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4)))
        return c

    plain = positioned([rotating(3)])[0]
    shifted = PositionedRotatingKVCache.of(rotating(5), position_shift=7)
    assert type(plain) is PositionedRotatingKVCache and (shifted.offset, shifted.size()) == (5, 5)
    rows = [shifted, plain] if shifted_first else [plain, shifted]
    batch = rows[0].merge(rows)
    want = [12, 3] if shifted_first else [3, 12]
    assert isinstance(batch, BatchRotatingKVCache) and batch.offset.tolist() == want and batch.size() == 5
    for _ in range(6):  # past the window: the rows rotate, each still at its own position
        batch.update_and_fetch(mx.zeros((2, 2, 1, 4)), mx.zeros((2, 2, 1, 4)))
    assert batch.offset.tolist() == [w + 6 for w in want]


def test_attention_caches_inside_a_cache_list_keep_the_rows_true_position():
    """falcon_h1's and deepseek_v32's layers keep their caches in a CacheList, which merges
    each member by its first row's member's class. The sparse prefill's positions reached
    only the list's top level, so those layers decoded at the compact position (review
    h165's suspicion, found so by reading). Runs at 0..3 and 10..12, then the last prompt
    token at 20: every attention member sits there, and a merge with a plain row keeps it."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    from mlx_tandem.specprefill.positions import as_batch_of_one, from_batch_of_one, set_position

    def row_cache():
        state = ArraysCache(2)
        state[0], state[1] = mx.zeros((1, 3)), mx.zeros((1, 2))
        return positioned([CacheList(state, KVCache()), KVCache()])

    def attention(cache):
        return [cache[0].caches[1], cache[1]]

    batch = as_batch_of_one(row_cache())
    for start, n in ((0, 3), (10, 2)):
        set_position(batch, start)
        for kv in attention(batch):
            kv.update_and_fetch(mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4)))
    row = from_batch_of_one(batch, 20)
    assert [(kv.offset, kv.position_shift) for kv in attention(row)] == [(5, 15), (5, 15)]
    plain = row_cache()
    for kv in attention(plain):
        kv.update_and_fetch(mx.ones((1, 2, 4, 4)), mx.ones((1, 2, 4, 4)))
    merged = [plain[0].merge([plain[0], row[0]]).caches[1], plain[1].merge([plain[1], row[1]])]
    assert [kv.offset.tolist() for kv in merged] == [[4, 20], [4, 20]]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "llama_swa"])
def test_kept_tokens_are_prefilled_at_their_original_positions(kind, request, draft_path):
    """A llama's first-layer keys depend only on a token and its RoPE position: after a sparse
    prefill they must equal the full prefill's keys at exactly the kept positions. (Qwen3.5's
    first attention layer follows a GatedDeltaNet layer, whose state sees only the kept tokens,
    so there only the dense part can match; its positions are checked in the engine test.)"""
    path = request.getfixturevalue(f"{kind}_path")
    model, _ = load(str(path))
    draft, _ = load(str(draft_path))
    prompt = _prompt(300)
    job = SparsePrefill(model, draft, prompt, None, start=0, dense_end=40, keep_pct=0.25,
                        chunk_size=16, lookahead=4, step_size=50)
    steps = 0
    while not job.done:
        job.advance()
        steps += 1
    assert steps > 3  # bounded pieces, not one blocking call
    kept = [i for s, e in job.runs for i in range(s, e)]
    assert kept[:40] == list(range(40)) and kept[-1] == len(prompt) - 2
    assert len(kept) < len(prompt) * 0.5

    full = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=full)
    layer = next(i for i, c in enumerate(full) if isinstance(c, (KVCache, RotatingKVCache)))  # llama_swa's: sliding
    row = job.row_cache()
    got = np.array(row[layer].keys[..., : row[layer].offset, :])
    want = np.array(full[layer].keys[..., : full[layer].offset, :])[:, :, kept]
    if kind != "qwen3_5":
        np.testing.assert_allclose(got, want, **tolerance(rtol=1e-4, atol=1e-5))
    else:
        np.testing.assert_allclose(got[:, :, :40], want[:, :, :40], **tolerance(rtol=1e-4, atol=1e-5))
        assert not np.allclose(got, want, **tolerance(rtol=1e-4, atol=1e-5))
    # The row's next token (the last prompt token) sits at its true position.
    assert row[layer].offset + row[layer].position_shift == len(prompt) - 1


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_a_job_keeping_everything_decodes_as_a_full_prefill(kind, request, draft_path):
    """The sparse machinery (pieces, positioned batch-of-one caches, the row's true position)
    loses nothing when nothing is dropped: greedy decoding from the job's cache equals
    decoding after a plain full prefill."""
    path = request.getfixturevalue(f"{kind}_path")
    model, _ = load(str(path))
    draft, _ = load(str(draft_path))
    prompt = _prompt(300, seed=7)
    job = SparsePrefill(model, draft, prompt, None, start=0, dense_end=40, keep_pct=1.0,
                        chunk_size=16, lookahead=4, step_size=50)
    while not job.done:
        job.advance()
    assert job.runs == [(0, len(prompt) - 1)] and job.scorer is None
    cache, token, got = job.row_cache(), prompt[-1], []
    for _ in range(12):
        token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]).item())
        got.append(token)
    assert got == reference_greedy(path, prompt, 12)[: len(got)]


# --------------------------------------------------------------------------- in the engine
@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
async def test_keep_all_takes_the_plain_prefill_and_is_cached(kind, request, draft_path):
    """keep_pct 1.0 drops nothing, so the request is prefilled as any other: exact, batched,
    and its final cache kept (a sparse row's cannot be), so a follow-up hits the cache."""
    path = request.getfixturevalue(f"{kind}_path")
    prompts = [_prompt(400, seed) for seed in range(3)]
    expected = [reference_greedy(path, p, 16) for p in prompts]
    async with _engine(path, draft_path, specprefill_keep_pct=1.0) as engine:
        outs = await asyncio.gather(*[engine.complete(p, {"max_tokens": 16, "specprefill": True})
                                      for p in prompts])
        follow_up = prompts[0] + expected[0] + _prompt(8, seed=9)
        again = await engine.complete(follow_up, {"max_tokens": 4, "specprefill": True})
        stats = engine.stats()["specprefill"]
    assert [o.token_ids for o in outs] == expected
    assert stats["requests"] == 0 and stats["sparse_tokens"] == 0
    assert again.usage.cached_tokens >= len(prompts[0]) + len(expected[0]) - 1
    assert again.token_ids == reference_greedy(path, follow_up, 4)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "llama_swa"])
async def test_decode_runs_at_the_true_position_and_others_are_unaffected(kind, request, draft_path):
    path = request.getfixturevalue(f"{kind}_path")
    short = _prompt(20, seed=5)
    long = _prompt(900, seed=6)
    expected_short = reference_greedy(path, short, 60)
    async with _engine(path, draft_path) as engine:
        lane = None

        def positions(rid):
            """(RoPE offsets of the row's attention layers, tokens it has seen, entries stored)."""
            nonlocal lane
            lane = engine._core._lanes["text"]
            batch = lane._gen._generation_batch
            i = batch.uids.index(lane._rows.uid(rid))
            n = len(lane.model.layers)
            attn = [c for c in batch.prompt_cache[:n] if isinstance(c, (BatchKVCache, BatchRotatingKVCache))]
            lp = attn[0].left_padding.tolist()[i]
            return [int(c.offset[i].item()) for c in attn], len(batch.tokens[i]), attn[0]._idx - lp

        stream_a = await engine.open_complete_stream(short, {"max_tokens": 60, "specprefill": False})
        first = await stream_a.__anext__()
        a_times = [time.perf_counter()]
        task_a = asyncio.create_task(_drain(stream_a, a_times))
        submitted = time.perf_counter()
        stream_b = await engine.open_complete_stream(long, {"max_tokens": 8, "keep_pct": 0.2})
        b_first = await stream_b.__anext__()
        b_first_time = time.perf_counter()
        offsets, seen, stored = engine.run_on_owner_thread(lambda: positions(stream_b.request_id))
        rest_b = await stream_b.collect()
        a_rest = await task_a
        stats = engine.stats()["specprefill"]
    # Every attention layer continues at the prompt's true length, not at what it stored.
    assert set(offsets) == {seen} and seen >= len(long)
    assert stored < 0.5 * len(long)
    assert stats["requests"] == 1 and 0.15 < stats["keep_ratio"] < 0.3
    # The request decoding alongside is exactly its solo greedy output ...
    assert list(first.token_ids) + a_rest == expected_short
    # ... and kept decoding while the sparse prefill ran (a piece per step, no stall).
    during = [t for t in a_times if submitted < t < b_first_time]
    assert len(during) >= 3, (len(during), len(a_times))
    assert b_first.token_ids or rest_b.token_ids


async def _drain(stream, times) -> list[int]:
    out = []
    async for delta in stream:
        times.append(time.perf_counter())
        out.extend(delta.token_ids)
    return out


def _gauge_reports() -> list[list[dict]]:
    """Two chats sharing a long system prompt, each with a long user message."""
    system = {"role": "system", "content": "You maintain the river gauges. " * 40}
    return [[system, {"role": "user", "content": f"Report {i}: " + "levels rising slowly, " * 60}]
            for i in range(2)]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
async def test_only_the_uncached_suffix_is_scored_and_filled_sparsely(kind, request, draft_path):
    path = request.getfixturevalue(f"{kind}_path")
    chats = _gauge_reports()
    short = [chats[0][0], {"role": "user", "content": "Any floods?"}]
    async with _engine(path, draft_path, specprefill_keep_pct=0.5) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        boundary = {k: n for n, k in engine._front.renderer.cache_points(chats[1], ids[1])}["system"]
        await engine.chat(chats[0], {"max_tokens": 10})
        after_first = engine.stats()["specprefill"]
        second = await engine.chat(chats[1], {"max_tokens": 10})
        stats = engine.stats()
        # The system prompt's snapshot, written by a sparse job, is its exact state: a plain
        # request that restores it answers as a cold full prefill does.
        plain = await engine.chat(short, {"max_tokens": 10, "specprefill": False})
        short_ids = engine.apply_chat_template(short)
    # The first request filled the system prompt densely (and cached it), the rest sparsely.
    assert after_first["sparse_tokens"] == len(ids[0]) - 1 - boundary
    # The second reused the system prompt: only its own suffix went through SpecPrefill.
    assert second.usage.cached_tokens >= boundary
    assert stats["specprefill"]["sparse_tokens"] - after_first["sparse_tokens"] == \
        len(ids[1]) - 1 - second.usage.cached_tokens
    assert stats["prefix_cache"]["hits_by_kind"]["system"] >= 1
    assert plain.usage.cached_tokens >= boundary
    assert plain.token_ids == reference_greedy(path, short_ids, 10)


def _few_shot_reports(report: str) -> list[dict]:
    """Long few-shot examples written as messages, then a long report to answer."""
    chat = [_gauge_reports()[0][0]]
    for i in range(2):
        chat += [{"role": "user", "content": f"Example {i}: " + "levels falling, " * 40},
                 {"role": "assistant", "content": f"Summary {i}: " + "no flood risk, " * 10}]
    return chat + [{"role": "user", "content": report + ": " + "levels rising slowly, " * 60}]


async def test_shared_few_shot_examples_are_prefilled_densely_and_reused(qwen3_5_path, draft_path):
    """Once a second request holds the same examples (a "history" point), its SpecPrefill
    job prefills them densely and stores them, like a system prompt: the next requests
    start after them, and neither the target nor the draft reads them again. Before, the
    examples were prefilled sparsely each time, and a hybrid model's cache kept only the
    system prompt."""
    chats = [_few_shot_reports(f"Report {i}") for i in range(3)]
    short = _few_shot_reports("Any floods?")[:-1] + [{"role": "user", "content": "Any floods?"}]
    async with _engine(qwen3_5_path, draft_path, specprefill_keep_pct=0.5) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        points = {k: n for n, k in engine._front.renderer.cache_points(chats[0], ids[0], history=True)}
        system, history = points["system"], points["history"]
        runs = []
        for chat in chats:
            out = await engine.chat(chat, {"max_tokens": 4})
            runs.append((out.usage.cached_tokens, dict(engine.stats()["specprefill"])))
        plain = await engine.chat(short, {"max_tokens": 8, "specprefill": False})
        short_ids = engine.apply_chat_template(short)
        hits = engine.stats()["prefix_cache"]["hits_by_kind"]
    (c0, s0), (c1, s1), (c2, s2) = runs
    assert c0 == 0 and s0["sparse_tokens"] == len(ids[0]) - 1 - system  # first sighting: no history point
    assert c1 >= system and s1["sparse_tokens"] - s0["sparse_tokens"] == len(ids[1]) - 1 - history
    assert c2 == history and s2["sparse_tokens"] - s1["sparse_tokens"] == len(ids[2]) - 1 - history
    assert s2["draft_tokens"] - s1["draft_tokens"] == len(ids[2]) - history  # the draft's own copy
    assert hits["history"] >= 2
    # Stored from the dense part, the examples' snapshot is their exact state.
    assert plain.usage.cached_tokens == history and plain.token_ids == reference_greedy(qwen3_5_path, short_ids, 8)


async def test_examples_the_cache_cannot_keep_are_not_prefilled_densely_again(qwen3_5_path, draft_path):
    """Dense only to be cached: where the budget refused the examples' snapshot, later jobs
    end their dense part at the system prompt again (an audit: 56% more target prefill per
    request, for good, and nothing kept)."""
    chats = [_few_shot_reports(f"Report {i}") for i in range(4)]
    async with _engine(qwen3_5_path, draft_path, specprefill_keep_pct=0.5) as engine:
        for chat in chats[:3]:
            await engine.chat(chat, {"max_tokens": 2})
        entries = {k: [e.nbytes for e in d.values()] for k, d in engine._core._lanes["text"].prefix_cache._lru.items()}
    (system_bytes,), (history_bytes,) = entries["system"], entries["history"]
    async with _engine(qwen3_5_path, draft_path, specprefill_keep_pct=0.5,
                       prefix_cache_bytes=system_bytes + history_bytes // 2) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        points = {k: n for n, k in engine._front.renderer.cache_points(chats[0], ids[0], history=True)}
        runs = []
        for chat in chats:
            out = await engine.chat(chat, {"max_tokens": 2})
            runs.append((out.usage.cached_tokens, engine.stats()["specprefill"]["sparse_tokens"]))
        refused = engine.stats()["prefix_cache"]["refused"]
    system, history = points["system"], points["history"]
    assert [c for c, _ in runs] == [0, system, system, system]
    assert runs[1][1] - runs[0][1] == len(ids[1]) - 1 - history  # tried once, refused
    for i in (2, 3):  # then the examples go through SpecPrefill with the rest
        assert runs[i][1] - runs[i - 1][1] == len(ids[i]) - 1 - system
    assert refused == 1


async def test_the_system_prompt_is_prefilled_densely_without_the_prefix_cache(llama_path, draft_path):
    """SpecPrefill keeps the system prompt whole (its instructions are not the draft's to
    drop) with the prefix cache off too: the boundary was only found for the cache, so
    without it the draft scored the system prompt and it could be cut."""
    chat = _gauge_reports()[0]
    async with _engine(llama_path, draft_path, specprefill_keep_pct=0.5, prefix_cache_bytes=0) as engine:
        ids = engine.apply_chat_template(chat)
        boundary = {k: n for n, k in engine._front.renderer.cache_points(chat, ids)}["system"]
        await engine.chat(chat, {"max_tokens": 4})
        stats = engine.stats()["specprefill"]
    assert boundary > 100 and stats["sparse_tokens"] == len(ids) - 1 - boundary
    assert stats["draft_tokens"] == len(ids)  # the draft reads it all (no snapshot to start from)


async def test_the_draft_scores_only_what_its_own_cache_does_not_hold(qwen3_5_path, draft_path):
    chats = _gauge_reports()
    async with _engine(qwen3_5_path, draft_path, specprefill_keep_pct=0.3) as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        boundary = {k: n for n, k in engine._front.renderer.cache_points(chats[1], ids[1])}["system"]
        await engine.chat(chats[0], {"max_tokens": 4})
        first = engine.stats()["specprefill"]
        await engine.chat(chats[1], {"max_tokens": 4})
        second = engine.stats()["specprefill"]
    assert first["draft_tokens"] == len(ids[0])  # nothing cached yet: the whole prompt
    # The draft restored its own snapshot of the system prompt and scored only the rest.
    assert second["draft_tokens"] - first["draft_tokens"] == len(ids[1]) - boundary
    assert 0.25 < second["keep_ratio"] < 0.4


async def test_short_prompts_and_opt_outs_prefill_normally(llama_path, draft_path):
    async with _engine(llama_path, draft_path) as engine:
        await engine.complete(_prompt(100), {"max_tokens": 2})  # under the threshold
        await engine.complete(_prompt(255, 2), {"max_tokens": 2})  # one under it
        await engine.complete(_prompt(600), {"max_tokens": 2, "specprefill": False})
        assert engine.stats()["specprefill"]["requests"] == 0
        await engine.complete(_prompt(256, 3), {"max_tokens": 2})  # exactly the threshold: it applies
        assert engine.stats()["specprefill"]["requests"] == 1
        await engine.complete(_prompt(100, 1), {"max_tokens": 2, "specprefill": True})
        assert engine.stats()["specprefill"]["requests"] == 2


async def test_bad_settings_are_typed_errors(llama_path, draft_path, tiny_models):
    async with Engine(llama_path, show_progress=False) as engine:
        with pytest.raises(InvalidRequestError, match="specprefill_draft"):
            await engine.complete(_prompt(10), {"specprefill": True})
    for bad in (0, 1.5, "half"):
        with pytest.raises(InvalidRequestError):
            SamplingParams(keep_pct=bad)
        with pytest.raises(InvalidRequestError):
            Engine(llama_path, specprefill_keep_pct=bad)
    # A lookahead runs as one step of the engine thread (20,000 held others for 30 s), and a
    # chunk past int64 failed each request in numpy: refused where the engine is made.
    for name, top in (("specprefill_lookahead", 64), ("specprefill_chunk_size", 65536)):
        assert getattr(Engine(llama_path, **{name: top}).options, name) == top
        for bad in (top + 1, 2**64):
            with pytest.raises(InvalidRequestError, match=f"{name}={bad}: must be at most {top}"):
                Engine(llama_path, **{name: bad})
    other_vocab = tiny_models.get("draft", vocab_size=1024)
    engine = Engine(llama_path, show_progress=False, specprefill_draft=str(other_vocab))
    with pytest.raises(ModelLoadError, match="tokenizer"):
        await engine.start()
    await engine.close()


def test_adapters_pass_specprefill_per_call(llama_path, draft_path):
    from langchain_mlx_tandem import ChatMLX
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.mlx_tandem import MLXTandemLLM

    opts = {"specprefill_draft": str(draft_path), "specprefill_threshold": 10_000, "show_progress": False}
    def long(i):  # a new prompt per call: a cached prompt leaves nothing to prefill sparsely
        return f"Reading {i}: " + "the gauge at the weir reads high " * 40
    lc = ChatMLX(model=str(llama_path), engine_options=opts, max_tokens=4)
    li = MLXTandemLLM(model=str(llama_path), engine_options=opts, max_tokens=4, specprefill=True)
    engine = Engine.shared(str(llama_path), **opts)

    def requests():
        return engine.stats()["specprefill"]["requests"]

    lc.invoke(long(0))
    assert requests() == 0  # under the threshold
    lc.invoke(long(1), specprefill=True, keep_pct=0.5)
    assert requests() == 1
    li.chat([ChatMessage(role="user", content=long(2))])
    assert requests() == 2
    li.chat([ChatMessage(role="user", content=long(3))], specprefill=False)
    assert requests() == 2
    with pytest.raises(InvalidRequestError):
        lc.invoke(long(4), keep_pct=2.0)


async def test_cancelling_during_the_sparse_prefill_frees_the_request(llama_path, draft_path):
    async with _engine(llama_path, draft_path, prefill_step_size=16) as engine:
        stream = await engine.open_complete_stream(_prompt(900, seed=9), {"max_tokens": 4, "keep_pct": 0.2})
        lane = engine._core._lanes["text"]
        deadline = time.monotonic() + 60  # generous: CI machines are shared
        while time.monotonic() < deadline:  # wait until it is inside its sparse prefill
            if engine.run_on_owner_thread(lambda: len(lane._sparse)):
                break
            await asyncio.sleep(0.01)
        assert engine.run_on_owner_thread(lambda: len(lane._sparse)) == 1
        stream.cancel()  # the abort reaches the engine thread before the next call below
        assert engine.run_on_owner_thread(lambda: (len(lane._sparse), lane.num_active)) == (0, 0)
        # The engine goes on serving, SpecPrefill included.
        out = await engine.complete(_prompt(400, seed=10), {"max_tokens": 4, "keep_pct": 0.5})
        assert out.usage.completion_tokens == 4
        assert engine.stats()["specprefill"]["requests"] == 1
        plain = await engine.complete(_prompt(60, seed=11), {"max_tokens": 4})
        assert plain.token_ids == reference_greedy(llama_path, _prompt(60, seed=11), 4)


@pytest.mark.parametrize("where", ["advance", "__init__"])  # while it runs, or while it is set up
async def test_a_failed_sparse_prefill_fails_its_request_only(llama_path, draft_path, monkeypatch, where):
    """An error inside SpecPrefill is the engine's (EngineStepError naming SpecPrefill), not
    the request's; a request decoding beside it and later SpecPrefill requests are unaffected."""
    async with _engine(llama_path, draft_path) as engine:
        beside = await engine.open_complete_stream(_prompt(40, seed=3), {"max_tokens": 12})
        real = getattr(SparsePrefill, where)

        def broken(self, *a, **k):
            raise RuntimeError("draft scoring broke")

        monkeypatch.setattr(SparsePrefill, where, broken)
        with pytest.raises(EngineStepError, match="SpecPrefill failed: RuntimeError: draft scoring broke") as info:
            await engine.complete(_prompt(600, seed=4), {"max_tokens": 4})
        assert isinstance(info.value.__cause__, RuntimeError)
        monkeypatch.setattr(SparsePrefill, where, real)
        assert (await beside.collect()).token_ids == reference_greedy(llama_path, _prompt(40, seed=3), 12)
        out = await engine.complete(_prompt(600, seed=4), {"max_tokens": 4})
        assert out.usage.completion_tokens == 4
        assert engine.stats()["specprefill"]["requests"] == 1
