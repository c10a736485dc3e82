"""The MTP head's cache, carried as one more entry of a row's prompt cache.

Putting it in the row's cache list means mlx-lm's BatchGenerator merges, filters, extends
and extracts it together with the backbone caches, so MTP state follows rows that join and
leave the continuous batch with no extra bookkeeping.

Besides the head's KV cache it holds ``pending``: the backbone's hidden state at the last
cached position, whose next token is not in the cache yet. MTP entry t pairs hidden h_t with
token t+1, so the pair for the last position is written when its next token is fed.

A row's first token has no previous hidden state. Its MTP entry is written anyway (with a
zero hidden) and then hidden behind the row's left padding, so attention never sees it and
positions match training (pair (h_t, x_{t+1}) at RoPE position t).
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..specprefill.positions import shift_offsets


class MTPKVCache(KVCache):
    """One request's MTP cache before it joins a batch (or after it is extracted)."""

    position_shift = 0  # RoPE position - stored entries (after a sparse prefill; see specprefill)

    def __init__(self, pending: Optional[mx.array] = None):
        super().__init__()
        self.pending = pending  # (1, 1, hidden) or None

    @classmethod
    def merge(cls, caches: List["MTPKVCache"]) -> "BatchMTPCache":
        return BatchMTPCache.merge(caches)


class BatchMTPCache(BatchKVCache):
    def __init__(self, left_padding: List[int]):
        super().__init__(left_padding)
        self.pending: Optional[mx.array] = None  # (B, 1, hidden)
        self.has_pending = mx.zeros((len(left_padding),), dtype=mx.bool_)
        self.lengths: Optional[mx.array] = None  # valid tokens per row in a right-padded prefill

    # ---------------------------------------------------------------- batching protocol
    @classmethod
    def merge(cls, caches) -> "BatchMTPCache":
        base = BatchKVCache.merge(caches)
        out = cls([0] * len(caches))
        out.keys, out.values, out.offset, out.left_padding, out._idx = base.state
        pend = [c.pending for c in caches]
        if any(p is not None for p in pend):
            like = next(p for p in pend if p is not None)
            out.pending = mx.concatenate([p if p is not None else mx.zeros_like(like) for p in pend])
        out.has_pending = mx.array([p is not None for p in pend])
        return shift_offsets(out, caches)

    def filter(self, batch_indices):
        super().filter(batch_indices)
        idx = mx.array(batch_indices) if not isinstance(batch_indices, mx.array) else batch_indices
        if self.pending is not None:
            self.pending = self.pending[idx]
        self.has_pending = self.has_pending[idx]
        if self.lengths is not None:
            self.lengths = self.lengths[idx]

    def extend(self, other: "BatchMTPCache"):
        a, b = self.offset.shape[0], other.offset.shape[0]
        super().extend(other)
        if self.pending is not None or other.pending is not None:
            like = self.pending if self.pending is not None else other.pending
            mine = self.pending if self.pending is not None else mx.zeros((a,) + like.shape[1:], like.dtype)
            theirs = other.pending if other.pending is not None else mx.zeros((b,) + like.shape[1:], like.dtype)
            self.pending = mx.concatenate([mine, theirs])
        self.has_pending = mx.concatenate([self.has_pending, other.has_pending])

    def extract(self, idx):
        kv = super().extract(idx) if self.keys is not None else KVCache()
        out = MTPKVCache()
        out.keys, out.values, out.offset = kv.keys, kv.values, kv.offset
        if self.pending is not None and bool(self.has_pending[idx].item()):
            out.pending = self.pending[idx: idx + 1]
        return out

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        if lengths is not None:
            self.lengths = mx.array(lengths)

    def finalize(self):
        super().finalize()
        self.lengths = None

    @property
    def state(self):
        return super().state + (self.pending, self.has_pending)

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.pending, self.has_pending = v

    @property
    def nbytes(self):
        return super().nbytes + (self.pending.nbytes if self.pending is not None else 0)

    # ---------------------------------------------------------------- MTP bookkeeping
    def hide_first_entry(self, rows: mx.array) -> None:
        """Mask the entry just written at position 0 for ``rows`` (bool, B): their dummy pair."""
        r = rows.astype(self.left_padding.dtype)
        self.left_padding = self.left_padding + r
        self.offset = self.offset - r
