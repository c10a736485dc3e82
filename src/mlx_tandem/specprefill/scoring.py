"""SpecPrefill token importance (arXiv 2502.02789) from a draft model's attention, and chunk selection.

Owns the draft's own KV cache and the scoring math. It must not change the draft's weights or
patch anything in mlx-lm globally: queries are captured per attention instance, during the lookahead only.

How a prompt is scored (``DraftScorer``):

1. The draft prefills the prompt, ``step_size`` tokens per ``advance()`` call (all but the last
   token; the last one goes in with the lookahead, where its logits are needed).
2. It decodes ``lookahead`` tokens greedily. For each full-attention layer it records the queries
   that layer attends with (post q_norm, post RoPE: what the layer's ``rope`` returns first each
   step; its second output must equal the keys the cache received, or scoring fails) and computes ``softmax(q @ k.T * layer.scale)`` over the layer's cached keys (GQA: each
   query head reads its kv head), causally over the lookahead, then keeps the prompt columns.
3. Importance of prompt token j = mean over layers of (max over query heads of (mean over lookahead
   steps of p[head, step, j])). The mean over steps asks "how much does the upcoming text read j";
   the max over heads keeps a token that one specialised head needs (a mean would dilute it
   among heads that ignore it); the mean over layers evens out layers whose attention is flat.
   Layers without a full per-position KV cache (linear attention, sliding windows) do not vote.
   No pooling over neighbouring tokens is done here; ``select_chunks`` averages per chunk.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..errors import InvalidRequestError, ModelLoadError

__all__ = ["DraftScorer", "select_chunks"]


class _QueryRecorder(nn.Module):
    """Stands in for one attention instance's ``rope`` and records what it returns.

    Every supported attention ropes its queries, then its keys, once per forward; the keys are
    checked against the cache afterwards, so a layer that does otherwise is caught, not misread.
    """

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope
        self._outputs: list[mx.array] = []  # "_": not a parameter of the module tree

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.rope(x, *args, **kwargs)
        self._outputs.append(out)
        return out


def _attention_layers(model: nn.Module, cache: list[Any]) -> list[int]:
    """Indices of the layers that score: those with a plain KVCache (every position at its index)."""
    layers = model.layers
    if len(layers) != len(cache):
        raise ModelLoadError(f"{type(model).__name__}: {len(cache)} cache entries for {len(layers)} layers")
    found = []
    for i, (layer, c) in enumerate(zip(layers, cache)):
        if not isinstance(c, KVCache):
            continue  # linear attention (ArraysCache) or a sliding window: no view of the whole prompt
        attn = getattr(layer, "self_attn", None)
        if attn is None or not isinstance(getattr(attn, "rope", None), nn.Module) \
                or not isinstance(getattr(attn, "scale", None), (int, float)):
            name = type(layer if attn is None else attn).__name__
            raise ModelLoadError(
                f"SpecPrefill cannot read the queries of {name} (layer {i}): it needs a "
                "`self_attn` with a `rope` module and a numeric `scale`")
        found.append(i)
    if not found:
        raise ModelLoadError(
            f"{type(model).__name__} has no full-attention layer to score prompt tokens with")
    return found


def _layer_importance(queries: mx.array, keys: mx.array, scale: float, n_prompt: int) -> mx.array:
    """Prompt-token importance from one layer: mean over steps, then max over query heads.

    ``queries`` (1, H, T, D) are the lookahead steps at positions n_prompt..n_prompt+T-1;
    ``keys`` (1, Hkv, n_prompt+T, D) are the layer's whole cache. Returns (n_prompt,) float32.
    """
    _, n_heads, n_steps, dim = queries.shape
    n_kv, n_keys = keys.shape[1], keys.shape[2]
    # Query head h reads kv head h // (H / Hkv), as in mx.fast.scaled_dot_product_attention.
    q = queries.astype(mx.float32).reshape(n_kv, n_heads // n_kv, n_steps, dim)
    k = keys[0].astype(mx.float32)[:, None]
    logits = (q * scale) @ k.swapaxes(-1, -2)  # (Hkv, G, T, n_keys)
    visible = mx.arange(n_keys)[None, :] <= (n_prompt + mx.arange(n_steps))[:, None]
    probs = mx.softmax(mx.where(visible, logits, -math.inf), axis=-1, precise=True)
    return probs[..., :n_prompt].mean(axis=2).reshape(n_heads, n_prompt).max(axis=0)


class DraftScorer:
    """Scores prompt-token importance with a small draft model's attention, in resumable chunks.

    Owner thread only: during the lookahead the draft's attention modules carry query recorders,
    so no other thread may build a forward of the same model instance meanwhile. The draft's
    cache is dropped once the scores are ready; a scorer whose ``advance()`` raised is spent.
    """

    def __init__(self, model: nn.Module, tokens: Sequence[int], *, lookahead: int = 8, step_size: int = 512,
                 cache: list[Any] | None = None, start: int = 0, snapshot_at: int | None = None):
        """``cache`` may already hold the draft's state for ``tokens[:start]`` (a prefix cache
        hit): only the rest is prefilled. Prefill pauses at ``snapshot_at`` and exposes the
        cache there as ``snapshot`` (for the caller to store) until the next ``advance()``."""
        if len(tokens) == 0:
            raise InvalidRequestError("SpecPrefill scoring needs at least one prompt token")
        if lookahead < 1:
            raise InvalidRequestError(f"lookahead must be >= 1, got {lookahead}")
        if step_size < 1:
            raise InvalidRequestError(f"step_size must be >= 1, got {step_size}")
        self.model = model
        self.tokens = [int(t) for t in tokens]
        self.lookahead = lookahead
        self.step_size = step_size
        self.cache: list[Any] | None = cache if cache is not None else make_prompt_cache(model)
        self.attention_layers = _attention_layers(model, self.cache)
        self.lookahead_tokens: list[int] = []
        self.scores: np.ndarray | None = None
        self.done = False
        self._prefilled = start
        self.prefilled_tokens = 0  # tokens this scorer fed to the draft (not restored ones)
        self.snapshot_at = snapshot_at
        self.snapshot: list[Any] | None = None

    def advance(self) -> bool:
        """Do one bounded piece of work: one draft prefill chunk of <= step_size tokens, or
        (once the prompt is in the draft's cache) the lookahead decode steps + scoring.
        Returns True once `self.scores` is ready. Calling it again after done is a no-op returning True."""
        if self.done:
            return True
        self.snapshot = None
        end = len(self.tokens) - 1
        if self._prefilled < end:
            stop = min(self._prefilled + self.step_size, end)
            if self.snapshot_at is not None and self._prefilled < self.snapshot_at < stop:
                stop = self.snapshot_at
            self.model(mx.array(self.tokens[self._prefilled:stop])[None], cache=self.cache)
            # Only the cache is evaluated: the lm_head over the chunk is never computed.
            mx.eval([c.state for c in self.cache])
            self.prefilled_tokens += stop - self._prefilled
            self._prefilled = stop
            if stop == self.snapshot_at:
                self.snapshot = self.cache
            return False
        self.scores = self._lookahead_and_score()
        self.cache = None
        self.done = True
        return True

    def _lookahead_and_score(self) -> np.ndarray:
        n_prompt = len(self.tokens)
        cache = self.cache
        self.prefilled_tokens += 1
        logits = self.model(mx.array(self.tokens[-1:])[None], cache=cache)
        attns = [self.model.layers[i].self_attn for i in self.attention_layers]
        recorders = [_QueryRecorder(attn.rope) for attn in attns]
        steps = []
        try:
            for attn, rec in zip(attns, recorders):
                attn.rope = rec
            # The greedy chain stays lazy: one evaluation at the end, no sync per step.
            for _ in range(self.lookahead):
                token = mx.argmax(logits[:, -1, :], axis=-1)
                steps.append(token)
                logits = self.model(token[:, None], cache=cache)
        finally:
            for attn, rec in zip(attns, recorders):
                if attn.rope is rec:
                    attn.rope = rec.rope

        per_layer, checks = [], []
        for i, attn, rec in zip(self.attention_layers, attns, recorders):
            calls = rec._outputs
            if len(calls) != 2 * self.lookahead:
                raise ModelLoadError(
                    f"SpecPrefill cannot read the queries of {type(attn).__name__} (layer {i}): "
                    f"its rope ran {len(calls)} times in {self.lookahead} steps, expected 2 per step")
            keys = cache[i].keys[..., : cache[i].offset, :]
            checks.append(mx.array_equal(mx.concatenate(calls[1::2], axis=2), keys[..., n_prompt:, :]))
            queries = mx.concatenate(calls[0::2], axis=2)
            per_layer.append(_layer_importance(queries, keys, attn.scale, n_prompt))
        importance = mx.mean(mx.stack(per_layer), axis=0)
        mx.eval(importance, checks, steps)
        for i, attn, ok in zip(self.attention_layers, attns, checks):
            if not ok.item():
                raise ModelLoadError(
                    f"SpecPrefill cannot read the queries of {type(attn).__name__} (layer {i}): "
                    "it does not rope its queries, then its keys, as the scorer expects")
        self.lookahead_tokens = [int(t.item()) for t in steps]
        return np.array(importance, dtype=np.float32)


def select_chunks(scores: Sequence[float] | np.ndarray, *, start: int, end: int, keep_pct: float,
                  chunk_size: int) -> list[tuple[int, int]]:
    """Positions [start, end) cut into chunks of chunk_size aligned at `end` (the first may be
    shorter): the last chunk, which is always kept, is a whole chunk of the prompt's end, where
    a chat prompt puts its question. Aligned at `start`, it was whatever remained, often only
    the template's few closing tokens (`<|im_start|>assistant\n`), and the question could go.
    A chunk's score is the mean of its tokens' scores. Keep ceil(keep_pct * n_chunks) chunks with the
    highest scores (ties broken by earlier position), ALWAYS including the first and last chunk.
    Return the kept positions as sorted, merged, non-overlapping half-open runs [(s, e), ...]
    (adjacent kept chunks merge into one run). keep_pct must be in (0, 1]; keep_pct=1.0 returns
    [(start, end)]. start >= end returns [].

    When ceil(keep_pct * n_chunks) is 1 and there are two or more chunks, both ends are still
    kept (two chunks).
    """
    if not 0.0 < keep_pct <= 1.0:
        raise InvalidRequestError(f"keep_pct must be in (0, 1], got {keep_pct}")
    if chunk_size < 1:
        raise InvalidRequestError(f"chunk_size must be >= 1, got {chunk_size}")
    if start < 0:
        raise InvalidRequestError(f"start must be >= 0, got {start}")
    if start >= end:
        return []
    if keep_pct == 1.0:
        return [(start, end)]
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1 or len(scores) < end:
        raise InvalidRequestError(f"scores of shape {scores.shape} do not cover positions [{start}, {end})")
    first = start + (end - start) % chunk_size  # where the first whole chunk starts
    starts = np.arange(first, end, chunk_size)
    if first > start:
        starts = np.concatenate(([start], starts))
    ends = np.append(starts[1:], end)
    means = np.add.reduceat(scores[start:end], starts - start) / (ends - starts)
    n = len(starts)
    # round(): 0.3 * 10 is 3.0000000000000004 in floating point, and must keep 3 chunks, not 4.
    n_keep = max(math.ceil(round(keep_pct * n, 9)), min(n, 2))
    keep = {0, n - 1}
    # A stable sort on -mean ranks equal scores by position, earlier first.
    for i in np.argsort(-means[1:-1], kind="stable") + 1:
        if len(keep) >= n_keep:
            break
        keep.add(int(i))
    runs: list[tuple[int, int]] = []
    for i in sorted(keep):
        s, e = int(starts[i]), int(ends[i])
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], e)
        else:
            runs.append((s, e))
    return runs
