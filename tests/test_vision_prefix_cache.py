"""The vision lane's prefix cache (lanes/vision_cache.py, over mlx-vlm's APC): later turns of a
conversation about an image start from a snapshot and answer exactly as without the cache;
another image with the same words never reads it."""

from __future__ import annotations

import asyncio

import pytest

from mlx_tandem import Engine, InvalidRequestError
from mlx_tandem.lanes.vision_cache import expanded_points, media_end
from mlx_tandem.options import EngineOptions

from .test_routing import _data_uri, _image, _img_part, _text, _user

TOKENS = 12


def _conversation(seed: int, size: int = 64):
    return [{"role": "system", "content": "You describe pictures for people who cannot see them."},
            _user(_img_part(_data_uri(_image(seed, size))), _text(f"What is in picture {seed}?"))]


async def _turns(engine, conversations, turns: int):
    """Every conversation's turns, the conversations at once: token ids and cached tokens
    per turn."""
    conversations = [list(c) for c in conversations]
    ids, cached = [], []
    for t in range(turns):
        outs = await asyncio.gather(*(engine.chat(c, {"max_tokens": TOKENS}) for c in conversations))
        ids.append([o.token_ids for o in outs])
        cached.append([o.usage.cached_tokens for o in outs])
        for c, o in zip(conversations, outs):
            c += [{"role": "assistant", "content": o.text}, {"role": "user", "content": f"Tell me more ({t})."}]
    return ids, cached


def _run(path, conversations, turns, **options):
    async def go():
        async with Engine(path, show_progress=False, **options) as engine:
            out = await _turns(engine, conversations, turns)
            return (*out, engine.stats()["prefix_cache"]["vision"])
    return asyncio.run(go())


def test_later_turns_about_an_image_start_from_a_snapshot_and_answer_as_without_it(qwen3_5_vl_path):
    conversations = [_conversation(1), _conversation(2), _conversation(3, 96)]
    ids, cached, stats = _run(qwen3_5_vl_path, conversations, 3)
    plain, plain_cached, off = _run(qwen3_5_vl_path, conversations, 3, vision_prefix_cache_bytes=0)
    assert ids == plain
    assert cached[0] == [0, 0, 0] and plain_cached == [[0, 0, 0]] * 3 and off["hits"] == 0
    # Each later turn restores at least the turn before it ("turn" points, not only the end).
    for earlier, later in zip(cached, cached[1:]):
        assert all(0 < c and e <= c for e, c in zip(earlier, later)), cached
    assert stats["hits"] == 6 and stats["misses"] == 3 and stats["hit_tokens"] == sum(map(sum, cached))
    assert 0 < stats["bytes"] <= stats["budget_bytes"]


def test_other_images_with_the_same_words_never_read_a_snapshot(qwen3_5_vl_path):
    """The prompts' token ids are equal (each image expands to as many tokens): only the
    images' content tells them apart."""
    def chat(seed):
        return [_conversation(1)[0], _user(_img_part(_data_uri(_image(seed, 64))), _text("What is in the picture?"))]

    async def go(**options):
        async with Engine(qwen3_5_vl_path, show_progress=False, **options) as engine:
            assert engine.apply_chat_template(chat(1)) == engine.apply_chat_template(chat(2))
            outs = [await engine.chat(chat(s), {"max_tokens": TOKENS}) for s in (1, 2, 1)]
            return [o.token_ids for o in outs], [o.usage.cached_tokens for o in outs]

    ids, cached = asyncio.run(go())
    plain, _ = asyncio.run(go(vision_prefix_cache_bytes=0))
    assert ids == plain
    assert ids[0] != ids[1]  # the images do change the answer
    assert cached[1] == 0 and cached[2] > 0  # the same image again reads its own snapshot


