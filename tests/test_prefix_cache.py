"""Prefix cache: system-prompt and multi-turn reuse, exact for attention-only and hybrid models.

Every cache hit is compared with a cold one-request reference (mlx-lm's generate_step), so a
hit that restored the wrong state, the wrong positions or a shared (mutated) snapshot fails.
"""

from __future__ import annotations

import asyncio
import gc
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from mlx_tandem import Engine, SamplingParams
from mlx_tandem.prefix_cache import PrefixCache

from .reference import reference_greedy

SYSTEM = ("You are the planning assistant of a small workshop. Answer briefly, name the tools "
          "you would use, and never invent measurements. ") * 3
TOOLS = [{"type": "function", "function": {
    "name": "lookup_part", "description": "Find a spare part by its catalogue number.",
    "parameters": {"type": "object", "properties": {"number": {"type": "string"}}, "required": ["number"]}}}]

# A Llama-3-style template: no <|im_start|> anywhere.
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def _engine(path, **kw) -> Engine:
    return Engine(path, show_progress=False, prefix_cache_min_tokens=8, **kw)


def _user(i: int) -> str:
    return ["How do I sharpen a chisel?", "Which glue for oak?", "Plan a birdhouse.",
            "What is a dado joint?", "Is pine good for shelves?", "How long does varnish dry?"][i % 6]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _kv(tokens: int, value: float) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.full((1, 2, tokens, 4), value), mx.full((1, 2, tokens, 4), value))
    return c


def _hybrid(tokens: int, value: float) -> list:
    state = ArraysCache(2)
    state[0] = mx.full((1, 3), value)
    state[1] = mx.full((1, 2, 2), value)
    return [_kv(tokens, value), state]


def _stored_bytes(cache: list) -> int:
    """What an entry of ``cache`` holds once stored (its tokens, not its buffers' spare slots)."""
    pc = PrefixCache(1 << 30, min_tokens=1)
    pc.store(list(range(cache[0].offset)), cache, "final")
    return pc.nbytes


# --------------------------------------------------------------------------- PrefixCache alone
def test_fetch_reuses_the_longest_stored_prefix_and_leaves_one_token_to_feed():
    pc = PrefixCache(1 << 20, min_tokens=2)
    prompt = list(range(100, 120))
    pc.store(prompt[:5], _hybrid(5, 1.0), "system")
    pc.store(prompt[:12], _hybrid(12, 2.0), "turn")
    cache, n = pc.fetch(prompt)
    assert n == 12 and cache[0].offset == 12 and float(cache[1][0][0, 0]) == 2.0
    # The whole prompt stored: reuse all but the last token (the model must see one).
    pc.store(prompt, _hybrid(20, 3.0), "final")
    cache, n = pc.fetch(prompt)
    assert n == 12  # the 20-token entry would leave nothing to feed, and it cannot be trimmed
    cache, n = pc.fetch(prompt + [7])
    assert n == 20 and float(cache[1][0][0, 0]) == 3.0
    assert pc.fetch([1, 2, 3]) == (None, 0)
    assert pc.hits == 3 and pc.misses == 1 and pc.hit_tokens == 44


def test_recurrent_state_is_never_trimmed_but_attention_only_entries_are():
    pc = PrefixCache(1 << 20, min_tokens=2)
    stored = list(range(10))
    pc.store(stored, _hybrid(10, 1.0), "final")
    # Shares 6 tokens with the entry, which is longer: a hybrid entry cannot be cut back.
    assert pc.fetch(stored[:6] + [99, 98])[1] == 0
    pc = PrefixCache(1 << 20, min_tokens=2)
    pc.store(stored, [_kv(10, 1.0)], "final")
    cache, n = pc.fetch(stored[:6] + [99, 98])
    assert n == 6 and cache[0].offset == 6
    # ... and the stored entry itself is untouched by trimming the copy.
    assert pc.fetch(stored + [5])[0][0].offset == 10


def test_snapshots_are_independent_of_live_caches_and_of_each_other():
    pc = PrefixCache(1 << 20, min_tokens=2)
    live = _hybrid(6, 1.0)
    pc.store(list(range(6)), live, "system")
    live[0].update_and_fetch(mx.full((1, 2, 1, 4), 9.0), mx.full((1, 2, 1, 4), 9.0))
    live[1][0] = live[1][0] + 5  # a live request moving on
    copy1, _ = pc.fetch(list(range(8)))
    copy1[0].update_and_fetch(mx.full((1, 2, 1, 4), 7.0), mx.full((1, 2, 1, 4), 7.0))
    copy1[1][0] = copy1[1][0] * 0
    copy2, n = pc.fetch(list(range(8)))
    assert n == 6 and copy2[0].offset == 6
    np.testing.assert_array_equal(np.array(copy2[0].keys[..., :6, :]), np.ones((1, 2, 6, 4)))
    np.testing.assert_array_equal(np.array(copy2[1][0]), np.ones((1, 3)))


def _buffer_span(a: mx.array) -> tuple[int, int]:
    view = np.asarray(memoryview(a))  # no copy: the array's own bytes
    start = view.__array_interface__["data"][0]
    return start, start + a.nbytes


