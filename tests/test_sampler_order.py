"""The sampling filters see the untempered distribution, and the temperature scales only
the draw: mlx-lm's make_sampler order, kept on every path that samples (the shared sampler,
a seeded request's own, and MTP's acceptance distribution). transformers and vLLM temper
first, which keeps a different set of tokens (docs/design.md, "Filter order")."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.samplers import make_request_sampler
from mlx_tandem.spec.acceptance import row_logprobs

# Untempered probabilities about 0.665, 0.245, 0.090, ...: top_p 0.8 keeps tokens 0 and 1,
# and min_p 0.3 keeps them too (0.245 / 0.665 = e**-1). Tempered first at 0.5, token 0
# alone passes either filter (0.87 of the mass; its neighbour's ratio is e**-2).
LOGITS = [3.0, 2.0, 1.0, -4.0, -5.0, -6.0]
FILTERS = [{"top_p": 0.8}, {"min_p": 0.3}]


def _logprobs(rows: int) -> mx.array:
    x = mx.array([LOGITS] * rows)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("filters", FILTERS, ids=["top_p", "min_p"])
@pytest.mark.parametrize("seed", [None, 7], ids=["shared", "seeded"])
def test_samplers_filter_before_tempering(filters, seed):
    sampler = make_request_sampler(SamplingParams(temperature=0.5, seed=seed, **filters))
    draws = np.array(sampler(_logprobs(600)))
    # Tempered last, token 1 keeps about 12% of the draws; tempered first, none.
    assert set(draws.tolist()) == {0, 1}
    assert 0.06 < float(np.mean(draws == 1)) < 0.2


@pytest.mark.parametrize("filters", FILTERS, ids=["top_p", "min_p"])
def test_acceptance_distribution_matches_the_samplers(filters):
    """MTP accepts drafts against the distribution the sampler draws from: same support,
    tempered after filtering."""
    params = SamplingParams(temperature=0.5, **filters)
    got = np.exp(np.array(row_logprobs(mx.array([LOGITS]), [params])))[0]
    p = np.exp(np.array(LOGITS[:2]) / 0.5)
    np.testing.assert_allclose(got[:2], p / p.sum(), rtol=1e-5)
    assert np.all(got[2:] == 0)
