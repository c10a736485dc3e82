"""Verify forward and per-row rollback for speculative decoding on mlx-lm models.

A verify forward feeds each row its next token plus k drafts in one pass. Rows then accept
different numbers of drafts, so every cache must be cut back per row:

- attention KV (``BatchKVCache``): the rejected tail is trimmed; where rows keep different
  lengths the shorter rows are rolled right so their rejected entries fall into the left
  padding (mlx-lm's own right-padding ``prepare``/``finalize`` does this roll), and the
  padding every row then shares is dropped (``drop_shared_padding``);
- recurrent GatedDeltaNet state (``ArraysCache``): it cannot be "trimmed", so the verify
  forward records the state after every position and the rollback picks, per row, the
  state after its last accepted token. The conv window is re-cut from the recorded input.

The recording mirrors ``mlx_lm.models.qwen3_5.GatedDeltaNet.__call__`` (mlx-lm 0.32.2)
with one change: the recurrence runs one position at a time through mlx-lm's own
``gated_delta_update`` (its Metal kernel on GPU, its ops on CPU), so every intermediate state
exists and equals what plain one-token decoding computes. Keep it in step with upstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk


@dataclass
class RecurrentRecord:
    cache: ArraysCache
    conv_input: mx.array  # (B, K-1+T, C): old conv window followed by the new inputs
    states: mx.array  # (B, T, Hv, Dv, Dk): the state after each position


def supports_verify(text_model) -> bool:
    """True for mlx-lm models whose layers this module knows how to verify."""
    inner = getattr(text_model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return False
    return all(hasattr(l, "linear_attn") if getattr(l, "is_linear", False) else hasattr(l, "self_attn")
               for l in layers)


def _gdn_recording(gdn, x: mx.array, mask, cache: ArraysCache):
    B, S, _ = x.shape
    qkv = gdn.in_proj_qkv(x)
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b = gdn.in_proj_b(x)
    a = gdn.in_proj_a(x)
    n_keep = gdn.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, gdn.conv_dim), dtype=x.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(gdn.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim ** -0.5, eps=1e-6)
    state = cache[1]
    outs, states = [], []
    for t in range(S):
        m = mask[:, t: t + 1] if mask is not None else None
        o, state = gated_delta_update(
            q[:, t: t + 1], k[:, t: t + 1], v[:, t: t + 1], a[:, t: t + 1], b[:, t: t + 1],
            gdn.A_log, gdn.dt_bias, state, m, use_kernel=True)
        outs.append(o)
        states.append(state)
    cache[1] = state
    cache.advance(S)
    out = gdn.norm(mx.concatenate(outs, axis=1), z)
    out = gdn.out_proj(out.reshape(B, S, -1))
    return out, RecurrentRecord(cache, conv_input, mx.stack(states, axis=1))


def verify_hidden(text_model, tokens: mx.array, cache: List[Any]):
    """Final (normed) hidden states for ``tokens`` (B, T), recording recurrent states."""
    inner = text_model.model
    h = inner.embed_tokens(tokens)
    fa_mask = ssm_mask = None
    layers = inner.layers
    fa_idx = next((i for i, l in enumerate(layers) if not l.is_linear), None)
    ssm_idx = next((i for i, l in enumerate(layers) if l.is_linear), None)
    if fa_idx is not None:
        fa_mask = create_attention_mask(h, cache[fa_idx])
    if ssm_idx is not None:
        ssm_mask = create_ssm_mask(h, cache[ssm_idx])
    records = []
    for layer, c in zip(layers, cache):
        if layer.is_linear:
            r, rec = _gdn_recording(layer.linear_attn, layer.input_layernorm(h), ssm_mask, c)
            records.append(rec)
        else:
            r = layer.self_attn(layer.input_layernorm(h), fa_mask, c)
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return inner.norm(h), records


def rollback(cache: List[Any], records: List[RecurrentRecord], fed: int, keep: List[int]) -> None:
    """Keep the first ``keep[r]`` of the ``fed`` positions just written for each row r."""
    top = max(keep)
    ragged = [top - n for n in keep]
    keep_arr = mx.array(keep)
    for c in cache:
        if isinstance(c, ArraysCache):
            continue
        if fed - top:
            c.trim(fed - top)
        if any(ragged):
            if not isinstance(c, BatchKVCache):
                raise RuntimeError(f"{type(c).__name__} cannot keep different lengths per row")
            c.prepare(right_padding=ragged)
            c.finalize()
    if any(ragged):
        drop_shared_padding(cache)
    for rec in records:
        B, total, C = rec.conv_input.shape
        n_keep = total - fed
        start = keep_arr[:, None] + mx.arange(n_keep)[None]
        rec.cache[0] = mx.take_along_axis(rec.conv_input, start[..., None], axis=1)
        idx = (keep_arr - 1).reshape(B, 1, 1, 1, 1)
        rec.cache[1] = mx.take_along_axis(rec.states, idx, axis=1)[:, 0]


def drop_shared_padding(cache: List[Any]) -> None:
    """Drop the left padding every row of a batch cache shares, as mlx-lm's (0.32)
    ``BatchKVCache.filter`` does when a row leaves, and nothing else does.

    A ragged rollback pads each row by what the row that kept most kept beyond it, so while
    no row left, rows taking turns to keep most grew the padding they all share without
    bound: every row attended over it, and the buffer outgrew what memory admission
    reserves for the batch (``memory.py``: the longest row plus one growth step), 1.28x
    after 160 steps of four rows. Cutting the keys is a view; the next growth copies only
    what is left.
    """
    for c in cache:
        if not isinstance(c, BatchKVCache) or c.keys is None:
            continue
        shared = min(c.left_padding.tolist())
        if shared > 0:
            c.keys = c.keys[..., shared:, :]
            c.values = c.values[..., shared:, :]
            c._idx -= shared
            c.left_padding = c.left_padding - shared