def test_an_entry_cut_from_a_small_batch_shares_none_of_its_buffers():
    """mx.contiguous returns a row of a parent of at most 16 KiB as a view into it (mlx
    0.32): a stored row of a small batched state kept the whole batch alive, uncounted."""
    rows = 4
    kv = BatchKVCache([0] * rows)
    kv.update_and_fetch(mx.full((rows, 2, 8, 4), 1.0), mx.full((rows, 2, 8, 4), 2.0))
    state = ArraysCache(2)
    state.cache = [mx.arange(rows * 3 * 8, dtype=mx.float32).reshape(rows, 3, 8),
                   mx.arange(rows * 2 * 4, dtype=mx.int32).reshape(rows, 2, 4) > 3]
    mx.eval(kv.keys, kv.values, state.cache)
    parents = [_buffer_span(a) for a in (kv.keys, kv.values, *state.cache)]
    row = [kv.extract(2), state.extract(2)]
    expected = [np.array(a) for a in (row[0].keys, row[0].values, *row[1].cache)]

    pc = PrefixCache(1 << 20, min_tokens=2)
    assert pc.store(list(range(8)), row, "turn")
    entry = pc._get(list(range(8)))
    stored = [entry.cache[0].keys, entry.cache[0].values, *entry.cache[1].cache]
    for a in stored:
        start, end = _buffer_span(a)
        assert all(end <= p_start or start >= p_end for p_start, p_end in parents)
    assert [a.dtype for a in stored] == [mx.float32, mx.float32, mx.float32, mx.bool_]
    for got, want in zip(stored, expected):
        np.testing.assert_array_equal(np.array(got), want)
    assert pc.nbytes == sum(a.nbytes for a in expected)


