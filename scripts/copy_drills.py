"""Warm-up batches for the demo model: random token sequences, each followed by itself.

A tool call is mostly copying (the tool's name from the list, the values from the request),
and the mechanism for it is an induction head: attend to the token after the previous
occurrence of the current one. Trained on dialogues alone, the demo architecture formed none
in 900 steps (run 10, docs/demo_model.md): dialogues carry a few copied tokens each. On
sequences that are nothing but copying it forms one in about 250 steps (measured with
transformers' init and a peak lr of 1e-3; not at 1.5e-3 or above). So training starts with
``--copy-warmup-steps`` of these, the loss on the repeats only.
"""

from __future__ import annotations

import torch


def repeat_batch(generator: torch.Generator, batch: int, length: int, low: int, high: int,
                 span: tuple[int, int] = (8, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, loss mask) of shape (batch, length): back-to-back random spans of token ids in
    [low, high), each written twice; the mask is 1 on the second copy (its first token too:
    a repeat starts right after its span)."""
    tokens = torch.empty(batch, length, dtype=torch.int64)
    mask = torch.zeros(batch, length)
    for row in range(batch):
        pos = 0
        while pos < length:
            n = int(torch.randint(span[0], span[1] + 1, (1,), generator=generator))
            seq = torch.randint(low, high, (n,), generator=generator)
            piece = torch.cat([seq, seq])[: length - pos]
            tokens[row, pos: pos + len(piece)] = piece
            mask[row, pos + n: pos + len(piece)] = 1
            pos += len(piece)
    return tokens, mask
