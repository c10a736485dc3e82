"""The chunked gated delta rule (training) equals mlx-lm's per-step recurrence."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "chunked_gdn", Path(__file__).resolve().parents[2] / "scripts" / "chunked_gdn.py")
chunked_gdn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chunked_gdn)


def _inputs(B, T, Hk, Hv, Dk, Dv, seed):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)) * 0.3
    k = mx.random.normal((B, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)  # the model L2-normalizes k
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (32, 8), (50, 16)])
def test_chunked_equals_per_step(T, chunk):
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, g, beta, state = _inputs(2, T, 2, 4, 16, 8, seed=T)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    y, s = chunked_gdn.chunked_gated_delta(q, k, v, g, beta, state, chunk=chunk)
    np.testing.assert_allclose(np.array(y), np.array(y_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(s), np.array(s_ref), rtol=1e-4, atol=1e-4)


def test_gradients_match():
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, g, beta, state = _inputs(1, 20, 2, 2, 8, 8, seed=3)

    def loss(fn, v):
        y, s = fn(q, k, v, g, beta, state)
        return (y * y).sum() + s.sum()

    g_ref = mx.grad(lambda v: loss(gated_delta_ops, v))(v)
    g_chk = mx.grad(lambda v: loss(lambda *a: chunked_gdn.chunked_gated_delta(*a, chunk=8), v))(v)
    np.testing.assert_allclose(np.array(g_chk), np.array(g_ref), rtol=1e-3, atol=1e-3)


def test_patch_is_scoped():
    import mlx_lm.models.qwen3_5 as qwen3_5

    original = qwen3_5.gated_delta_update
    with chunked_gdn.patched_gated_delta():
        assert qwen3_5.gated_delta_update is chunked_gdn.chunked_gated_delta_update
    assert qwen3_5.gated_delta_update is original