def test_an_entry_holds_its_own_bytes_not_the_batch_it_was_cut_from():
    """A row extracted from a batch is a slice (or a pending copy) of the batch's buffers. The
    stored entry must own a copy of its row alone, so that the byte budget bounds what the
    cache keeps alive: a deep copy shared the buffers (14.3 GB of active memory under a 1 GiB
    budget after 300 requests at batch 32)."""
    rows, tokens = 16, 256
    gc.collect()
    before = mx.get_active_memory()
    kv = BatchKVCache([0] * rows)
    kv.update_and_fetch(mx.full((rows, 2, tokens, 64), 1.0), mx.full((rows, 2, tokens, 64), 2.0))
    state = ArraysCache(2)  # GatedDeltaNet's conv and recurrent state, batched
    state.cache = [mx.arange(rows * 3 * 96, dtype=mx.float32).reshape(rows, 3, 96),
                   mx.arange(rows * 2 * 64 * 64, dtype=mx.float32).reshape(rows, 2, 64, 64)]
    mx.eval(kv.keys, kv.values, state.cache)
    row = [kv.extract(3), state.extract(3)]
    expected = [np.array(a) for a in (row[0].keys, row[0].values, *row[1].cache)]
    row_bytes = sum(a.nbytes for a in expected)

    pc = PrefixCache(1 << 30, min_tokens=2)
    assert pc.store(list(range(tokens)), row, "turn")
    del kv, state, row
    gc.collect()
    held = mx.get_active_memory() - before
    assert pc.nbytes == row_bytes
    assert held <= row_bytes + (64 << 10), (held, row_bytes)  # the batch (16 rows) is gone

    cache, n = pc.fetch(list(range(tokens)) + [7])
    assert n == tokens
    got = [np.array(a) for a in (cache[0].keys[..., :cache[0].offset, :], cache[0].values[..., :cache[0].offset, :],
                                 *cache[1].cache)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_a_live_cache_is_stored_without_its_spare_slots():
    """A live KVCache grows in 256-slot steps (SpecPrefill's draft snapshots its own): the
    entry keeps and counts its tokens only, and answers the same."""
    live = KVCache()
    for n in (300, 273):  # 573 tokens in a larger buffer
        live.update_and_fetch(mx.random.normal((1, 2, n, 4)), mx.random.normal((1, 2, n, 4)))
    assert live.keys.shape[2] > 573
    tokens = list(range(573))
    pc = PrefixCache(1 << 30, min_tokens=2)
    assert pc.store(tokens, [live], "system")
    assert pc.nbytes == 2 * 573 * 2 * 4 * 4
    (got,), n = pc.fetch(tokens + [9])
    assert n == 573 and got.offset == 573
    for a, b in ((got.keys, live.keys), (got.values, live.values)):
        assert np.array_equal(np.array(a[..., :573, :]), np.array(b[..., :573, :]))


def test_eviction_is_lru_within_kind_priority_under_the_byte_budget():
    entry_bytes = _stored_bytes(_hybrid(4, 0.0))
    pc = PrefixCache(3 * entry_bytes, min_tokens=2)
    sys_t, a, b, c = [0, 1, 2, 3], [5, 1, 2, 3], [6, 1, 2, 3], [7, 1, 2, 3]
    pc.store(sys_t, _hybrid(4, 0.0), "system")
    pc.store(a, _hybrid(4, 0.0), "final")
    pc.store(b, _hybrid(4, 0.0), "final")
    assert pc.fetch(a + [9])[1] == 4  # a is now more recent than b
    pc.store(c, _hybrid(4, 0.0), "final")  # over budget: the least recent final (b) goes
    assert pc.evicted == 1 and pc.nbytes <= pc.budget_bytes
    assert pc.fetch(b + [9])[1] == 0
    assert pc.fetch(a + [9])[1] == 4 and pc.fetch(c + [9])[1] == 4
    pc.store([8, 1, 2, 3], _hybrid(4, 0.0), "turn")  # finals go before turns and system prompts
    pc.store([9, 1, 2, 3], _hybrid(4, 0.0), "turn")
    assert pc.fetch(sys_t + [9])[1] == 4
    assert pc.fetch(a + [9])[1] == 0 and pc.fetch(c + [9])[1] == 0
    # An entry larger than the whole budget is not stored.
    assert not pc.store(list(range(50, 1050)), _hybrid(1000, 0.0), "system")


def test_a_new_entry_never_evicts_a_more_durable_one():
    """Room for a new entry comes from its own kind or a less durable one; where that is
    not enough the new entry is not stored (a final answer pushed system prompts out)."""
    entry_bytes = _stored_bytes(_hybrid(4, 0.0))
    pc = PrefixCache(int(1.5 * entry_bytes), min_tokens=2)
    assert pc.store([1, 2, 3, 4], _hybrid(4, 1.0), "system")
    assert not pc.store([5, 2, 3, 4], _hybrid(4, 2.0), "final")
    assert not pc.store([6, 2, 3, 4], _hybrid(4, 2.0), "turn")
    assert pc.fetch([1, 2, 3, 4, 7])[1] == 4 and pc.evicted == 0
    assert pc.store([7, 2, 3, 4], _hybrid(4, 3.0), "system")  # its own kind: LRU
    assert pc.evicted == 1 and pc.fetch([1, 2, 3, 4, 7])[1] == 0 and pc.fetch([7, 2, 3, 4, 9])[1] == 4
    pc = PrefixCache(int(2.5 * entry_bytes), min_tokens=2)
    pc.store([1, 2, 3, 4], _hybrid(4, 1.0), "system")
    pc.store([5, 2, 3, 4], _hybrid(4, 2.0), "final")
    assert pc.store([6, 2, 3, 4], _hybrid(4, 2.0), "turn")  # the final goes, not the system prompt
    assert pc.fetch([5, 2, 3, 4, 9])[1] == 0
    assert pc.fetch([1, 2, 3, 4, 9])[1] == 4 and pc.fetch([6, 2, 3, 4, 9])[1] == 4


def test_the_cache_knows_which_snapshots_its_budget_would_refuse():
    """Known only from a refusal, and only for as many tokens or more: a snapshot of more
    tokens holds at least as many bytes. Room freed by the more durable kinds counts again."""
    small, large = _stored_bytes(_hybrid(4, 0.0)), _stored_bytes(_hybrid(8, 0.0))
    pc = PrefixCache(small + large // 2, min_tokens=2)
    assert not pc.would_refuse(8, "system")  # nothing refused yet: no guess
    assert pc.store([1, 2, 3, 4], _hybrid(4, 1.0), "system")
    assert not pc.store(list(range(10, 18)), _hybrid(8, 1.0), "final")  # the system prompt stays
    assert pc.refused == 1 and pc.nbytes == small  # refused without a copy kept
    assert pc.would_refuse(8, "final") and pc.would_refuse(12, "turn")
    assert not pc.would_refuse(7, "final")  # fewer tokens: unknown
    assert not pc.would_refuse(8, "system")  # a system prompt may evict the other one
    assert pc.store(list(range(20, 28)), _hybrid(8, 2.0), "system")  # and is stored
    assert pc.evicted == 1 and pc.would_refuse(8, "final")
    pc.clear()
    assert not pc.would_refuse(8, "final")  # room again
    assert pc.store(list(range(10, 18)), _hybrid(8, 1.0), "final")


def test_a_floor_from_the_models_footprint_is_known_before_any_refusal():
    """``learn_floor``: the fewest tokens whose snapshot passes the budget, from what every
    snapshot of them holds at least; fewer tokens stay unknown, and a floor that never
    passes the budget (sliding layers only) bars nothing."""
    pc = PrefixCache(1000, min_tokens=2)
    pc.learn_floor(lambda n: 100 + 10 * n)  # 100 + 10 * 91 > 1000 >= 100 + 10 * 90
    assert pc.would_refuse(91, "system") and pc.would_refuse(4000, "final")
    assert not pc.would_refuse(90, "final") and pc.refused == 0
    assert pc.store(list(range(8)), _hybrid(8, 1.0), "final")  # what fits is kept
    capped = PrefixCache(1000, min_tokens=2)
    capped.learn_floor(lambda n: 10 * min(n, 64))
    assert not capped.would_refuse(1 << 30, "final")
    over = PrefixCache(1000, min_tokens=2)
    over.learn_floor(lambda n: 2000 + n)  # the state alone is over the budget
    assert over.would_refuse(2, "final")


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
async def test_the_models_footprint_is_a_floor_for_its_real_snapshots(kind, request):
    """The floor the engine learns at start (``CacheFootprint.held_bytes``) never passes
    what a real snapshot holds, or a snapshot that fits would be barred: every stored
    entry (system, turn, final; qwen3_5 with its MTP head) holds at least it."""
    from mlx_tandem.memory import probe_footprint
    from mlx_tandem.prefix_cache import _least_nbytes

    path = request.getfixturevalue(f"{kind}_path")
    async with Engine(path, show_progress=False, prefix_cache_min_tokens=8) as engine:
        for i in range(3):
            await engine.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(i)}],
                              SamplingParams(max_tokens=6))

        def floors():
            pc = engine._core._lanes["text"].prefix_cache
            footprint = probe_footprint(engine._core.loaded.model)
            return footprint.complete, [(footprint.held_bytes(len(e.tokens)), _least_nbytes(e.cache))
                                        for kind_entries in pc._lru.values() for e in kind_entries.values()]

        complete, pairs = engine.run_on_owner_thread(floors)
    assert complete and len(pairs) >= 3
    assert all(0 < floor <= least for floor, least in pairs), pairs


