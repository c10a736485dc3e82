"""The vision lane's prefix cache: mlx-vlm's automatic prefix cache (APC), set up for this
engine. Owner thread only (the cache holds mlx arrays).

Image rows run on mlx-vlm's BatchGenerator, whose ``insert`` takes no cache, so the text
lane's PrefixCache cannot serve them; mlx-vlm's own APC restores a row inside its prompt
batch, m-RoPE positions included. Out of the box (mlx-vlm 0.7.10) it did not serve a chat,
so this module sets it up and goes around it where it had to, each measured on the
factory's Qwen3.5 vision model:

- **Key.** APC salts a prefix with a hash of every prompt input, the prompt's whole
  ``inputs_embeds`` included, which differ for every prompt: no later prompt ever hit. The
  salt here is the content of the request's images (pixel values and grid), passed as
  ``_apc_semantic_hash``, the key APC reads first. Two images with equal token ids never
  share an entry.
- **Points.** A hybrid model's recurrent state cannot be cut back, so APC reuses exact
  snapshots only, taken where a prompt ends less one token. The next turn of a chat does not
  extend that (Qwen's template drops the think block of earlier turns), so the lane also
  snapshots at the request's "turn" and "history" points (prompt.py, the text lane's),
  mapped onto the expanded prompt (``expanded_points``). And where its last image ends,
  where questions about the same images part, once a second request shows those images
  (``seen_before``): a point costs a prefill chunk, and most images are asked about once.
- **Prefill alone what may be restored.** APC pads a prefill batch that mixes a restored
  row with others on the right, and the padding runs through GatedDeltaNet's state: the
  restored row's answer changed. So a prompt that may be restored prefills alone, and a
  prefill batch takes only the prompts ahead of it in the queue (``prefill_batch_size``);
  the others prefill several at a time, as without the cache. A restore needs an entry
  under the prompt's key, so a prompt may be restored only when an entry holds its key or
  another row of the lane does (that row may store one within the same generator step, at
  a checkpoint or when it finishes). The queue is the generator's own (``insert`` sorts it
  by prompt length, so it is not the order of arrival). Rows decode together either way.
  Attention-only vision models (block entries, whose keys are not listed) always prefill
  alone: there is no such factory model to test a mixed batch on.
- **Memory.** The RAM tier only (no disk tier), a budget of its own
  (``vision_prefix_cache_bytes``) and no reserve of free memory (the engine's ledger admits),
  given here rather than read from APC's environment variables (it still reads a few
  others: ``APC_HASH``, ``APC_MAX_POOL_TENSORS``).

Restoring does not spare the vision encoder: APC needs the whole prompt's embeddings. So the
images' features are kept too, in mlx-vlm's ``VisionFeatureCache`` (which its Qwen3.5,
Gemma 4 and DeepSeek-V4 models read in ``get_input_embeddings``), bounded by an eighth of
the budget in bytes here (``FeatureCache``; mlx-vlm's bounds a count); APC has the rest.

Which prefix APC restores is read where mlx-vlm picks it, and confirmed once it builds the
prompt batch (a batch it cannot build falls back to prefilling its rows whole), before the
row's first forward (``on_restore``): for usage, stats, and the row's logits processors,
whose token context then holds only the rest of the prompt (lanes/vision.py gives them the
restored tokens back).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Callable, Optional, Sequence

logger = logging.getLogger(__name__)

#: Snapshots kept at most besides the byte budget (each prompt stores one to three).
MAX_ENTRIES = 64
#: Image sets remembered for ``seen_before``.
MAX_SEEN = 4096
#: Share of the budget for the images' features (the rest is APC's).
FEATURE_SHARE = 8


def _nbytes(features) -> int:
    return features.nbytes if hasattr(features, "nbytes") else sum(f.nbytes for f in features)


def feature_cache(budget_bytes: int):
    """mlx-vlm's VisionFeatureCache, bounded in bytes (least recently used out first)."""
    from mlx_vlm.vision_cache import VisionFeatureCache

    class FeatureCache(VisionFeatureCache):
        def __init__(self):
            super().__init__(max_size=1 << 30)  # the bytes bound it
            self.budget_bytes, self.nbytes = int(budget_bytes), 0

        def put(self, image_source, features) -> None:
            size = _nbytes(features)
            if size > self.budget_bytes:
                return
            key = self._make_key(image_source)
            if key in self._cache:
                self.nbytes -= _nbytes(self._cache.pop(key))
            while self._cache and self.nbytes + size > self.budget_bytes:
                self.nbytes -= _nbytes(self._cache.popitem(last=False)[1])
            self._cache[key] = features
            self.nbytes += size

        def clear(self) -> None:
            super().clear()
            self.nbytes = 0

    return FeatureCache()


