"""The owner thread's PRNG key, which unseeded sampling draws from.

In mlx 0.32 the key belongs to the thread, and every new thread starts from the same key
(seeded once per process from the clock): each engine's owner thread replayed one sequence,
so two engines in a process (``Engine.shared`` with other options, a closed engine opened
again) gave the same "random" answers, 6 of 6 in an audit. A request's ``seed`` is its own
key and is untouched by this. Owner thread only.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx

logger = logging.getLogger(__name__)


def seed_from_os() -> None:
    """Give this thread a key of its own (from the OS, not the clock: two engines can start
    within one clock tick)."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))


def restore_key(key: mx.array) -> None:
    """Make ``key`` this thread's PRNG key again. A sampler compiled with the key as input
    and output (mlx-lm's) that raises mid-trace leaves a placeholder in ``mx.random.state``
    (mlx 0.32), failing every later unseeded draw. The state cannot be assigned to, but
    ``mx.random.seed(s)`` sets the key to ``[s >> 32, s & 0xffffffff]``."""
    try:
        hi, lo = (int(v) for v in key.tolist())
        mx.random.seed((hi << 32) | lo)
    except Exception:  # noqa: BLE001 - the saved key itself unusable: any fresh state beats a broken one
        logger.warning("could not restore the PRNG key after a failed step; reseeding", exc_info=True)
        seed_from_os()
