"""Per-request samplers and logits processors for mlx-lm's BatchGenerator. Owner thread only.

Greedy requests get ``None`` (the generator's shared greedy sampler), and unseeded requests
with equal settings share one sampler object, so a batch of them samples in one call.
Seeded requests get their own PRNG key chain, so their output depends only on the seed,
never on who else is in the batch.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from .constraints import keep_mask
from .params import SamplingParams

Sampler = Callable[[mx.array], mx.array]


@lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, min_p: float, top_k: int) -> Sampler:
    return make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)


def sampling_filters(p: SamplingParams):
    """mlx-lm's make_sampler filters for these settings, in its order (top-p, min-p, top-k)."""
    p = p.with_defaults()
    out = []
    if 0 < p.top_p < 1.0:
        out.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p > 0.0:
        out.append(lambda x: apply_min_p(x, p.min_p))
    if p.top_k > 0:
        out.append(lambda x: apply_top_k(x, p.top_k))
    return out


class SeededSampler:
    """A request's own PRNG key chain: each draw splits the key, so the draws depend only
    on the seed and on how many draws came before (speculative decoding draws from the
    same chain through ``next_key``)."""

    def __init__(self, p: SamplingParams):
        p = p.with_defaults()
        self._key = mx.random.key(p.seed)
        self._filters = sampling_filters(p)
        self._inv_temp = 1.0 / p.temperature

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def __call__(self, logprobs: mx.array) -> mx.array:
        sub = self.next_key()
        for f in self._filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * self._inv_temp, key=sub)


def _seeded_sampler(p: SamplingParams) -> Sampler:
    return SeededSampler(p)


class BannedSampler:
    """A sampler that never draws ``banned`` ids: constraints.TokenBan folded into sampling.

    As a logits processor, a ban puts the whole batch on mlx-lm 0.32's per-row path (a slice,
    a token-context update and a mask for every row, every step), and every chat request
    without tools carries one. Folded into the sampler, rows with equal settings and bans
    share one object (``banned_sampler``), and mlx-lm samples them in one call. Masking the
    normalized log-probabilities and normalizing again gives exactly the distribution the
    processor gives. Keeps its mask in numpy: the object is cached across engines and threads,
    and mx arrays must stay on the owner thread.
    """

    def __init__(self, base: Optional[Sampler], banned: tuple[int, ...]):
        self._base = base
        self.banned = banned
        self._keep = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        # Read once: two engines' owner threads (vocabularies of two widths) may swap the
        # mask between the check and its use (review h167).
        keep = self._keep
        if keep is None or keep.shape[-1] != logprobs.shape[-1]:
            keep = self._keep = keep_mask(self.banned, logprobs.shape[-1])
        masked = mx.where(mx.array(keep), logprobs, mx.array(-float("inf"), dtype=logprobs.dtype))
        if self._base is None:  # greedy, as mlx-lm's fallback sampler
            return mx.argmax(masked, axis=-1)
        return self._base(masked - mx.logsumexp(masked, axis=-1, keepdims=True))


@lru_cache(maxsize=256)
def banned_sampler(base: Optional[Sampler], banned: tuple[int, ...]) -> BannedSampler:
    """One BannedSampler per (shared sampler or greedy, bans), so such rows share it."""
    return BannedSampler(base, banned)


def make_request_sampler(p: SamplingParams) -> Optional[Sampler]:
    p = p.with_defaults()  # the engine fills unset fields first; this covers direct callers
    if p.greedy:
        return None
    if p.seed is not None:
        return _seeded_sampler(p)
    return _shared_sampler(p.temperature, p.top_p, p.min_p, p.top_k)


def make_request_processors(p: SamplingParams, on_error: Callable[[BaseException], None],
                            extra: Sequence = (), *, prompt_tokens: int = 0) -> list:
    """mlx-lm processors for the request, with user and engine processors guarded.

    ``prompt_tokens`` is the prompt's length: the presence and frequency penalties count the
    answer only, which follows it in the token context both lanes pass (AnswerPenalties).
    An exception in a user's processor must fail that request only: the guard records it
    (the engine fails the request after the step) and passes the logits through unchanged.
    """
    p = p.with_defaults()
    processors = []
    if p.logit_bias:  # mlx-lm's own: added to the logits before everything else
        processors += make_logits_processors(logit_bias=dict(p.logit_bias))
    if p.repetition_penalty != 1.0:
        processors += make_logits_processors(repetition_penalty=p.repetition_penalty,
                                             repetition_context_size=p.repetition_context_size)
    if p.presence_penalty or p.frequency_penalty:
        processors.append(AnswerPenalties(prompt_tokens, p.presence_penalty, p.frequency_penalty))
    for user_fn in p.logits_processors:
        processors.append(_guard(user_fn, on_error))
    # Engine processors (grammar masks, bans) go last: a constraint has the final word.
    for fn in extra:
        processors.append(_guard(fn, on_error))
    return processors


class AnswerPenalties:
    """OpenAI's presence and frequency penalties over the whole answer so far, as OpenAI and
    vLLM apply them: ``presence`` once for each token the answer holds, ``frequency`` once per
    occurrence; the prompt is not counted.

    mlx-lm 0.32's own processors read the last N tokens of the context instead, prompt
    included: at N = 20 a penalty hit the template's turn markers (``<|im_start|>``,
    ``</think>``) for the answer's first tokens and missed a loop longer than N, the one
    Qwen recommends a presence penalty against. A pure function of the context, so a
    replayed or hypothetical context gets the same penalty. ``prompt_tokens`` is where the
    answer starts in the context, which holds the whole prompt in both lanes (the vision
    lane puts back what its cache restored: lanes/vision.py).
    """

    def __init__(self, prompt_tokens: int, presence: float, frequency: float):
        self.prompt_tokens = int(prompt_tokens)
        self.presence = float(presence or 0.0)
        self.frequency = float(frequency or 0.0)

    def __call__(self, tokens, logits: mx.array) -> mx.array:
        answer = tokens[self.prompt_tokens:]
        if len(answer) == 0:
            return logits
        counts = mx.zeros((logits.shape[-1],), dtype=mx.float32).at[mx.array(answer)].add(1.0)
        penalty = self.frequency * counts + self.presence * (counts > 0)
        return logits - penalty.astype(logits.dtype)


def _guard(fn, on_error):
    failed = False

    def guarded(tokens, logits):
        nonlocal failed
        if failed:
            return logits
        try:
            out = fn(tokens, logits)
            if not isinstance(out, mx.array) or out.shape != logits.shape:
                raise TypeError(
                    f"logits processor returned {type(out).__name__} "
                    f"{getattr(out, 'shape', '')}, expected an mx.array of shape {logits.shape}"
                )
            return out
        except BaseException as exc:  # noqa: BLE001 - reported to the request, not raised
            # BaseException too: a processor's SystemExit or CancelledError must fail its
            # request, not end the engine (no signal reaches the owner thread, so no
            # KeyboardInterrupt is lost here).
            failed = True
            on_error(exc)
            return logits

    return guarded
