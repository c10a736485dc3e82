"""How exact a comparison can be on the backend the tests run on.

With MLX's bundled BLAS on the CPU backend a row's arithmetic does not depend on the rows
beside it: batched greedy decoding is identical to one-at-a-time decoding, token for token,
and the tests say so exactly. OpenBLAS, which the engine loads on Linux for speed, computes
a one-row product (a decode step alone) in another summation order than a many-row one:
a decode row's logits move by up to ~5e-6 between batch 1 and larger batches (measured on
the factory and demo models). GPU backends pick kernels and reduction orders by shape, so a
row's logits move more with the size of its batch and with the path that computed them
(measured on MLX's CUDA backend, an H200, float32: hidden states within ~3e-3, scores
within ~2e-4 relative; docs/design.md, "Backends and numerics"). Where a model has two
tokens that close, greedy decoding may take either.

So the same checks hold up to that: greedy outputs must agree token for token until a
position where the two tokens are a near-tie in the model's own logits, within
``NEAR_TIE`` (as vLLM's tests compare outputs: after the first such parting nothing more
can be compared), and on a GPU float comparisons get `tolerance()`'s wider bounds. A real
engine bug (a wrong position, a stale cache row) parts outputs at a clear winner and still
fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_tandem import _platform

from .reference import _load

#: True on the CPU backend: float comparisons keep the bounds a test gives.
EXACT = mx.default_device().type == mx.DeviceType.cpu

#: Largest logit gap between the two tokens at which greedy outputs may part (logit units):
#: on a GPU the kernel differences above move logits by about a hundredth; OpenBLAS moves
#: them by a few millionths (1e-4 leaves a margin of 20); the bundled BLAS not at all.
NEAR_TIE = 0.05 if not EXACT else (1e-4 if _platform.active_blas().startswith("openblas") else 0.0)

_GPU_RTOL = 1e-2
_GPU_ATOL = 1e-2


class NearTieParting(UserWarning):
    """Outputs parted at a near-tie: listed in pytest's summary, so a run says how many
    comparisons stopped early."""


def tolerance(rtol: float, atol: float) -> dict:
    """``rtol``/``atol`` for a float comparison: as given on the CPU backend, at least
    ``_GPU_RTOL``/``_GPU_ATOL`` on a GPU."""
    if EXACT:
        return {"rtol": rtol, "atol": atol}
    return {"rtol": max(rtol, _GPU_RTOL), "atol": max(atol, _GPU_ATOL)}


def _reference(judge):
    """(model, tokenizer) of the tests' reference model when ``judge`` is a checkpoint path;
    None when it is an open Engine."""
    return _load(str(judge)) if isinstance(judge, (str, Path)) else None


def _last_logits(judge, ids: list[int]) -> list[float]:
    """The model's next-token logits after ``ids``: ``judge`` is an open Engine (its own
    model, on its owner thread) or a text checkpoint path (the tests' reference model)."""
    def forward(model):
        return model(mx.array([ids]))[0, -1].astype(mx.float32).tolist()

    ref = _reference(judge)
    if ref is not None:
        return forward(ref[0])
    return judge.run_on_owner_thread(lambda: forward(judge.loaded.model))


def _prompt_ids(judge, prompt) -> list[int]:
    """A prompt as the engine sends it: token ids as given, text encoded without special
    tokens (``Engine.encode``)."""
    if not isinstance(prompt, str):
        return list(prompt)
    ref = _reference(judge)
    return list(ref[1].encode(prompt, add_special_tokens=False)) if ref is not None else judge.encode(prompt)


def _eos_ids(judge) -> list[int]:
    ref = _reference(judge)
    return list((ref[1] if ref is not None else judge.loaded).eos_token_ids)


def same_greedy(got: Sequence[int], want: Sequence[int], *, judge, prompt_ids: Sequence[int] | str,
                what: str = "output", scores=None) -> bool:
    """Assert two greedy outputs for ``prompt_ids`` (token ids, or a text prompt as
    ``Engine.complete`` takes it) agree (see the module docstring). A row with a logits
    processor gives ``scores(logits, context)``: what its argmax is taken over
    (``repetition_penalty_scores``).

    Returns True when they are identical, False when they part at a near-tie (then nothing
    after the parting, text or finish reason, is comparable)."""
    got, want = list(got), list(want)
    if (parted := _parting(got, want, judge, prompt_ids, what)) is None:
        return True
    i, context, logits = parted
    if scores is not None:
        logits = list(scores(logits, context))
    eos = max(_eos_ids(judge), key=lambda t: logits[t])  # a shorter output stopped at EOS there

    def at(seq):
        return seq[i] if i < len(seq) else eos

    gap = abs(logits[at(want)] - logits[at(got)])
    assert gap <= NEAR_TIE, (f"{what} diverged at token {i} ({at(got)} against {at(want)}), "
                             f"where the model prefers one by {gap:.4f}: not a near-tie")
    warnings.warn(f"{what} parted at token {i} of {len(want)}, a near-tie ({gap:.4f})", NearTieParting)
    return False


def same_draws(got: Sequence[int], want: Sequence[int], *, judge, prompt_ids: Sequence[int] | str,
               seed: int, temperature: float, what: str = "output") -> bool:
    """`same_greedy` for a row drawn with ``SamplingParams(seed=, temperature=)`` and no
    other filter. The engine's ``SeededSampler`` splits one key per draw, and mlx's
    categorical on one row of logits inverts the CDF at one uniform number: two draws can
    part only where that number lies within a logit shift's worth of probability of the
    border between the two tokens (``NEAR_TIE`` / temperature, in probability).

    Returns True when they are identical, False when they part at such a border."""
    got, want = list(got), list(want)
    if (parted := _parting(got, want, judge, prompt_ids, what)) is None:
        return True
    i, _, logits = parted
    assert i < min(len(got), len(want)), f"{what}: one draw ended at token {i}, the other did not"
    key = mx.random.key(seed)
    for _ in range(i + 1):
        key, sub = mx.random.split(key)
    u = mx.random.uniform(shape=(1,), key=sub).item()
    x = mx.array(logits, dtype=mx.float32)[None] * (1.0 / temperature)
    cdf = np.cumsum(np.array(mx.softmax(x, axis=-1))[0].astype(np.float64))
    a, b = want[i], got[i]
    # Probability between the uniform number and the other token's bin.
    gap = cdf[b - 1] - u if b > a else u - cdf[b]
    assert gap <= NEAR_TIE / temperature, (f"{what} diverged at draw {i} ({b} against {a}), "
                                           f"{gap:.4f} of probability from the border: not a near-tie")
    warnings.warn(f"{what} parted at draw {i} of {len(want)}, near a border ({gap:.4f})", NearTieParting)
    return False


def _parting(got: list[int], want: list[int], judge, prompt_ids, what: str):
    """None where two outputs are identical; else where they part, the context before it
    and the model's logits there (with no tie allowed, a parting fails here)."""
    if got == want:
        return None
    assert NEAR_TIE != 0, f"{what} diverged"
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    context = _prompt_ids(judge, prompt_ids) + want[:i]
    return i, context, _last_logits(judge, context)


def repetition_penalty_scores(penalty: float, context_size: int = 20):
    """``scores`` for a greedy row with mlx-lm's repetition penalty, whose processor sees
    the prompt and the tokens drawn so far."""
    from mlx_lm.sample_utils import make_repetition_penalty

    def scores(logits, context):
        proc = make_repetition_penalty(penalty, context_size)
        return proc(mx.array(context), mx.array(logits)[None])[0].tolist()
    return scores


def same_greedy_rows(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]], *, judge,
                     prompts: Sequence[Sequence[int] | str], what: str = "request") -> list[bool]:
    """`same_greedy` for each row of a batch; returns which rows are identical."""
    assert len(got) == len(want) == len(prompts)
    return [same_greedy(g, w, judge=judge, prompt_ids=p, what=f"{what} {i}")
            for i, (g, w, p) in enumerate(zip(got, want, prompts))]