def test_a_restored_prompt_prefilled_beside_a_new_one_answers_as_alone(qwen3_5_vl_path):
    """A second turn (restored) and a new conversation (cold) submitted at once. mlx-vlm
    0.7.10 pads such a mixed prefill batch on the right, through the recurrent state, so the
    lane prefills one image prompt at a time (vision_cache.py)."""
    first = _conversation(4)

    async def go(**options):
        async with Engine(qwen3_5_vl_path, show_progress=False, **options) as engine:
            reply = await engine.chat(first, {"max_tokens": TOKENS})
            second = first + [{"role": "assistant", "content": reply.text},
                              {"role": "user", "content": "And the colours?"}]
            outs = await asyncio.gather(engine.chat(second, {"max_tokens": TOKENS}),
                                        engine.chat(_conversation(5, 96), {"max_tokens": TOKENS}))
            return [o.token_ids for o in outs], outs[0].usage.cached_tokens

    ids, cached = asyncio.run(go())
    plain, _ = asyncio.run(go(vision_prefix_cache_bytes=0))
    assert cached > 0
    assert ids == plain


def test_points_move_past_each_expanded_image():
    pad, other = 7, 9
    unexpanded = [1, 2, pad, 3, 4, 5, pad, 6, 8]
    expanded = [1, 2, pad, pad, pad, 3, 4, 5, pad, pad, 6, 8]
    # 4 is before the second image (a restored prefix must hold every image): dropped.
    assert expanded_points(unexpanded, expanded, [4, 8, 9], {pad}) == [11]
    assert expanded_points(unexpanded, expanded, [7], {pad}) == [10]
    assert expanded_points(unexpanded, [1, 2, pad, other], [2], {pad}) == []  # they do not align
    assert media_end(expanded, {pad}) == 10 and media_end([1, 2], {pad}) == 0


def test_the_vision_cache_option():
    assert EngineOptions().vision_cache_bytes == EngineOptions().prefix_cache_bytes // 4
    assert EngineOptions(prefix_cache_bytes=0).vision_cache_bytes == 0
    assert EngineOptions(vision_prefix_cache_bytes=5).vision_cache_bytes == 5
    with pytest.raises(InvalidRequestError, match="vision_prefix_cache_bytes"):
        EngineOptions(vision_prefix_cache_bytes=-1)


def test_a_text_engine_reports_an_empty_vision_cache(qwen3_5_engine):
    stats = qwen3_5_engine.stats()["prefix_cache"]["vision"]
    assert stats == {"hits": 0, "misses": 0, "hit_tokens": 0, "stored": 0, "evicted": 0, "entries": 0, "bytes": 0,
                     "budget_bytes": 0, "encoder_skips": 0}


@pytest.fixture
def prefill_batches(monkeypatch):
    """Each prefill batch mlx-vlm's generator builds: (rows, whether it restores them)."""
    import sys

    from mlx_vlm.generate import ar  # noqa: F401 - loads the module the generator's batches come from

    batch_class = sys.modules["mlx_vlm.generate.ar"].PromptProcessingBatch
    batches = []
    init = batch_class.__init__

    def spy(self, *args, **kwargs):
        batches.append((len(kwargs["uids"]), kwargs.get("warm_cache") is not None))
        init(self, *args, **kwargs)

    monkeypatch.setattr(batch_class, "__init__", spy)
    return batches


def test_new_images_at_once_still_prefill_together(qwen3_5_vl_path, prefill_batches):
    """Only a prompt that may be restored prefills alone: new images share prefill batches
    as without the cache, and a second turn submitted beside new ones is restored alone."""
    sizes = prefill_batches
    async def go():
        async with Engine(qwen3_5_vl_path, show_progress=False, prefill_batch_size=4) as engine:
            first = _conversation(6)
            reply = await engine.chat(first, {"max_tokens": TOKENS})
            sizes.clear()
            await asyncio.gather(*(engine.chat(_conversation(10 + i), {"max_tokens": TOKENS}) for i in range(3)))
            new = list(sizes)
            sizes.clear()
            second = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "More?"}]
            await asyncio.gather(engine.chat(second, {"max_tokens": TOKENS}),
                                 *(engine.chat(_conversation(20 + i), {"max_tokens": TOKENS}) for i in range(3)))
            return new, list(sizes)

    new, beside_a_second_turn = asyncio.run(go())
    assert max(n for n, _ in new) > 1 and not any(warm for _, warm in new), new
    assert [n for n, warm in beside_a_second_turn if warm] == [1], beside_a_second_turn


