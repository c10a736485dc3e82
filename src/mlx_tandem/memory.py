"""Memory-aware admission: what a request's cache will cost, and a ledger that admits a
request only while the running requests' caches fit the engine's budget.

Why a ledger and not a measurement: MLX allocates lazily and a request's cache grows token
by token, so the memory in use when a request is admitted says little about the memory its
batch will need at the end. The ledger reserves each request's worst case up front, from a
footprint probed on the model itself, so an admitted batch can always finish.

The batch layout it models is mlx-lm's (0.32) and mlx-vlm's: a lane decodes its rows in one
rectangular cache, every row right-aligned to the longest (``BatchKVCache.extend`` and
``merge`` pad the shorter rows). So a lane of ``n`` rows whose longest row may reach ``L``
tokens holds ``n`` times the cache of one ``L``-token row: one long request makes every row
of its batch as long. A buffer grows in whole steps of 256 slots from wherever its last
chunk ended, and ``filter`` trims only the padding every row shares, so it may hold up to
255 slots past its longest row, never more (``update_and_fetch`` adds at most 255 past
what it writes, ``merge`` none, ``extend`` and ``filter`` keep the larger spare): a row
reserves ``L + 255`` slots. A speculative step's ragged rollback pads its shorter rows,
and drops the padding they all share at once (``spec/verify.py``), so it keeps this bound.
Recurrent state (GatedDeltaNet's ``ArraysCache``) is a fixed size per row, and speculative
verification keeps one copy per verified position besides (``spec/verify.py``).

SpecPrefill's draft scores a request's whole prompt (and a lookahead) in a cache of its own,
while the target's row holds only what it restored from the prefix cache; the target
prefills the dense part (a system prompt, shared examples) and the kept chunks once the
draft's cache is gone (until 2026-11-29 the dense part was counted beside the draft, and
densely prefilled examples made requests that fit too large). The row's own reservation
covers that peak unless the draft's cache is larger per token (a Qwen3 draft for a hybrid
Qwen3.5 target, whose layers are mostly recurrent): the difference is reserved besides.

Not counted, because they pass within a step or two: a step's activations; the copy while
a prefill joins the batch; and, after rows leave, the buffer ``filter`` gathered at the old
length, which the remaining rows view until their next growth or join. ``memory_fraction``
below 1 leaves room for them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Optional

logger = logging.getLogger(__name__)

#: mlx-lm's KVCache / BatchKVCache grow their buffers in steps of this many tokens.
CACHE_STEP = 256
#: Slots a batch buffer may hold past its longest row (see the module docstring).
SPARE_SLOTS = CACHE_STEP - 1


@dataclass(frozen=True)
class CacheFootprint:
    """The cache one row of a batch holds, per layer kind (bytes)."""

    #: Attention layers whose cache grows with every token (KVCache).
    kv_bytes_per_token: int
    #: Sliding-window layers: (bytes per token, window), capped at the window.
    windowed: tuple[tuple[int, int], ...] = ()
    #: Fixed-size state per row (recurrent ArraysCache layers, and caches of unknown kind).
    state_bytes_per_row: int = 0
    #: Attention layers counted in ``kv_bytes_per_token``.
    attention_layers: int = 0
    #: Tokens a row may hold past prompt + max_tokens (a verify step's drafts).
    overshoot: int = 0
    #: False when a cache kind this module does not know was counted as fixed state.
    complete: bool = True

    def row_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """The longest a row may get: its prompt, its answer, and a verify step's drafts."""
        return prompt_tokens + max_tokens + self.overshoot

    def speculating(self, *, head_layers: int, depth: int) -> "CacheFootprint":
        """A row decoded with an MTP head of ``head_layers`` attention layers drafting
        ``depth`` tokens: the head's cache per token, and ``depth + 1`` more copies of the
        recurrent state, which the verify step records to roll back (``spec/verify.py``)."""
        per_layer = self.kv_bytes_per_token // self.attention_layers if self.attention_layers else 0
        return replace(self, kv_bytes_per_token=self.kv_bytes_per_token + head_layers * per_layer,
                       state_bytes_per_row=self.state_bytes_per_row * (depth + 2), overshoot=depth + 1)

    def row_bytes(self, tokens: int) -> int:
        """One row's cache in a batch whose longest row holds ``tokens`` tokens."""
        slots = max(tokens, 1) + SPARE_SLOTS
        windowed = sum(b * min(slots, w) for b, w in self.windowed)
        return self.state_bytes_per_row + self.kv_bytes_per_token * slots + windowed

    def held_bytes(self, tokens: int) -> int:
        """What one row's cache holds for exactly ``tokens`` tokens, no spare slots: the
        least any snapshot of them holds (prefix_cache.py)."""
        windowed = sum(b * min(tokens, w) for b, w in self.windowed)
        return self.state_bytes_per_row + self.kv_bytes_per_token * tokens + windowed

    def lane_bytes(self, rows: int, longest: int) -> int:
        """A lane's rectangular batch cache: ``rows`` rows as long as the longest."""
        return rows * self.row_bytes(longest) if rows else 0