class VisionPrefixCache:
    def __init__(self, budget_bytes: int, *, min_tokens: int):
        from mlx_vlm.apc import APCManager

        self.budget_bytes = int(budget_bytes)
        self.features = feature_cache(self.budget_bytes // FEATURE_SHARE)
        self.encoder_skips = 0  # requests whose images' features were kept
        self.manager = APCManager(disk=None, overrides={
            "memory_max_gb": (self.budget_bytes - self.features.budget_bytes) / (1 << 30), "memory_reserve_gb": 0,
            "checkpoint_entries": MAX_ENTRIES, "checkpoint_guard_tokens": 1,
            "checkpoint_interval_tokens": 0})  # our points, not every 2048 tokens
        self.manager.exact_cache_min_tokens = max(1, int(min_tokens))  # env-only in mlx-vlm
        self._points: dict[tuple[int, ...], list[int]] = {}
        self.restored: dict[int, int] = {}  # generator uid -> prompt tokens restored
        self._picked: dict[int, int] = {}  # generator uid -> tokens picked, until the batch is built
        self.on_restore: Optional[Callable[[int, int], None]] = None  # (uid, tokens), at the pick
        self._keys: dict[int, int] = {}  # generator uid -> key, for every row of the lane
        self._seen: OrderedDict[int, None] = OrderedDict()  # keys of recent requests (seen_before)
        self._checkpoints = True  # exact entries (hybrid models), not blocks: set by attach
        self.hits = self.misses = self.hit_tokens = 0
        # Snapshots stored and dropped by close(), over every APCManager stats object
        # (clear() replaces it); evicted = stored - dropped - entries (the entry cap's
        # evictions are not counted by APC).
        self.stored = self._dropped = 0
        store = self.manager.store_exact_cache

        def store_exact_cache(*args, **kwargs):
            kept = store(*args, **kwargs)
            self.stored += bool(kept)
            return kept

        self.manager.store_exact_cache = store_exact_cache

    def attach(self, gen) -> bool:
        """Wrap a new generator's checkpoint plan and prefix pick (module docstring). False,
        with a warning, where that cannot be done: the lane then runs without the cache."""
        apc = getattr(gen, "apc", None)
        if apc is None:
            logger.warning("the vision prefix cache is off: mlx-vlm cannot restore this model's caches")
            return False
        needed = [(apc, "checkpoint_lengths"), (apc, "is_checkpoint"), (gen, "_apc_pick_for"),
                  (gen, "_build_mixed_prompt_batch"),
                  (gen, "unprocessed_prompts"), (gen, "prefill_batch_size"), (self.manager, "_exact_cache")]
        missing = [name for obj, name in needed if not hasattr(obj, name)]
        if missing:  # another mlx-vlm than the 0.7.10 this module goes around
            logger.warning("the vision prefix cache is off: this mlx-vlm has no %s", ", ".join(missing))
            return False
        self._checkpoints = bool(gen.apc.is_checkpoint)
        plan, pick, build = gen.apc.checkpoint_lengths, gen._apc_pick_for, gen._build_mixed_prompt_batch

        def checkpoint_lengths(token_ids, media_token_ids):
            ours = self._points.get(tuple(int(t) for t in token_ids), ())
            return sorted(set(plan(token_ids, media_token_ids)) | set(ours))

        def apc_pick_for(sequence):
            chosen = pick(sequence)
            self._picked[sequence[0]] = int(chosen["prefix_len"]) if chosen else 0
            return chosen

        def build_mixed_prompt_batch(sequences):
            batch = build(sequences)  # None: mlx-vlm prefills these rows whole instead
            for sequence in sequences:
                uid = sequence[0]
                picked = self._picked.pop(uid, 0)
                n = picked if batch is not None else 0
                self.restored[uid] = n
                self.hits, self.misses = self.hits + bool(n), self.misses + (not n)
                self.hit_tokens += n
                if n and self.on_restore is not None:
                    self.on_restore(uid, n)
            return batch

        gen.apc.checkpoint_lengths = checkpoint_lengths
        gen._apc_pick_for = apc_pick_for
        gen._build_mixed_prompt_batch = build_mixed_prompt_batch
        return True

    def keys(self, inputs: dict) -> tuple[int, str]:
        """The request's images' content, hashed once (pixel values, grid and the
        processor's other image inputs): the salt of its prefixes, and its features' key."""
        from mlx_vlm.apc import hash_image_payload
        from mlx_vlm.vision_cache import processed_image_key

        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        features = processed_image_key(inputs.get("pixel_values"), **extra)
        return hash_image_payload(image_ref=features), features

    def embedding_kwargs(self, features_key: str) -> dict:
        """What ``get_input_embeddings`` needs to read and keep the images' features."""
        self.encoder_skips += features_key in self.features
        return {"vision_cache": self.features, "_image_key": features_key}

    def seen_before(self, key: int) -> bool:
        """Did an earlier request (of the last ``MAX_SEEN``) show the images of ``key``?"""
        seen = key in self._seen
        self._seen[key] = None
        self._seen.move_to_end(key)
        if len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        return seen

    def track(self, uid: int, key: int) -> None:
        self._keys[uid] = key

    def untrack(self, uid: int) -> None:
        self._keys.pop(uid, None)

    def prefill_batch_size(self, waiting: Sequence[int], limit: int) -> int:
        """How many of the ``waiting`` rows (not yet picked for a prefill batch, in the
        generator's queue order) the next prefill batch may take: those in front that
        cannot be restored, or the first alone (module docstring)."""
        if not self._checkpoints:
            return 1
        stored = {e.extra_hash for e in self.manager._exact_cache.values()}
        rows = Counter(self._keys.values())
        n = 0
        for uid in waiting[:limit]:
            key = self._keys.get(uid)
            if key in stored or rows[key] > 1:
                break
            n += 1
        return max(1, n)

    def expect(self, ids: Sequence[int], points: Sequence[int]) -> None:
        """Snapshot the prompt ``ids`` also at ``points`` when it is prefilled."""
        if points:
            self._points[tuple(ids)] = list(points)

    def forget(self, ids: Sequence[int]) -> None:
        self._points.pop(tuple(ids), None)

    def _entries(self) -> int:
        # Exact snapshots (hybrid models); an attention-only model's blocks are not counted.
        return len(self.manager._exact_cache)

    def snapshot(self) -> dict:
        s = self.manager.stats_snapshot()
        entries = self._entries()
        return {"hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens,
                "stored": self.stored, "evicted": self.stored - self._dropped - entries,
                "entries": entries, "bytes": s["resident_bytes"] + self.features.nbytes,
                "budget_bytes": self.budget_bytes, "encoder_skips": self.encoder_skips}

    def close(self) -> None:
        self._dropped += self._entries()
        self.manager.clear()
        self.features.clear()
        self._points.clear()
        self.restored.clear()
        self._picked.clear()
        self._keys.clear()
        self._seen.clear()


def expanded_points(unexpanded: Sequence[int], expanded: Sequence[int], points: Sequence[int],
                    media_token_ids: set[int]) -> list[int]:
    """``points`` (lengths of ``unexpanded``) as lengths of ``expanded``, where the processor
    repeated each media placeholder; only those from the end of the last media token on, the
    least a restored prefix must hold (mlx-vlm restores only before a text-only suffix).
    Empty if the two do not align."""
    last_media = media_end(expanded, media_token_ids)
    at, j = {}, 0
    wanted = set(points)
    for i, tok in enumerate(unexpanded):
        if i in wanted:
            at[i] = j
        if j >= len(expanded) or expanded[j] != tok:
            return []
        j += 1
        if tok in media_token_ids:
            while j < len(expanded) and expanded[j] == tok:
                j += 1
    if len(unexpanded) in wanted:
        at[len(unexpanded)] = j
    return sorted(n for n in at.values() if last_media <= n < len(expanded))


def media_end(ids: Sequence[int], media_token_ids: set[int]) -> int:
    """Where the prompt's last media token ends (0 without one)."""
    return max((k + 1 for k, t in enumerate(ids) if t in media_token_ids), default=0)