def test_a_sliding_window_refusal_does_not_bar_longer_snapshots_that_fit():
    """A sliding-window layer holds the whole last chunk it was fed (``window - 1 + chunk``
    slots) until the next step trims it back, so a snapshot of more tokens can hold fewer
    bytes. A refusal counts only what every longer snapshot holds (an audit: 253 tokens
    were 130 KB, 289 were 78 KB, and the refusal barred every later turn)."""
    from mlx_lm.models.cache import RotatingKVCache

    def sliding(tokens: int, chunk: int) -> list:
        window = RotatingKVCache(max_size=4)
        fed = 0
        while fed < tokens:
            n = min(chunk, tokens - fed)
            window.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
            fed += n
        return [window, _kv(tokens, 0.0)]

    chunked, stepped = sliding(40, 40), sliding(44, 1)  # 40 + 40 slots; 4 + 44 slots
    budget = _stored_bytes(stepped) + 64
    assert _stored_bytes(chunked) > budget
    pc = PrefixCache(budget, min_tokens=2)
    assert not pc.store(list(range(40)), chunked, "system")
    assert not pc.would_refuse(44, "system")
    assert pc.store(list(range(100, 144)), stepped, "system")
    # Where even the least a longer snapshot must hold is over the budget, it is known.
    pc = PrefixCache(_stored_bytes(stepped) // 2, min_tokens=2)
    assert not pc.store(list(range(40)), chunked, "system") and pc.would_refuse(44, "system")


def test_a_lookup_trims_an_entry_that_can_be_trimmed_whatever_was_stored_first():
    """Where a prompt parts from several entries, the one cut back is one that can be (then
    the nearest, as mlx-lm's PromptTrie chose): the first stored was taken, and a sliding-
    window entry past its window, which cannot be cut, hid a shorter one that could."""
    from mlx_lm.models.cache import RotatingKVCache

    def window(tokens: int) -> RotatingKVCache:
        c = RotatingKVCache(max_size=8)
        for _ in range(tokens):
            c.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
        return c

    shared = [1, 2, 3, 4, 5, 6]
    for order in (0, 1):
        pc = PrefixCache(1 << 30, min_tokens=2)
        entries = [(shared + [7, 8, 9, 10], [window(10)], "final"), (shared + [20], [window(7)], "history")]
        for tokens, cache, kind in entries[::1 if order == 0 else -1]:
            pc.store(tokens, cache, kind)
        assert pc.cached_length(shared + [30, 31]) == 6, order
        assert pc.fetch(shared + [30, 31])[1] == 6 and pc.hits_by_kind["history"] == 1


def test_stored_entries_are_each_kept_evicted_or_superseded():
    """An attention-only entry serves every prefix of itself, so storing it drops shorter
    ones of no more durable a kind: counted apart from evictions (review h164: neither
    counted them, and entries fell short of stored - evicted)."""
    pc = PrefixCache(1 << 20, min_tokens=2)
    pc.store([1, 2, 3, 4], [_kv(4, 1.0)], "final")
    pc.store([1, 2, 3, 4, 5, 6], [_kv(6, 1.0)], "turn")  # serves [1..4]: it goes
    pc.store([1, 2, 9, 9], [_kv(4, 2.0)], "system")
    pc.store([1, 2, 9, 9, 9, 9], [_kv(6, 2.0)], "final")  # the system prompt stays
    pc._evict_to(pc.nbytes - 1)
    snap = pc.snapshot()
    assert (snap["stored"], snap["superseded"], snap["evicted"]) == (4, 1, 1)
    assert snap["entries"] == snap["stored"] - snap["superseded"] - snap["evicted"] == 2
    assert pc.fetch([1, 2, 3, 4, 5])[1] == 4  # served by the longer entry, cut back


def test_a_system_prompt_outlives_longer_trimmable_entries():
    pc = PrefixCache(1 << 20, min_tokens=2)
    pc.store([1, 2, 3, 4], [_kv(4, 1.0)], "system")
    pc.store([1, 2, 3, 4, 5, 6], [_kv(6, 1.0)], "final")
    pc.clear()
    assert len(pc) == 0 and pc.nbytes == 0
    pc.store([1, 2, 3, 4], [_kv(4, 1.0)], "system")
    pc.store([1, 2, 3, 4, 5, 6], [_kv(6, 1.0)], "final")
    pc._evict_to(pc.nbytes - 1)  # the final answer goes first; the system prompt stays
    assert pc.fetch([1, 2, 3, 4, 5, 6, 7])[1] == 4


# --------------------------------------------------------------------------- boundaries
def test_system_boundary_is_found_for_a_template_without_chatml_markers(llama_engine):
    renderer = llama_engine._front.renderer
    kwargs = {"chat_template": LLAMA3_TEMPLATE}
    points = {}
    for user in ("How do I sharpen a chisel?", "Zebra wood?"):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        ids = renderer.render(msgs, template_kwargs=kwargs)
        points[user] = (ids, dict((k, n) for n, k in renderer.cache_points(msgs, ids, template_kwargs=kwargs)))
    (ids_a, pa), (ids_b, pb) = points.values()
    assert pa["system"] == pb["system"]
    shared = renderer.decode(ids_a[: pa["system"]])
    assert shared.endswith("<|start_header_id|>user<|end_header_id|>\n\n") and SYSTEM in shared
    # "turn": everything but the generation prompt.
    assert renderer.decode(ids_a[pa["turn"]:]) == "<|start_header_id|>assistant<|end_header_id|>\n\n"


# --------------------------------------------------------------------------- in the engine
@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
async def test_shared_system_prompt_hits_equal_cold_runs_in_mixed_batches(kind, request):
    path = request.getfixturevalue(f"{kind}_path")
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(i)}] for i in range(6)]
    others = [[{"role": "user", "content": f"Unrelated question number {i}, about rivers."}] for i in range(4)]
    async with _engine(path) as engine:
        ids = [engine.apply_chat_template(c, tools=TOOLS) for c in chats]
        other_ids = [engine.apply_chat_template(c) for c in others]
        expected = [reference_greedy(path, p, 10) for p in ids]
        system_len = {k: n for n, k in engine._front.renderer.cache_points(chats[3], ids[3], tools=TOOLS)}["system"]
        other_expected = [reference_greedy(path, p, 10) for p in other_ids]
        params = SamplingParams(max_tokens=10)
        # Wave 1: concurrent requests sharing one system prompt, nothing cached yet.
        wave1 = await asyncio.gather(*[engine.chat(c, params, tools=TOOLS) for c in chats[:3]])
        first = engine.stats()["prefix_cache"]
        # Wave 2: hits mixed with requests the cache cannot serve, in one batch.
        wave2 = await asyncio.gather(*[engine.chat(c, params, tools=TOOLS) for c in chats[3:]],
                                     *[engine.chat(c, params) for c in others])
        stats = engine.stats()["prefix_cache"]
    outs = list(wave1) + list(wave2[:3])
    for i, out in enumerate(outs):
        assert out.token_ids == expected[i], f"chat {i} diverged from the cold reference"
    for i, out in enumerate(wave2[3:]):
        assert out.token_ids == other_expected[i]
    assert stats["hits"] - first["hits"] >= 3
    assert all(out.usage.cached_tokens >= system_len for out in wave2[:3])
    assert all(out.usage.cached_tokens < len(p) for out, p in zip(wave2[:3], ids[3:]))
    # An unrelated request can only reuse what it shares with a sequence seen before: never the
    # workshop system prompt. (It may reuse a few tokens of another unrelated question that
    # finished before it was admitted, which depends on timing, so no exact count.)
    for out, p in zip(wave2[3:], other_ids):
        shared = max(_common_prefix(p, q) for q in ids + other_ids if q is not p)
        assert out.usage.cached_tokens <= shared < system_len


