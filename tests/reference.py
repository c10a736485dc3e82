"""Reference decoding without the engine: mlx-lm's single-request generate_step.

Runs on the calling (test) thread with its own copy of the model, never sharing arrays
with an engine.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load


@lru_cache(maxsize=4)
def _load(path: str):
    model, tokenizer, config = load(path, return_config=True)
    model.set_dtype(mx.float32)
    return model, tokenizer


def reference_steps(path, prompt_ids: list[int], max_tokens: int, processors=None) -> list[tuple[int, mx.array]]:
    """(token, the log-probabilities it was drawn from) one request at a time, greedy, with
    ``processors`` (mlx-lm logits processors); stops at EOS (not included)."""
    model, tokenizer = _load(str(path))
    eos = set(tokenizer.eos_token_ids)
    out = []
    for token, logprobs in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens,
                                         logits_processors=processors):
        if int(token) in eos:
            break
        out.append((int(token), logprobs))
    return out


def reference_greedy(path, prompt_ids: list[int], max_tokens: int, processors=None) -> list[int]:
    """Greedy tokens one request at a time; stops after EOS (EOS not included)."""
    return [t for t, _ in reference_steps(path, prompt_ids, max_tokens, processors)]
