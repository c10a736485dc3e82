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
