"""The comparison of tests/numerics.py, exercised on any backend: outputs may part only at a
near-tie of the model's own logits, and nowhere else; with no tie allowed, nowhere."""

from __future__ import annotations

import mlx.core as mx
import pytest

from . import numerics
from .reference import _load, reference_greedy

N = 12


@pytest.fixture
def gpu_rules(monkeypatch):
    monkeypatch.setattr(numerics, "EXACT", False)
    monkeypatch.setattr(numerics, "NEAR_TIE", 0.05)


@pytest.fixture(params=["path", "engine"])
def judge(request, qwen3_5_path, qwen3_5_engine):
    return qwen3_5_path if request.param == "path" else qwen3_5_engine


def _ranked(path, ids):
    """Tokens by the reference model's next-token logit, best first, with the logits."""
    model, _ = _load(str(path))
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    return mx.argsort(-logits).tolist(), logits.tolist()


def test_identical_outputs_pass_on_every_backend(qwen3_5_path, judge):
    ids = [5, 17, 300, 41, 9]
    want = reference_greedy(qwen3_5_path, ids, N)
    assert numerics.same_greedy(list(want), want, judge=judge, prompt_ids=ids)


def test_with_no_tie_allowed_any_parting_fails(qwen3_5_path, monkeypatch):
    monkeypatch.setattr(numerics, "NEAR_TIE", 0.0)  # the CPU backend with mlx's bundled BLAS
    ids = [5, 17, 300, 41, 9]
    want = reference_greedy(qwen3_5_path, ids, N)
    order, _ = _ranked(qwen3_5_path, ids + want[:3])
    got = want[:3] + [order[1]] + want[4:]
    with pytest.raises(AssertionError, match="diverged"):
        numerics.same_greedy(got, want, judge=qwen3_5_path, prompt_ids=ids)


def test_batching_moves_a_decode_rows_logits_well_within_the_near_tie(qwen3_5_path):
    """What NEAR_TIE rests on: a one-token row's logits alone against the same row in a
    batch (OpenBLAS computes one row and many in different orders; the bundled BLAS not)."""
    model, _ = _load(str(qwen3_5_path))
    worst = 0.0
    for token in (5, 17, 300, 41, 9, 777):
        alone = model(mx.array([[token]]))[0, -1]
        for rows in (2, 3, 5, 8):
            batched = model(mx.array([[token]] * rows))[:, -1]
            worst = max(worst, mx.abs(batched - alone).max().item())
    if numerics.NEAR_TIE == 0:
        assert worst == 0.0
    else:
        assert worst <= numerics.NEAR_TIE / (10 if numerics.EXACT else 1), worst


def test_a_parting_passes_only_within_the_near_tie(gpu_rules, qwen3_5_path, judge, monkeypatch):
    ids = [5, 17, 300, 41, 9]
    want = reference_greedy(qwen3_5_path, ids, N)
    order, logits = _ranked(qwen3_5_path, ids + want[:3])
    assert order[0] == want[3]
    runner_up = want[:3] + [order[1]] + [0] * (N - 4)  # the rest is not compared
    gap = logits[order[0]] - logits[order[1]]

    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 1.01 + 1e-6)
    with pytest.warns(numerics.NearTieParting, match="parted at token 3"):
        assert numerics.same_greedy(runner_up, want, judge=judge, prompt_ids=ids) is False
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 0.99)
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_greedy(runner_up, want, judge=judge, prompt_ids=ids)
    # A token far down the ranking is a clear loser: an engine bug, not kernel noise.
    monkeypatch.setattr(numerics, "NEAR_TIE", 0.05)
    far = want[:3] + [order[len(order) // 2]] + want[4:]
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_greedy(far, want, judge=judge, prompt_ids=ids)


def test_an_early_stop_is_judged_against_the_best_eos(gpu_rules, qwen3_5_path):
    ids = [5, 17, 300, 41, 9]
    want = reference_greedy(qwen3_5_path, ids, N)
    order, logits = _ranked(qwen3_5_path, ids + want[:2])
    eos = max(_load(str(qwen3_5_path))[1].eos_token_ids, key=lambda t: logits[t])
    gap = logits[want[2]] - logits[eos]
    assert gap > 0.05  # the factory model does not nearly stop here
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_greedy(want[:2], want, judge=qwen3_5_path, prompt_ids=ids)


def test_gpu_tolerances_only_widen(monkeypatch):
    assert numerics.tolerance(1e-4, 1e-6) == ({"rtol": 1e-4, "atol": 1e-6} if numerics.EXACT else
                                              {"rtol": 1e-2, "atol": 1e-2})
    monkeypatch.setattr(numerics, "EXACT", False)
    assert numerics.tolerance(0.5, 0.2) == {"rtol": 0.5, "atol": 0.2}


def test_text_prompts_are_judged_as_the_engine_encodes_them(gpu_rules, qwen3_5_path, judge, monkeypatch):
    text = "alpha beta gamma"
    ids = _load(str(qwen3_5_path))[1].encode(text, add_special_tokens=False)
    want = reference_greedy(qwen3_5_path, ids, N)
    order, logits = _ranked(qwen3_5_path, ids + want[:3])
    gap = logits[order[0]] - logits[order[1]]
    runner_up = want[:3] + [order[1]]
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 1.01 + 1e-6)
    with pytest.warns(numerics.NearTieParting):
        assert numerics.same_greedy(runner_up, want, judge=judge, prompt_ids=text) is False
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 0.99)
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_greedy(runner_up, want, judge=judge, prompt_ids=text)
