"""scripts/copy_drills.py: the demo model's warm-up batches are spans written twice, and only
the second copies are scored."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


cd = _load("copy_drills")


def _spans(row_tokens: torch.Tensor, row_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each scored run in a row."""
    runs, start = [], None
    for i, m in enumerate(row_mask.tolist() + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def test_every_scored_token_repeats_the_span_before_it():
    tokens, mask = cd.repeat_batch(torch.Generator().manual_seed(0), 8, 128, 10, 500, span=(8, 24))
    assert tokens.shape == mask.shape == (8, 128)
    assert tokens.min() >= 10 and tokens.max() < 500
    for row in range(8):
        runs = _spans(tokens[row], mask[row])
        assert runs and runs[0][0] >= 8
        end = 0
        for start, n in runs:
            # A scored run copies the unscored run right before it (a truncated last repeat too).
            span = n if start + n < 128 else None
            if span is not None:
                assert 8 <= span <= 24
                assert torch.equal(tokens[row, start - span: start], tokens[row, start: start + n])
                assert mask[row, start - span: start].sum() == 0
            else:  # the row ended inside the repeat: its span is the unscored run before it
                before = start - 1
                while before >= 0 and mask[row, before] == 0:
                    before -= 1
                span = start - before - 1
                assert torch.equal(tokens[row, start - span: start - span + n], tokens[row, start:])
            assert start - span == end  # back to back: no filler between the pieces
            end = start + n
        assert 128 - end <= 24  # at most a cut first copy after the last repeat


def test_about_half_the_tokens_are_scored_and_batches_follow_the_seed():
    a = cd.repeat_batch(torch.Generator().manual_seed(3), 4, 256, 0, 2000)
    b = cd.repeat_batch(torch.Generator().manual_seed(3), 4, 256, 0, 2000)
    c = cd.repeat_batch(torch.Generator().manual_seed(4), 4, 256, 0, 2000)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert 0.4 < a[1].mean().item() <= 0.5


MARKS = (2000, 2001, 2002, 2003)


def _lookup_rows(seed: int, batch: int = 64):
    tokens, mask, starts = cd.lookup_batch(torch.Generator().manual_seed(seed), batch, 48, 0, 2000, MARKS)
    e, q, a, end = MARKS
    for row in range(batch):
        ids = tokens[row].tolist()
        s = int(starts[row])
        scored = [i for i, m in enumerate(mask[row].tolist()) if m]
        answer = ids[s: scored[-1] + 1]
        assert scored == list(range(s, s + len(answer))) and answer[-1] == end  # the answer and END only
        head, query = ids[: ids.index(q)], ids[ids.index(q) + 1: s - 2]
        assert ids[s - 2: s] == [a, e]  # the call opens with the entry mark, as a tool call with {"name": "
        entries, cur = [], None
        for t in head:
            if t == e:
                cur = []
                entries.append(cur)
            else:
                cur.append(t)
        yield entries, query, answer[:-1]


def _quotes(query: list[int], entry: list[int]) -> int:
    """The longest run of the entry's tokens that the query contains."""
    return max((j - i for i in range(len(entry)) for j in range(i + 1, len(entry) + 1)
                if any(query[k: k + j - i] == entry[i:j] for k in range(len(query)))), default=0)


def test_the_lookup_answer_is_the_listed_entry_the_query_quotes_most_of():
    decoys = 0
    for entries, query, answer in _lookup_rows(0, 256):
        assert 2 <= len(entries) <= 5 and all(2 <= len(x) <= 4 for x in entries)
        assert answer in entries and all(0 <= t < 2000 for x in entries for t in x)
        best = _quotes(query, answer)
        assert best >= 1
        others = [_quotes(query, x) for x in entries if x != answer]
        # No other entry is quoted as much, so the answer is never a guess.
        assert all(o < best for o in others if o), (entries, query, answer)
        decoys += any(set(x) & set(answer) for x in entries if x != answer)
    assert 0.3 < decoys / 256 < 0.7  # about half the rows have a decoy sharing a token


def test_lookup_batches_follow_the_seed():
    a = cd.lookup_batch(torch.Generator().manual_seed(1), 8, 48, 0, 2000, MARKS)
    b = cd.lookup_batch(torch.Generator().manual_seed(1), 8, 48, 0, 2000, MARKS)
    c = cd.lookup_batch(torch.Generator().manual_seed(2), 8, 48, 0, 2000, MARKS)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