class AnswerLog:
    """The adapters' tests compare answers as text. On the CPU backend equal text is the
    check; where a GPU's batch shapes part two answers, the tokens behind both texts are
    needed to judge the parting: this records every request an engine finishes (each
    stream handle's output, the moment its last delta arrives) while it is installed."""

    def __init__(self, monkeypatch):
        from mlx_tandem import streams

        self.outputs: list = []
        accept = streams._StreamBase._accept
        log = self

        def recording(handle, item):
            delta = accept(handle, item)
            if delta.finish_reason is not None:
                log.outputs.append(handle._output())
            return delta

        monkeypatch.setattr(streams._StreamBase, "_accept", recording)

    def same_answers(self, got: Sequence[str], want: Sequence[str], *, judge, what: str = "answer") -> list[bool]:
        """Assert answers given as text agree as `same_greedy` judges their tokens: equal
        text, or a parting at a near-tie of the recorded requests behind them (same
        prompt). ``judge``: the open Engine that answered. Returns which are identical."""
        assert len(got) == len(want)
        same = []
        for i, (g, w) in enumerate(zip(got, want)):
            if g == w or NEAR_TIE == 0:
                assert g == w, f"{what} {i} diverged: {g!r} against {w!r}"
                same.append(True)
                continue
            pair = next(((a, b) for a in self.outputs if a.content.strip() == g.strip() for b in self.outputs
                         if b.content.strip() == w.strip() and list(b.prompt_token_ids) == list(a.prompt_token_ids)),
                        None)
            assert pair is not None, f"{what} {i} diverged and no recorded requests gave these answers"
            same.append(same_greedy(pair[0].token_ids, pair[1].token_ids, judge=judge,
                                    prompt_ids=list(pair[1].prompt_token_ids), what=f"{what} {i}"))
        return same


def same_distribution(plain: Sequence[tuple], spec: Sequence[tuple], widths: Sequence[int] = (2, 3)) -> None:
    """Assert two sets of sampled prefixes come from one distribution: a chi-square test of
    homogeneity on their first ``width`` tokens (cells with fewer than 10 samples dropped),
    rejecting only at p < 0.001. Seeds are fixed, so the verdict is deterministic."""
    from scipy.stats import chi2_contingency

    for width in widths:
        keys = sorted({s[:width] for s in [*plain, *spec]})
        table = np.array([[sum(s[:width] == k for s in plain) for k in keys],
                          [sum(s[:width] == k for s in spec) for k in keys]])
        table = table[:, table.sum(axis=0) >= 10]  # chi-square needs populated cells
        assert chi2_contingency(table)[1] > 1e-3, (width, table)