async def test_a_cancelled_request_reports_the_tokens_it_reused(qwen3_5_path):
    """usage.cached_tokens of an answer cut short (a cancelled stream, an abort) is what the
    cache restored for it, as for a finished one."""
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(0)}]
    async with _engine(qwen3_5_path) as engine:
        await engine.chat(chat, SamplingParams(max_tokens=4))
        finished = await engine.chat(chat, SamplingParams(max_tokens=4))
        assert finished.usage.cached_tokens > 0
        stream = await engine.open_chat_stream(chat, SamplingParams(max_tokens=50))
        await stream.__anext__()
        stream.cancel()
        cancelled = await stream.collect()
        stream = await engine.open_chat_stream(chat, SamplingParams(max_tokens=50))
        await stream.__anext__()
        engine._core.abort(stream._req)  # the engine's own abort (a closed event loop, a timeout)
        aborted = await stream.collect()
    assert cancelled.finish_reason == aborted.finish_reason == "abort"
    assert cancelled.usage.cached_tokens == aborted.usage.cached_tokens == finished.usage.cached_tokens


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
async def test_agent_turns_reuse_the_previous_turn(kind, request):
    """Turn N+1 (after a tool result) starts from turn N's cache and equals a cold run."""
    path = request.getfixturevalue(f"{kind}_path")
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Find part A-17 for me."}]
    async with _engine(path) as engine:
        params = SamplingParams(max_tokens=8)
        cached = []
        for turn in range(4):
            ids = engine.apply_chat_template(chat, tools=TOOLS)
            out = await engine.chat(chat, params, tools=TOOLS)
            assert out.token_ids == reference_greedy(path, ids, 8), f"turn {turn} diverged"
            cached.append((out.usage.cached_tokens, len(ids)))
            call_id = f"call_{turn}"
            chat = chat + [
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": call_id, "type": "function",
                    "function": {"name": "lookup_part", "arguments": json.dumps({"number": f"A-{17 + turn}"})}}]},
                {"role": "tool", "tool_call_id": call_id, "content": f"part A-{17 + turn}: not in stock"},
            ]
        stats = engine.stats()["prefix_cache"]
    # Every later turn reuses at least the whole previous prompt's conversation.
    for (hit, _), (_, prev_len) in zip(cached[1:], cached[:-1]):
        assert hit >= prev_len - 8, cached
    assert stats["hits_by_kind"]["turn"] + stats["hits_by_kind"]["final"] >= 3


