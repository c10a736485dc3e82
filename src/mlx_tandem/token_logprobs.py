"""The chosen token's log-probability and the most likely ones, for the rows of a step
that asked for logprobs (``SamplingParams.logprobs``). Owner thread only (mlx arrays).

Every lane hands over the distribution its sampler drew from (log-softmax after the
logits processors, before temperature and the filters; a token ban the sampler applies is
applied here too); the gather reads all rows of a step in one evaluation, so asking for
logprobs adds one small sync a step, not one a row.
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx


#: One token's (log-probability, ((token id, log-probability), ...) most likely first).
RawLogprob = tuple[float, tuple[tuple[int, float], ...]]


def gather(logprobs: Sequence[mx.array], tokens: Sequence[int], top: Sequence[int],
           banned: Sequence[tuple[int, ...]]) -> list[RawLogprob]:
    """For each row: ``logprobs`` (V,) or (1, V), the token drawn from it, how many of the
    most likely tokens to list (0: none), and the ids its sampler never draws
    (``samplers.BannedSampler``: a chat without tools cannot open a call), which are taken
    out of the distribution as the sampler takes them out.

    Every row is normalized again in float32: mlx-lm (0.32) takes the log-softmax in the
    model's dtype, and on a bf16 checkpoint (kept bf16 on a GPU) its rounded logsumexp
    shifted every value by up to 0.06, where an MTP step's values (spec/batch.py, from the
    logits in float32) did not (review h167)."""
    if not logprobs:
        return []
    rows = []
    for a, ban in zip(logprobs, banned):
        a = a.reshape(-1).astype(mx.float32)
        ids = [t for t in ban if t < a.shape[-1]]
        if ids:  # the few banned ids set, not a vocabulary-wide mask built every step
            a[mx.array(ids)] = -float("inf")
        rows.append(a - mx.logsumexp(a, axis=-1, keepdims=True))
    lp = mx.stack(rows)
    chosen = mx.take_along_axis(lp, mx.array(list(tokens), dtype=mx.int32)[:, None], axis=1)[:, 0]
    k = min(max(top), lp.shape[-1])
    if k:
        ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(lp, ids, axis=-1)
        mx.eval(chosen, ids, vals)
        ids, vals = ids.tolist(), vals.tolist()
    else:
        ids = vals = [[] for _ in tokens]
    out = []
    for c, row_ids, row_vals, n in zip(chosen.tolist(), ids, vals, top):
        # A token the row can never draw (a grammar's, a ban's: -inf) is no likely
        # alternative, and -inf has no JSON form: the list holds fewer, as OpenAI's may.
        best = sorted(((t, v) for t, v in zip(row_ids, row_vals) if v > -math.inf),
                      key=lambda p: (-p[1], p[0]))[:n]
        out.append((min(c, 0.0), tuple((t, min(v, 0.0)) for t, v in best)))  # float error, never above 0
    return out
