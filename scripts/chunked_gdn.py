"""Chunked gated delta rule, for training Qwen3.5's GatedDeltaNet on CPU.

Why: mlx-lm 0.32's ``gated_delta_update`` has no CPU kernel; it loops over time steps in
Python (``gated_delta_ops``), which makes a training step's graph T steps deep. The chunked
(WY) form of Yang et al., "Gated Delta Networks" (arXiv 2412.06464), does the same recurrence
with C x C matmuls per chunk of C steps: the loop is T / C long and the work is in BLAS.

Training only: the engine keeps mlx-lm's implementation. ``patched_gated_delta()`` swaps the
function inside ``mlx_lm.models.qwen3_5`` for the duration of a ``with`` block (mlx-lm 0.32.x
imports ``gated_delta_update`` into that module's namespace; the patch replaces that name).

Recurrence per head (S is Dv x Dk): with g_t the decay and beta_t the write strength,
    S'_t = g_t S_{t-1};  u_t = beta_t (v_t - S'_t k_t);  S_t = S'_t + u_t k_t^T;  y_t = S_t q_t.
Within a chunk starting from state S0, with G_i = prod_{j<=i} g_j:
    U = (I + A)^-1 diag(beta) (V - diag(G) K S0^T),   A_ij = beta_i (G_i / G_j) k_i.k_j  (j < i)
    Y = diag(G) Q S0^T + (M o Q K^T) U,                M_ij = G_i / G_j  (j <= i)
    S_C = G_C S0 + U^T diag(G_C / G) K
"""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A (nilpotent): sum of (-A)^k by doubling."""
    c = a.shape[-1]
    eye = mx.eye(c, dtype=a.dtype)
    n = -a
    r = eye + n
    p = n
    for _ in range(max(0, math.ceil(math.log2(c)) - 1)):
        p = p @ p
        r = r + r @ p
    return r


def chunked_gated_delta(q, k, v, g, beta, state=None, chunk: int = 32):
    """Same contract as mlx-lm's ``gated_delta_ops`` (scalar gating, no mask).

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dv, Dk].
    Returns y [B, T, Hv, Dv] and the final state.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if g.ndim != 3:
        raise ValueError("chunked_gated_delta supports scalar gating only")
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    pad = (-T) % chunk
    if pad:
        # Padded steps write nothing (k = 0, beta = 0) and do not decay (g = 1).
        zpad = lambda x: mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q, k, v, beta = zpad(q), zpad(k), zpad(v), zpad(beta)
        g = mx.pad(g, [(0, 0), (0, pad), (0, 0)], constant_values=1.0)
    n = (T + pad) // chunk
    # [B, H, n, C, D]
    to_chunks = lambda x: x.reshape(B, n, chunk, Hv, -1).transpose(0, 3, 1, 2, 4)  # noqa: E731
    qc, kc, vc = to_chunks(q.astype(mx.float32)), to_chunks(k.astype(mx.float32)), to_chunks(v.astype(mx.float32))
    lg = mx.log(mx.maximum(g.astype(mx.float32), 1e-30)).reshape(B, n, chunk, Hv).transpose(0, 3, 1, 2)
    bc = beta.astype(mx.float32).reshape(B, n, chunk, Hv).transpose(0, 3, 1, 2)
    cum = mx.cumsum(lg, axis=-1)  # log G_i within each chunk: [B, H, n, C]
    incl = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    strict = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), k=-1)
    diff = cum[..., :, None] - cum[..., None, :]
    decay_incl = mx.where(incl, mx.exp(mx.where(incl, diff, 0.0)), 0.0)
    decay_strict = mx.where(strict, decay_incl, 0.0)
    # Everything that does not depend on the running state, for all chunks at once.
    a = bc[..., :, None] * decay_strict * (kc @ kc.swapaxes(-1, -2))
    inv = _unit_lower_inverse(a)
    qk = decay_incl * (qc @ kc.swapaxes(-1, -2))
    gi = mx.exp(cum)[..., None]  # G_i
    tail = mx.exp(cum[..., -1:] - cum)[..., None]  # G_C / G_j
    g_last = mx.exp(cum[..., -1])[..., None, None]
    ys = []
    s = state.astype(mx.float32)
    for c in range(n):
        st = s.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        rhs = bc[:, :, c, :, None] * (vc[:, :, c] - gi[:, :, c] * (kc[:, :, c] @ st))
        u = inv[:, :, c] @ rhs
        ys.append(gi[:, :, c] * (qc[:, :, c] @ st) + qk[:, :, c] @ u)
        s = g_last[:, :, c] * s + (u * tail[:, :, c]).swapaxes(-1, -2) @ kc[:, :, c]
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * chunk, Dv)[:, :, :T].transpose(0, 2, 1, 3)
    return y.astype(q.dtype), s


def chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
                               lower_bound=None, allow_neg_eigval=False):
    """Drop-in for mlx-lm 0.32's ``gated_delta_update`` (training: no mask)."""
    from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

    if mask is not None:
        raise ValueError("chunked training path takes right-padded batches without a mask")
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    g = compute_g(A_log, a, dt_bias) if lower_bound is None else compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    return chunked_gated_delta(q, k, v, g, beta, state)


@contextlib.contextmanager
def patched_gated_delta():
    import mlx_lm.models.qwen3_5 as qwen3_5

    original = qwen3_5.gated_delta_update
    qwen3_5.gated_delta_update = chunked_gated_delta_update
    try:
        yield
    finally:
        qwen3_5.gated_delta_update = original