async def test_what_the_cache_keeps_alive_is_what_it_counts(qwen3_5_path):
    """After a batch of distinct requests, the engine's active MLX memory has grown by the
    prefix cache's counted bytes and not more: its entries hold no batch buffers (the budget
    is the bound users set)."""
    async with _engine(qwen3_5_path, max_batch_size=8, mtp="off") as engine:
        await engine.chat([{"role": "user", "content": "warm up"}], SamplingParams(max_tokens=2))
        idle = mx.get_active_memory()
        before = engine.stats()["prefix_cache"]["bytes"]
        chats = [[{"role": "system", "content": SYSTEM + f" Desk {i}."},
                  {"role": "user", "content": _user(i) + f" (ticket {i})"}] for i in range(16)]
        await asyncio.gather(*(engine.chat(c, SamplingParams(max_tokens=12)) for c in chats))
        stats = engine.stats()["prefix_cache"]
        grown = mx.get_active_memory() - idle
    counted = stats["bytes"] - before
    assert stats["entries"] >= 16 and stats["evicted"] == 0
    assert grown <= 1.25 * counted + (256 << 10), (grown, counted)


async def test_stored_snapshots_do_not_change_while_requests_decode(qwen3_5_path):
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(0)}]
    async with _engine(qwen3_5_path) as engine:
        await engine.chat(chat, SamplingParams(max_tokens=4))

        def dump():
            pc = engine._core._lanes["text"].prefix_cache
            out = {}
            for kind, entries in pc._lru.items():
                for tokens, e in entries.items():
                    out[(kind, tokens)] = [np.array(a) for c in e.cache for a in _arrays(c.state)]
            return out

        before = engine.run_on_owner_thread(dump)
        await asyncio.gather(*[engine.chat([chat[0], {"role": "user", "content": _user(i)}],
                                           SamplingParams(max_tokens=12)) for i in range(4)])
        after = engine.run_on_owner_thread(dump)
    assert before and set(before) <= set(after)
    for key, arrays in before.items():
        for x, y in zip(arrays, after[key]):
            np.testing.assert_array_equal(x, y)


def _arrays(state):
    if isinstance(state, mx.array):
        return [state]
    if not isinstance(state, (list, tuple)):
        return []
    out = []
    for s in state:
        out += _arrays(s)
    return out


async def test_mtp_rows_restore_the_heads_cache_exactly(qwen3_5_mtp_path):
    """MTP's head cache is part of every snapshot: with speculation forced on, hits still
    give exactly the plain greedy output."""
    from mlx_tandem.testing.mtp_distill import default_prompts

    system = {"role": "system", "content": SYSTEM}
    chats = [[system, {"role": "user", "content": p}] for p in default_prompts(6)]
    async with _engine(qwen3_5_mtp_path, mtp="on") as engine:
        ids = [engine.apply_chat_template(c) for c in chats]
        expected = [reference_greedy(qwen3_5_mtp_path, p, 16) for p in ids]
        outs = [await engine.chat(chats[0], SamplingParams(max_tokens=16))]
        outs += await asyncio.gather(*[engine.chat(c, SamplingParams(max_tokens=16)) for c in chats[1:]])
        stats = engine.stats()
    for i, out in enumerate(outs):
        assert out.token_ids == expected[i], f"chat {i} diverged"
    assert stats["prefix_cache"]["hits"] >= 5 and stats["mtp"]["spec_steps"] > 0


@pytest.mark.parametrize("depth", [1, 3])
async def test_mtp_rows_finishing_inside_their_block_keep_their_answer(qwen3_5_mtp_path, depth):
    """A speculative step can finish a row before its last accepted draft (here at
    max_tokens). The row is cut back to its finish, so its prompt + answer is stored as a
    plain step's would be, and a prompt that goes on from that answer starts from all of it
    and equals a cold run. Rows finish at different points of one batch's blocks."""
    from mlx_tandem.testing.mtp_distill import default_prompts

    async with _engine(qwen3_5_mtp_path, mtp="on", mtp_depth=depth, max_batch_size=8) as engine:
        ids = [engine.encode(p) for p in default_prompts(8)]  # the head was distilled on these
        firsts = await asyncio.gather(*(engine.complete(p, SamplingParams(max_tokens=6 + i))
                                        for i, p in enumerate(ids)))
        spec = engine.stats()["mtp"]
        follows = [p + o.token_ids + ids[(i + 1) % len(ids)] for i, (p, o) in enumerate(zip(ids, firsts))]
        seconds = await asyncio.gather(*(engine.complete(f, SamplingParams(max_tokens=8)) for f in follows))
    assert spec["spec_steps"] > 0 and spec["mean_accepted_per_step"] > 0.5, spec
    for i, (p, first, second) in enumerate(zip(ids, firsts, seconds)):
        assert first.finish_reason == "length" and len(first.token_ids) == 6 + i
        assert second.usage.cached_tokens == len(p) + len(first.token_ids), f"row {i} kept no answer"
        assert second.token_ids == reference_greedy(qwen3_5_mtp_path, follows[i], 8), f"row {i} diverged"


