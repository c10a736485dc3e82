"""Drill batches for the demo model: random token sequences that teach copying and lookup.

A tool call is mostly copying (the tool's name from the list, the values from the request),
and the mechanism for it is an induction head: attend to the token after the previous
occurrence of the current one. Trained on dialogues alone, the demo architecture formed none
in 900 steps (run 10, docs/demo_model.md): dialogues carry a few copied tokens each. On
sequences that are nothing but copying it forms one in about 250 steps (measured with
transformers' init and a peak lr of 1e-3; not at 1.5e-3 or above). So training starts with
``--copy-warmup-steps`` of these, the loss on the repeats only.

Copying a name is not choosing it: runs 3-12 picked among held-out tools at chance, since they
learned about 30 tool concepts by heart. ``lookup_batch`` is the choice stripped to random
ids (``--lookup-steps``, ``--drill-every``): the entry to write out is the one the query quotes,
and no entry is ever seen twice, so matching is the only way to it.
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


def lookup_batch(generator: torch.Generator, batch: int, length: int, low: int, high: int,
                 marks: tuple[int, int, int, int], entries: tuple[int, int] = (2, 5),
                 entry_len: tuple[int, int] = (2, 4)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, loss mask, answer start) of shape (batch, length): tool selection stripped to its
    mechanism, on random token ids in [low, high), so no entry can be remembered.

    A row is ``E e1 E e2 ... Q query A E answer END``, as a tool list is ``{"name": "n1 ...
    {"name": "n2`` and the call ``<tool_call> {"name": "answer``: 2-5 entries of 2-4 tokens,
    each after the mark ``E``; a query of unlisted filler tokens around a run of one entry's
    tokens (any part of it, as "vowels" is part of ``count_vowels``); then ``A E``, that whole
    entry and ``END`` (the mask: the answer and END). Half of the rows have a decoy entry that shares one
    token with the target: one of the run's when the run is longer than one (so the entry with
    the whole run in it is the answer), else one outside it. ``marks`` are the ids of E, Q, A
    and END, outside [low, high)."""
    mark_e, mark_q, mark_a, mark_end = marks
    tokens = torch.zeros(batch, length, dtype=torch.int64)  # padding: the mask is 0 there
    mask = torch.zeros(batch, length)
    starts = torch.zeros(batch, dtype=torch.int64)

    def randint(a: int, b: int) -> int:  # inclusive, from the caller's generator
        return int(torch.randint(a, b + 1, (1,), generator=generator))

    for row in range(batch):
        k = randint(*entries)
        listed = [torch.randint(low, high, (randint(*entry_len),), generator=generator).tolist() for _ in range(k)]
        target = listed[randint(0, k - 1)]
        a = randint(0, len(target) - 1)
        b = randint(a + 1, len(target))
        shared = target[a:b] if b - a > 1 else [t for i, t in enumerate(target) if i != a]
        if k > 1 and randint(0, 1):
            decoy = next(e for e in listed if e is not target)
            decoy[randint(0, len(decoy) - 1)] = shared[randint(0, len(shared) - 1)]
        taken = {t for e in listed for t in e}

        def fill() -> list[int]:  # 0-3 filler tokens, none of them listed: the quoted run is the only match
            out = []
            for _ in range(randint(0, 3)):
                t = randint(low, high - 1)
                while t in taken:
                    t = randint(low, high - 1)
                out.append(t)
            return out

        seq = [t for e in listed for t in [mark_e, *e]] + [mark_q, *fill(), *target[a:b], *fill(), mark_a, mark_e]
        row_tokens = (seq + [*target, mark_end])[:length]
        tokens[row, : len(row_tokens)] = torch.tensor(row_tokens)
        mask[row, len(seq): len(row_tokens)] = 1
        starts[row] = len(seq)
    return tokens, mask, starts
