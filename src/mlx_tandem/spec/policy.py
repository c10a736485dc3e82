"""When to speculate: per-row modes and the "auto" policy that measures whether MTP pays.

A speculative step costs more than a plain one (k draft passes of the MTP head, a verify
pass over k+1 positions per row, the cache rollback) and pays back in tokens per row. Both
sides depend on the machine, the model and the batch size, so "auto" measures them instead
of guessing: per batch-size bucket it keeps a running mean of the time of plain and of
speculative steps and of the tokens a row gains per speculative step, and speculates when
``tokens_per_step * t_plain / t_spec`` exceeds 1. Unmeasured buckets are explored first,
and the losing mode is re-measured now and then so the choice follows changing traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import InvalidRequestError

MODES = ("auto", "on", "off")
#: Tokens per row a speculative step must gain on average before "auto" weighs its timing: a
#: plain step gains 1, and speculation is worth its draft and verify passes only above that.
MIN_GAIN = 1.1


def normalize_mode(value, *, what: str = "mtp") -> Optional[str]:
    """None stays None (use the engine's default); bools map to on/off."""
    if value is None:
        return None
    if value is True:
        return "on"
    if value is False:
        return "off"
    if isinstance(value, str) and value.lower() in MODES:
        return value.lower()
    raise InvalidRequestError(f"{what}={value!r}: expected one of {MODES}, True, False or None")


@dataclass
class _Bucket:
    t_plain: Optional[float] = None
    t_spec: Optional[float] = None
    gain: Optional[float] = None  # tokens per row per speculative step
    n_plain: int = 0
    n_spec: int = 0
    since_probe: int = 0
    probing: int = 0  # plain steps left in a probe


def _ema(old: Optional[float], new: float, alpha: float = 0.2) -> float:
    return new if old is None else old + alpha * (new - old)


@dataclass
class AutoPolicy:
    explore_steps: int = 4
    probe_every: int = 64
    buckets: dict = field(default_factory=dict)

    @staticmethod
    def _key(batch_size: int) -> int:
        return 1 << max(0, (batch_size - 1).bit_length())

    def speculate(self, batch_size: int) -> bool:
        b = self.buckets.setdefault(self._key(batch_size), _Bucket())
        if b.probing:
            b.probing -= 1
            return False
        if b.n_spec < self.explore_steps:
            return True
        if b.n_plain < self.explore_steps:
            return False
        # A step that gains no more tokens than a plain one cannot beat it, whatever the
        # clock says: with a head that drafts nothing useful the timing ratio alone flipped
        # on a noisy machine (a busy CPU slowed a plain step) and "auto" speculated for nothing.
        best = (b.gain or 0.0) >= MIN_GAIN and self.predicted_speedup(batch_size) > 1.0
        b.since_probe += 1
        if b.since_probe >= self.probe_every:  # re-measure the mode we are not using
            b.since_probe = 0
            # A plain step right after a speculative one is not timed (it has no pipelined
            # forward to wait for: spec/batch.py), so a plain probe is two steps; one alone
            # left t_plain at its first measures for good (review h169).
            b.probing = 1 if best else 0
            return not best
        return best

    def predicted_speedup(self, batch_size: int) -> float:
        b = self.buckets.get(self._key(batch_size))
        if b is None or not (b.t_plain and b.t_spec and b.gain):
            return 1.0
        return b.gain * b.t_plain / b.t_spec

    def record(self, batch_size: int, *, speculative: bool, seconds: float, gain: float = 1.0) -> None:
        b = self.buckets.setdefault(self._key(batch_size), _Bucket())
        if speculative:
            b.n_spec += 1
            b.t_spec = _ema(b.t_spec, seconds)
            b.gain = _ema(b.gain, gain)
        else:
            b.n_plain += 1
            b.t_plain = _ema(b.t_plain, seconds)