def probe_footprint(model: Any) -> CacheFootprint:
    """Measure one row's cache by running one token through ``model`` (owner thread only).

    Generic over mlx-lm models: the cache kinds are read from the caches the model makes,
    not from its config.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    per_token = attention_layers = state = 0
    windowed, complete = [], True
    for c in cache:
        if isinstance(c, RotatingKVCache):
            windowed.append((_kv_per_token(c), c.max_size))
        elif isinstance(c, KVCache):
            per_token += _kv_per_token(c)
            attention_layers += 1
        elif isinstance(c, ArraysCache):
            state += sum(a.nbytes for a in c.cache if a is not None)
        else:  # a cache kind this module does not know: count what one token made, per row
            logger.warning("memory admission: unknown cache kind %s counted as fixed state",
                           type(c).__name__)
            state += int(getattr(c, "nbytes", 0))
            complete = False
    return CacheFootprint(kv_bytes_per_token=per_token, windowed=tuple(windowed), state_bytes_per_row=state,
                          attention_layers=attention_layers, complete=complete)


def _kv_per_token(c) -> int:
    k, v = c.keys, c.values  # (batch 1, kv heads, slots, head dim)
    return k.shape[1] * k.shape[3] * k.dtype.size + v.shape[1] * v.shape[3] * v.dtype.size


def device_memory_bytes() -> int:
    """Memory the device can give this process: Metal's recommended working set, the GPU's
    memory on CUDA, or the machine's physical memory on the CPU backend.

    On CUDA, memory other processes hold on the same GPU is not subtracted (MLX 0.32's
    ``device_info`` reports ``total_memory``, and ``free_memory`` at one instant); set
    ``request_memory_bytes`` when sharing a GPU."""
    import mlx.core as mx

    info_fn = getattr(mx, "device_info", None) or getattr(getattr(mx, "metal", None), "device_info", None)
    info = info_fn() if info_fn is not None else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class _Row:
    lane: str
    longest: int  # tokens the row may reach: CacheFootprint.row_tokens
    side_bytes: int = 0  # a cache of its own besides the lane's batch (SpecPrefill's draft)


@dataclass
class MemoryLedger:
    """Reservations of the running requests' caches against ``budget`` bytes (owner thread).

    ``footprints`` gives each lane's row cost: the text lane's rows may speculate, the
    vision lane's never do; ``"draft"``, where present, is SpecPrefill's draft model's."""

    footprints: dict[str, CacheFootprint]
    budget: int
    _rows: dict[str, _Row] = field(default_factory=dict)

    def footprint(self, lane: str) -> CacheFootprint:
        return self.footprints.get(lane) or self.footprints["text"]

    def row_tokens(self, lane: str, prompt_tokens: int, max_tokens: int) -> int:
        return self.footprint(lane).row_tokens(prompt_tokens, max_tokens)

    def alone_bytes(self, lane: str, tokens: int) -> int:
        return self.footprint(lane).lane_bytes(1, tokens)

    def scoring_bytes(self, lane: str, row_tokens: int, draft_tokens: int, dense_tokens: int) -> int:
        """What SpecPrefill's scoring needs beyond a row's own reservation (module docstring):
        the draft's cache of ``draft_tokens`` beside the ``dense_tokens`` the row holds
        meanwhile (those it restored from the cache), less the row."""
        draft = self.footprints.get("draft")
        if draft is None or not draft_tokens:
            return 0
        dense = self.alone_bytes(lane, dense_tokens) if dense_tokens else 0
        return max(0, draft.lane_bytes(1, draft_tokens) + dense - self.alone_bytes(lane, row_tokens))

    def reserved(self) -> int:
        return (sum(self._lane_bytes(lane) for lane in {r.lane for r in self._rows.values()})
                + sum(r.side_bytes for r in self._rows.values()))

    def fits(self, lane: str, tokens: int, side_bytes: int = 0) -> bool:
        """Would a new row of ``tokens`` on ``lane`` (and ``side_bytes`` of its own) keep
        every lane's batch within budget?"""
        return (self.reserved() - self._lane_bytes(lane) + self._lane_bytes(lane, tokens) + side_bytes
                <= self.budget)

    def reserve(self, request_id: str, lane: str, tokens: int, side_bytes: int = 0) -> None:
        self._rows[request_id] = _Row(lane, tokens, side_bytes)

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def _lane_bytes(self, lane: str, new_row: Optional[int] = None) -> int:
        """The lane's batch cache, with a row of ``new_row`` tokens added if given."""
        rows = [r.longest for r in self._rows.values() if r.lane == lane] + ([] if new_row is None else [new_row])
        return self.footprint(lane).lane_bytes(len(rows), max(rows, default=0))

    def snapshot(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "reserved_bytes": self.reserved(),
                "rows": {lane: {"kv_bytes_per_token": f.kv_bytes_per_token, "state_bytes_per_row": f.state_bytes_per_row}
                         for lane, f in self.footprints.items()}}


def derive_budget(explicit: Optional[int], fraction: float, *, in_use: int, prefix_cache_bytes: int,
                  device_bytes: int) -> int:
    """The running requests' share: ``explicit`` if given, else ``fraction`` of the device's
    memory less what is already in use (weights, heads, drafts) and the prefix cache's budget."""
    if explicit is not None:
        return explicit
    return max(0, int(fraction * device_bytes) - in_use - prefix_cache_bytes)
