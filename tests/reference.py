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


def reference_greedy(path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens one request at a time; stops after EOS (EOS not included)."""
    model, tokenizer = _load(str(path))
    eos = set(tokenizer.eos_token_ids)
    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        token = int(token)
        if token in eos:
            break
        out.append(token)
    return out
