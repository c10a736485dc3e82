"""A logits processor that forces an exact token sequence (then EOS): deterministic text."""

from __future__ import annotations

import mlx.core as mx


def forcing_processor(token_ids: list[int], eos_id: int):
    targets = list(token_ids) + [eos_id]
    step = 0

    def force(tokens, logits):
        nonlocal step
        tid = targets[min(step, len(targets) - 1)]
        step += 1
        idx = mx.arange(logits.shape[-1])
        return mx.where(idx == tid, 0.0, -1e9).astype(logits.dtype)[None]

    return force