def test_the_prefill_batch_follows_the_generators_queue_order(qwen3_5_vl_path, prefill_batches):
    """mlx-vlm's ``insert`` sorts the waiting prompts by length: a restorable second turn,
    shorter and submitted after two long new ones, is first in the queue (found by a
    review; the lane counted in order of arrival and let it share a batch with one)."""
    batches = prefill_batches
    def conversation(seed, question):
        return [_conversation(seed)[0], _user(_img_part(_data_uri(_image(seed, 64))), _text(question))]

    async def go(**options):
        async with Engine(qwen3_5_vl_path, show_progress=False, prefill_step_size=8, **options) as engine:
            first = _conversation(4)
            reply = await engine.chat(first, {"max_tokens": TOKENS})
            second = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Colours?"}]
            batches.clear()
            # A long new prompt keeps the generator prefilling while the next three queue up.
            busy = asyncio.ensure_future(engine.chat(conversation(29, "Tell me a long story. " * 60),
                                                     {"max_tokens": TOKENS}))
            await asyncio.sleep(0.3)
            tasks = []
            for messages in (conversation(30, "Describe every detail. " * 20),
                             conversation(31, "List every colour. " * 20), second):
                tasks.append(asyncio.ensure_future(engine.chat(messages, {"max_tokens": TOKENS})))
                await asyncio.sleep(0.01)
            outs = await asyncio.gather(*tasks)
            await busy
            return [o.token_ids for o in outs], outs[-1].usage.cached_tokens

    ids, cached = asyncio.run(go())
    warm = [n for n, restored in batches if restored]
    plain, _ = asyncio.run(go(vision_prefix_cache_bytes=0))
    assert cached > 0 and warm == [1], batches
    assert ids == plain


def test_snapshots_over_the_entry_cap_count_as_evicted(qwen3_5_vl_path, monkeypatch):
    from mlx_tandem.lanes import vision_cache

    monkeypatch.setattr(vision_cache, "MAX_ENTRIES", 2)
    _, _, stats = _run(qwen3_5_vl_path, [_conversation(1), _conversation(2)], 2)
    assert stats["entries"] == 2 and stats["stored"] > 2
    assert stats["evicted"] == stats["stored"] - stats["entries"]


def test_an_mlx_vlm_without_what_the_cache_goes_around_runs_without_it(qwen3_5_vl_path, monkeypatch, caplog):
    """vision_cache.py wraps mlx-vlm 0.7.10 internals; another version that lacks one gets a
    warning and an uncached lane, not a failure."""
    import sys

    from mlx_vlm.generate import ar  # noqa: F401

    monkeypatch.delattr(sys.modules["mlx_vlm.generate.ar"].BatchGenerator, "_apc_pick_for")
    conversation = _conversation(1)
    with caplog.at_level("WARNING", logger="mlx_tandem.lanes.vision_cache"):
        ids, cached, stats = _run(qwen3_5_vl_path, [conversation], 2)
    assert "this mlx-vlm has no _apc_pick_for" in caplog.text
    assert cached == [[0], [0]] and stats["budget_bytes"] == 0
    monkeypatch.undo()
    assert ids == _run(qwen3_5_vl_path, [conversation], 2, vision_prefix_cache_bytes=0)[0]


def test_the_vision_encoder_runs_once_per_image_over_a_conversation(qwen3_5_vl_path, monkeypatch):
    """APC needs the whole prompt's embeddings; the images' features are kept (mlx-vlm's
    VisionFeatureCache), so later turns do not run the encoder again."""
    from mlx_vlm.models.qwen3_5.vision import VisionModel

    calls = []
    call = VisionModel.__call__

    def spy(self, *args, **kwargs):
        calls.append(1)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(VisionModel, "__call__", spy)
    conversations = [_conversation(1), _conversation(2)]
    ids, _, stats = _run(qwen3_5_vl_path, conversations, 3)
    with_cache = len(calls)
    calls.clear()
    assert ids == _run(qwen3_5_vl_path, conversations, 3, vision_prefix_cache_bytes=0)[0]
    assert with_cache == 2 and len(calls) == 6
    assert stats["encoder_skips"] == 4


