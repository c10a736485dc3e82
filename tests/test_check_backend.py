"""scripts/check_backend.py, the GPU-against-CPU diagnostic: its reference arithmetic and its
router-flip count are right, so a GPU run of it can be believed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_backend.py"


def _load():
    if "check_backend" not in sys.modules:
        spec = importlib.util.spec_from_file_location("check_backend", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["check_backend"] = module
        spec.loader.exec_module(module)
    return sys.modules["check_backend"]


def test_router_flips_counts_changed_expert_sets_and_their_margins():
    cb = _load()
    ref = np.array([[[3.0, 2.0, 1.9, 0.0], [5.0, 1.0, 0.5, 0.0], [1.0, 2.0, 3.0, 4.0]]])
    dev = ref.copy()
    dev[0, 0] = [3.0, 1.8, 1.95, 0.0]   # the 2nd and 3rd experts swap: a flip at margin 0.1
    dev[0, 2] = [1.0, 2.0, 4.0, 3.0]    # the same two experts in another order: no flip
    out = cb.router_flips([dev], [ref], top_k=2)
    assert out["routed_tokens"] == 3 and out["flips"] == 1
    assert abs(out["min_margin_at_flip"] - 0.1) < 1e-12 and out["max_margin_at_flip"] == out["min_margin_at_flip"]
    assert cb.router_flips([ref], [ref], top_k=2) == {"routed_tokens": 3, "flips": 0, "min_margin_at_flip": None,
                                                       "max_margin_at_flip": None}


def test_gather_mm_check_matches_a_dense_per_expert_product_on_both_paths():
    """The sorted (grouped) and unsorted paths against numpy's dense products: on the CPU
    they agree to float32 rounding, so on a GPU a large ``rel_vs_dense`` is the kernel's."""
    cb = _load()
    rows = cb.check_gather_mm(token_counts=(8, 40))
    assert {(r["tokens"], r["sorted"], r["view"]) for r in rows} == {
        (8, False, "expand_dims"), (8, False, "contiguous"), (40, True, "expand_dims"), (40, True, "contiguous")}
    for r in rows:
        assert r["rel_vs_dense"] < 1e-5, r
        assert r["rel_vs_cpu"] == 0.0, r   # the CPU against itself


def test_gather_mm_gradient_check_matches_numpy_on_both_paths():
    cb = _load()
    rows = cb.check_gather_mm_grad()
    assert {r["sorted"] for r in rows} == {False, True}
    for r in rows:
        assert r["rel_vs_dense"] < 1e-5, r
        assert r["rel_vs_cpu"] == 0.0, r