async def test_prefix_cache_off_and_stats_shape(llama_path):
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(0)}]
    async with _engine(llama_path, prefix_cache_bytes=0) as engine:
        for _ in range(2):
            out = await engine.chat(chat, SamplingParams(max_tokens=4))
            assert out.usage.cached_tokens == 0
        stats = engine.stats()["prefix_cache"]
    assert stats["hits"] == 0 and stats["entries"] == 0


async def test_prompts_are_cut_only_where_a_snapshot_will_be_stored(qwen3_5_path):
    """Each cut is one more prefill chunk (different float rounding), so known or too-short
    points are not cut."""
    from mlx_tandem.request import Request

    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(0)}]
    async with Engine(qwen3_5_path, show_progress=False, prefix_cache_min_tokens=40) as engine:
        ids = engine.apply_chat_template(chat)
        points = engine._front.renderer.cache_points(chat, ids)
        lane = engine._core._lanes["text"]
        req = Request("probe", ids, SamplingParams(), sink=None, cache_points=points + [(20, "turn")])
        before = engine.run_on_owner_thread(lambda: lane._snapshot_points(req, 0))
        await engine.chat(chat, SamplingParams(max_tokens=2))
        after = engine.run_on_owner_thread(lambda: lane._snapshot_points(req, 0))
    assert before == sorted(points) and all(p >= 40 for p, _ in before)  # 20 is below the minimum
    assert after == []  # both points are stored now


# --------------------------------------------------------------------------- shared history
EXAMPLES = [("How do I sharpen a chisel?", "Flatten the back, then hone the bevel on a fine stone."),
            ("Which glue for oak?", "A PVA wood glue; clamp it for an hour."),
            ("What is a dado joint?", "A square groove across the grain that houses another board.")]


def _few_shot(question: str) -> list[dict]:
    """Few-shot examples written as messages, as LangChain's FewShotChatMessagePromptTemplate
    writes them, then the question: requests that differ only in the question."""
    chat = [{"role": "system", "content": SYSTEM}]
    for q, a in EXAMPLES:
        chat += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return chat + [{"role": "user", "content": question}]