def test_the_feature_cache_is_bounded_in_bytes():
    import mlx.core as mx

    from mlx_tandem.lanes.vision_cache import feature_cache

    cache = feature_cache(1000)
    a, b, c = (mx.zeros((100,), dtype=mx.float32) for _ in range(3))  # 400 bytes each
    cache.put("a", a)
    cache.put("b", b)
    cache.get("a")  # a is now the most recently used
    cache.put("c", c)
    assert "a" in cache and "c" in cache and "b" not in cache and cache.nbytes == 800
    cache.put("big", mx.zeros((300,), dtype=mx.float32))  # larger than the budget: not kept
    assert "big" not in cache and cache.nbytes == 800
    cache.put("a", [a, b])  # replaced, 800 bytes: the old a leaves, then c makes room
    assert cache.nbytes == 800 and "a" in cache and "c" not in cache


def test_questions_about_one_image_share_its_prefill(qwen3_5_vl_path):
    """Separate requests, one image, different questions: once a second request shows the
    image, it snapshots where the image ends, which serves the ones after it."""
    def ask(question):
        return [_conversation(7)[0], _user(_img_part(_data_uri(_image(7, 64))), _text(question))]

    questions = ["What colour is it?", "Is there a person in it?", "Describe the background.", "Any text?"]

    async def go(**options):
        async with Engine(qwen3_5_vl_path, show_progress=False, **options) as engine:
            outs = [await engine.chat(ask(q), {"max_tokens": TOKENS}) for q in questions]
            # Where the image ends in the expanded prompt: its tail is the unexpanded one's.
            ids = engine.apply_chat_template(ask(questions[1]))
            pad = engine.tokenizer.convert_tokens_to_ids("<|image_pad|>")
            tail = len(ids) - (max(i for i, t in enumerate(ids) if t == pad) + 1)
            return [o.token_ids for o in outs], [o.usage.cached_tokens for o in outs], outs[1].usage.prompt_tokens - tail

    ids, cached, image_end = asyncio.run(go())
    assert ids == asyncio.run(go(vision_prefix_cache_bytes=0))[0]
    assert cached == [0, 0, image_end, image_end], (cached, image_end)


def test_processors_on_a_restored_row_see_the_whole_prompt(qwen3_5_vl_path):
    """mlx-vlm passes a restored row only the rest of its prompt as the processors' token
    context; the lane puts the restored tokens back (found by a review: a repetition
    penalty over a window that reaches into the prompt answered differently)."""
    def ask(seed):
        return [_conversation(seed)[0], _user(_img_part(_data_uri(_image(seed, 64))), _text(
            "What is in this picture? " + " ".join(f"w{i * seed}" for i in range(30))))]

    penalty = {"max_tokens": TOKENS, "repetition_penalty": 50.0, "repetition_context_size": 400}

    async def go(params, **options):
        async with Engine(qwen3_5_vl_path, show_progress=False, **options) as engine:
            out, contexts = [], []
            for seed in range(1, 6):
                for _ in range(2):  # the second is restored
                    seen = []

                    def spy(tokens, logits, seen=seen):
                        seen.append(len(tokens))
                        return logits

                    o = await engine.chat(ask(seed), {**params, "logits_processors": [spy]})
                    out.append(o.token_ids)
                    contexts.append((seen[0], o.usage.prompt_tokens, o.usage.cached_tokens))
            return out, contexts

    on, contexts = asyncio.run(go(penalty))
    off, _ = asyncio.run(go(penalty, vision_prefix_cache_bytes=0))
    plain, _ = asyncio.run(go({"max_tokens": TOKENS}, vision_prefix_cache_bytes=0))
    assert any(c for _, _, c in contexts[1::2])
    assert all(first == prompt for first, prompt, _ in contexts), contexts
    assert on != plain  # the penalty acts
    assert on == off
