"""Request-local RoPE positions: a row's attention caches can sit ahead of what they store.

After a sparse prefill a row's KV cache holds fewer entries than the position its next token
is at. mlx-lm's batch caches already keep the two apart (``BatchKVCache.offset`` is the RoPE
position of each row; storage and masks use ``_idx`` and ``left_padding``), but a single
request's ``KVCache`` uses one ``offset`` for both, and ``BatchKVCache.merge`` rebuilds
offsets from stored lengths. ``PositionedKVCache`` carries the gap (``position_shift``)
through the merge, so the row joins the continuous batch at its true position. No RoPE
module and no shared model object is touched: another request's positions cannot change.
A sliding-window layer's ``RotatingKVCache`` is no ``KVCache`` and its batch cache no
``BatchKVCache`` (gemma3, gpt_oss, a llama with ``layer_types``): ``PositionedRotatingKVCache``
carries its gap the same way (review h165: those layers decoded at the compact position).
Its window then spans the last entries stored, as the full layers' keys are the ones kept.
(mlx-lm 0.32.)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, CacheList, KVCache, RotatingKVCache

# The batch caches whose ``offset`` is each row's RoPE position, apart from what they store.
_BATCH_ATTENTION = (BatchKVCache, BatchRotatingKVCache)


def shift_offsets(batch: Any, caches: list[Any]) -> Any:
    """Add each row's ``position_shift`` (0 when it has none) to a merged batch cache."""
    shifts = [int(getattr(c, "position_shift", 0)) for c in caches]
    if any(shifts):
        batch.offset = batch.offset + mx.array(shifts, dtype=batch.offset.dtype)
    return batch


class PositionedKVCache(KVCache):
    """A request's KV cache whose next RoPE position is ``offset + position_shift``."""

    def __init__(self, position_shift: int = 0):
        super().__init__()
        self.position_shift = position_shift

    @classmethod
    def of(cls, kv: KVCache, position_shift: int = 0) -> "PositionedKVCache":
        out = cls(position_shift)
        out.keys, out.values, out.offset = kv.keys, kv.values, kv.offset
        return out

    @classmethod
    def merge(cls, caches):
        # Whichever row comes first, every row's shift is honoured.
        return shift_offsets(BatchKVCache.merge(caches), caches)


class PositionedRotatingKVCache(RotatingKVCache):
    """A request's sliding-window cache whose next RoPE position is ``offset + position_shift``.
    ``offset`` stays a count of what it stored, never a position: growth, rotation and the
    mask read it (from a restored prefix past the window it counts from the window's
    entries, which mlx-lm's batch merge keeps; the shift holds the rest)."""

    def __init__(self, max_size: int, keep: int = 0, position_shift: int = 0):
        super().__init__(max_size, keep)
        self.position_shift = position_shift

    @classmethod
    def of(cls, kv: RotatingKVCache, position_shift: int = 0) -> "PositionedRotatingKVCache":
        out = cls(kv.max_size, kv.keep, position_shift)
        out.keys, out.values, out.offset, out._idx = kv.keys, kv.values, kv.offset, kv._idx
        return out

    @classmethod
    def merge(cls, caches):
        return shift_offsets(BatchRotatingKVCache.merge(caches), caches)


def positioned(cache: list[Any]) -> list[Any]:
    """The same cache with every plain ``KVCache`` made a ``PositionedKVCache`` and every
    ``RotatingKVCache`` a ``PositionedRotatingKVCache`` (shift 0).

    The text lane gives every row such a cache, so a batch's first row (whose class picks
    the merge) always carries shifts through, whatever kind of row joins with it.
    """
    return [_positioned(c) for c in cache]


def _positioned(c: Any) -> Any:
    # A CacheList (falcon_h1's, deepseek_v32's layers) merges each member by its first
    # row's member's class: its attention members carry shifts the same way.
    if isinstance(c, CacheList):
        return CacheList(*(_positioned(m) for m in c.caches))
    return PositionedKVCache.of(c) if type(c) is KVCache else \
        PositionedRotatingKVCache.of(c) if type(c) is RotatingKVCache else c


def _leaves(cache: list[Any]) -> list[Any]:
    """Every cache of a row's list, a CacheList's members in their place."""
    return [leaf for c in cache for leaf in (_leaves(c.caches) if isinstance(c, CacheList) else [c])]


def as_batch_of_one(cache: list[Any]) -> list[Any]:
    """A request's cache as batch caches of one row, whose RoPE offsets can be set freely."""
    return [type(c).merge([c]) for c in cache]


def set_position(batch_cache: list[Any], position: int) -> None:
    """Make the next token of a one-row batch cache sit at RoPE ``position``.

    Every attention cache moves by the same amount, so caches that keep their own relation
    to the backbone's position (the MTP head's entries sit one position behind) keep it.
    The first attention cache is the reference (the backbone's come first in a row's list).
    """
    attn = [c for c in _leaves(batch_cache) if isinstance(c, _BATCH_ATTENTION)]
    if not attn:
        return
    delta = position - int(attn[0].offset[0].item())
    if delta:
        for c in attn:
            c.offset = c.offset + delta


def from_batch_of_one(batch_cache: list[Any], position: int) -> list[Any]:
    """Back to a request's cache whose next token sits at ``position`` (see PositionedKVCache)."""
    set_position(batch_cache, position)
    return [_row_of(c) for c in batch_cache]


def _row_of(c: Any) -> Any:
    """One batch-of-one cache back as a request's, with its gap as ``position_shift``."""
    if isinstance(c, CacheList):
        return CacheList(*(_row_of(m) for m in c.caches))
    row = c.extract(0)
    if isinstance(c, BatchKVCache):
        stored = row.offset if row.keys is not None else 0
        shift = int(c.offset[0].item()) - stored
        if type(row) is KVCache:
            return PositionedKVCache.of(row, shift)
        row.position_shift = shift  # e.g. the MTP head's cache: same protocol, its own class
    elif isinstance(c, BatchRotatingKVCache):
        # extract() sets the row's offset to its RoPE position; a RotatingKVCache's
        # offset must count the tokens it took (a one-row batch's ``_offset``).
        shift = int(c.offset[0].item()) - c._offset
        row.offset = c._offset
        return PositionedRotatingKVCache.of(row, shift)
    return row