def test_the_history_boundary_ends_after_the_last_reply_for_any_template(llama_engine):
    """"history": the conversation through its last assistant message, found with probe user
    messages (no markers searched for); the same for requests that differ in what follows.
    Only asked for, and only where a message follows a reply; the engine's call (None)
    finds it from the second request holding that history on."""
    renderer = llama_engine._front.renderer
    kwargs = {"chat_template": LLAMA3_TEMPLATE}
    found = []
    for question in ("Plan a birdhouse.", "Zebra wood?"):
        msgs = _few_shot(question)
        ids = renderer.render(msgs, template_kwargs=kwargs)
        points = dict((k, n) for n, k in renderer.cache_points(msgs, ids, template_kwargs=kwargs, history=True))
        found.append((ids, points))
        assert "history" not in dict((k, n) for n, k in renderer.cache_points(msgs, ids, template_kwargs=kwargs))
    (ids, points), (_, other) = found
    assert points["history"] == other["history"] and points["system"] < points["history"] < points["turn"]
    shared = renderer.decode(ids[: points["history"]])
    assert shared.endswith(EXAMPLES[-1][1] + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n")
    seen = []
    for question in ("How do I fit a hinge?", "Which saw for dovetails?", "Teak or oak?"):
        msgs = _few_shot(question)
        ids = renderer.render(msgs, template_kwargs=kwargs)
        seen.append(dict((k, n) for n, k in renderer.cache_points(msgs, ids, template_kwargs=kwargs,
                                                                  history=None)).get("history"))
    assert seen == [None, points["history"], points["history"]]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Zebra wood?"}]
    ids = renderer.render(first, template_kwargs=kwargs)
    assert "history" not in dict((k, n) for n, k in renderer.cache_points(first, ids, template_kwargs=kwargs,
                                                                          history=True))


async def test_few_shot_examples_are_stored_once_a_second_request_shares_them(qwen3_5_path):
    """A hybrid model's cache cannot be cut back, so requests that share only their
    few-shot examples reused the system prompt alone, however long the examples. The
    examples are stored once a second request holds them; every later one starts there,
    and each answer equals its cold run. With the option off, or in a conversation (each
    request's history new), no such entry is kept."""
    questions = ["Plan a birdhouse.", "Is pine good for shelves?", "How long does varnish dry?", "Zebra wood?"]
    async with _engine(qwen3_5_path) as engine:
        ids = [engine.apply_chat_template(_few_shot(q)) for q in questions]
        history = {k: p for p, k in engine._front.renderer.cache_points(_few_shot(questions[0]), ids[0],
                                                                  history=True)}["history"]
        outs = [await engine.chat(_few_shot(q), SamplingParams(max_tokens=8)) for q in questions]
        stats = engine.stats()["prefix_cache"]
    for out, p in zip(outs, ids):
        assert out.token_ids == reference_greedy(qwen3_5_path, p, 8)
    cached = [out.usage.cached_tokens for out in outs]
    assert cached[0] < history and cached[1] < history and cached[2] == cached[3] == history, (cached, history)
    assert stats["hits_by_kind"]["history"] == 2

    # (Shared points would keep the examples too, from where the second prompt parts.)
    async with _engine(qwen3_5_path, prefix_cache_history=False, prefix_cache_shared=False) as engine:
        off = [await engine.chat(_few_shot(q), SamplingParams(max_tokens=8)) for q in questions]
    assert [o.token_ids for o in off] == [o.token_ids for o in outs]
    assert all(o.usage.cached_tokens < history for o in off)

    chat = [{"role": "system", "content": SYSTEM}]
    async with _engine(qwen3_5_path) as engine:
        for q in questions:
            chat.append({"role": "user", "content": q})
            out = await engine.chat(chat, SamplingParams(max_tokens=8))
            chat.append({"role": "assistant", "content": out.content or "ok"})
        kept = engine.run_on_owner_thread(lambda: len(engine._core._lanes["text"].prefix_cache._lru["history"]))
    assert kept == 0


# --------------------------------------------------------------------------- shared prefixes
DOCUMENT = ("The workshop's dust extractor runs on a 16 A circuit. Empty its bag weekly, check the "
            "hose clamps monthly, and replace the filter cartridge every spring. ") * 4


def _about_the_document(question: str) -> list[dict]:
    """One document and a question in one user message, as a RAG prompt template writes it."""
    return [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n{DOCUMENT}\n\nQuestion: {question}"}]


def test_a_shared_point_is_where_a_prompt_parts_from_a_stored_one_before_its_answer():
    """Parting inside a stored prompt (a new question about one document) makes a point;
    parting inside a stored answer is a conversation that sent the answer back changed (a
    stop string cut): its turn point serves its next turn, and a review measured one unread
    snapshot a turn pushing the turn entries out."""
    pc = PrefixCache(1 << 30, min_tokens=4)
    document, answer = list(range(100, 140)), list(range(200, 220))
    pc.store(document + [1, 2] + answer, _hybrid(62, 1.0), "final", answer_start=42)
    assert pc.shared_point(document + [3, 4, 5], start=0) == 40  # a new question: the document
    assert pc.shared_point(document + [3, 4, 5], start=38) is None  # not min_tokens past the cache
    assert pc.shared_point(document + [1, 2] + answer[:10] + [9, 9, 5], start=0) is None  # the answer, changed
    assert pc.shared_point([7, 8, 9], start=0) is None  # nothing shared
    pc.store(document[:30], _hybrid(30, 1.0), "turn")
    assert pc.shared_point(document + [3, 4, 5], start=30) == 40


@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
async def test_questions_about_one_document_in_one_message_reuse_the_document(kind, request):
    """The template marks no point inside a message, and a hybrid model's cache cannot be
    cut back, so each question about the document prefilled it again. Where the second
    prompt parts from a stored one, it is snapshotted ("shared"), and later questions
    start there; every answer equals its cold run. An attention-only model trims a stored
    entry instead, so it makes no such snapshot. Off, nothing shared is kept."""
    path = request.getfixturevalue(f"{kind}_path")
    questions = ["Bag: how often?", "Clamps: how often?", "Filter: how often?", "Power: which circuit?"]
    # Default settings: a request's own turn point lies just past the document (a review:
    # a rule against near points then dropped every shared one at the default 32 tokens).
    async with Engine(path, show_progress=False) as engine:
        ids = [engine.apply_chat_template(_about_the_document(q)) for q in questions]
        document_end = _common_prefix(ids[0], ids[1])
        outs = [await engine.chat(_about_the_document(q), SamplingParams(max_tokens=6)) for q in questions]
        stats = engine.stats()["prefix_cache"]
    for out, p in zip(outs, ids):
        assert out.token_ids == reference_greedy(path, p, 6)
    cached = [out.usage.cached_tokens for out in outs]
    assert document_end > 100 and all(_common_prefix(ids[i], ids[j]) == document_end
                                      for i in range(4) for j in range(i))
    if kind == "qwen3_5":
        assert cached[1] < document_end and cached[2] == cached[3] == document_end, (cached, document_end)
        assert stats["hits_by_kind"]["shared"] == 2
        async with Engine(path, show_progress=False, prefix_cache_shared=False) as engine:
            off = [await engine.chat(_about_the_document(q), SamplingParams(max_tokens=6)) for q in questions]
        assert [o.token_ids for o in off] == [o.token_ids for o in outs]
        assert all(o.usage.cached_tokens < document_end for o in off)
    else:
        assert all(c >= document_end for c in cached[1:]) and stats["hits_by_kind"]["shared"] == 0
