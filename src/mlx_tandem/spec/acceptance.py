"""Drafting and acceptance that respect each row's own sampling settings.

Greedy rows draft the MTP head's argmax and accept a draft when it equals the target's
argmax, so the output is token for token what plain greedy decoding gives.

Sampled rows use standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
both distributions are the request's own (top-p, min-p, top-k, then temperature, in
mlx-lm's order), the draft d ~ q is accepted with probability min(1, p(d)/q(d)), the first
rejection resamples from normalize(max(0, p - q)), and a fully accepted block samples a
bonus token from p. The output distribution is exactly p's.

Randomness: a seeded row draws from its own key chain (``SeededSampler.next_key``), so its
output depends only on its seed; other rows use the global generator. Categorical draws use
the Gumbel-max trick, so one noise tensor per row serves all depths.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import mlx.core as mx

from ..params import SamplingParams
from ..samplers import SeededSampler, sampling_filters


_GREEDY = SamplingParams().with_defaults()


def row_logprobs(logits: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """Log-probabilities under each row's sampling settings; logits (B, ..., V).

    Greedy rows get plain log-softmax (only their argmax is used). Rows with equal settings
    are transformed together. In float32 whatever the model's dtype: the acceptance ratio
    and the residual computed in bf16 moved the distribution MTP samples from by up to 0.7%
    (total variation, temperature 1) away from the one plain decoding samples from.
    """
    params = [p.with_defaults() for p in params]  # unset fields: the built-ins, for direct callers
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        if not p.greedy:
            groups[(p.temperature, p.top_p, p.min_p, p.top_k)].append(i)
    out = logprobs
    for idx_list in groups.values():
        p = params[idx_list[0]]
        idx = mx.array(idx_list)
        x = logprobs[idx]
        for f in sampling_filters(p):
            x = f(x)
        x = x * (1.0 / p.temperature)
        out[idx] = x - mx.logsumexp(x, axis=-1, keepdims=True)
    return out


def step_noise(params: Sequence[SamplingParams], samplers: Sequence, k: int, vocab: int):
    """Uniforms (B, k) for acceptance and Gumbel noise (B, k+1, V) for the k draft draws and
    the final draw. Greedy rows get zeros; seeded rows draw from their own key chain; the
    rest share one batched draw from the global generator."""
    B = len(params)
    uniform = mx.zeros((B, k))
    gumbel = mx.zeros((B, k + 1, vocab))
    shared = [i for i, (p, s) in enumerate(zip(params, samplers))
              if not p.greedy and not isinstance(s, SeededSampler)]
    if shared:
        idx = mx.array(shared)
        uniform[idx] = mx.random.uniform(shape=(len(shared), k))
        gumbel[idx] = mx.random.gumbel(shape=(len(shared), k + 1, vocab))
    for i, (p, s) in enumerate(zip(params, samplers)):
        if not p.greedy and isinstance(s, SeededSampler):
            ku, kg = mx.random.split(s.next_key())
            uniform[i] = mx.random.uniform(shape=(k,), key=ku)
            gumbel[i] = mx.random.gumbel(shape=(k + 1, vocab), key=kg)
    return uniform, gumbel


class Drafter:
    """Chooses draft tokens depth by depth and keeps what acceptance needs."""

    def __init__(self, params: Sequence[SamplingParams], samplers: Sequence, drafting: Sequence[bool],
                 k: int, vocab: int):
        # Rows that do not draft sample their next token through their own sampler (the
        # caller does that); here they count as greedy so they draw no noise from their chain.
        params = [p.with_defaults() if d else _GREEDY for p, d in zip(params, drafting)]
        self.params = params
        self.drafting = mx.array(list(drafting))
        self.k = k
        self.greedy = mx.array([p.greedy for p in params])
        self.any_sampled = not all(p.greedy for p in params)
        if self.any_sampled:
            self.uniform, self.gumbel = step_noise(params, samplers, k, vocab)
        self.draft_logprobs: list[mx.array] = []

    def choose(self, depth: int, logits: mx.array) -> mx.array:
        """The depth-th draft token per row from MTP logits (B, V)."""
        greedy_pick = mx.argmax(logits, axis=-1)
        if not self.any_sampled:
            return greedy_pick
        lp = row_logprobs(logits, self.params)
        self.draft_logprobs.append(lp)
        sampled = mx.argmax(lp + self.gumbel[:, depth], axis=-1)
        return mx.where(self.greedy, greedy_pick, sampled)

    def accept(self, target_logits: mx.array, drafts: mx.array):
        """(accepted count per row, next token per row) from verify logits (B, k+1, V).

        Rows that do not draft accept nothing; their "next token" here is the argmax at
        position 0, which the caller replaces with a draw from the row's own sampler.
        """
        drafting = self.drafting
        B, T, V = target_logits.shape
        k = T - 1
        target_pick = mx.argmax(target_logits, axis=-1)  # (B, k+1)
        ok = target_pick[:, :k] == drafts
        if self.any_sampled:
            p = mx.exp(row_logprobs(target_logits, self.params))  # (B, k+1, V)
            q = mx.exp(mx.stack(self.draft_logprobs, axis=1))  # (B, k, V)
            d = drafts[..., None]
            p_d = mx.take_along_axis(p[:, :k], d, axis=-1)[..., 0]
            q_d = mx.take_along_axis(q, d, axis=-1)[..., 0]
            # Strictly less: u is drawn from [0, 1), and u = 0 with "<=" accepted a draft the
            # target gives probability 0 (outside its top-k, or refused by its grammar).
            ok_sampled = self.uniform * q_d < p_d
            ok = mx.where(self.greedy[:, None], ok, ok_sampled)
        ok = ok & drafting[:, None]
        accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)  # (B,)
        greedy_next = mx.take_along_axis(target_pick, accepted[:, None], axis=1)[:, 0]
        if not self.any_sampled:
            return accepted, greedy_next
        j = accepted[:, None, None]
        p_j = mx.take_along_axis(p, j, axis=1)[:, 0]  # (B, V)
        q_next = mx.take_along_axis(q, mx.minimum(j, k - 1), axis=1)[:, 0]
        rejected = (accepted < k) & drafting
        residual = mx.where(rejected[:, None], mx.maximum(p_j - q_next, 0.0), p_j)
        # A rejection implies p < q somewhere, so the residual has mass; guard rounding anyway.
        residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_j)
        noise = mx.take_along_axis(self.gumbel, mx.full((B, 1, 1), k, dtype=mx.int32), axis=1)[:, 0]
        sampled_next = mx.argmax(mx.log(residual) + noise, axis=-1)
        return accepted, mx.where(self.greedy, greedy_next, sampled_next)
