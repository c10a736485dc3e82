"""SpecPrefill (arXiv 2502.02789): a small draft model picks the prompt chunks that matter and
the target prefills only those, at their original positions. Owner thread only.

``scoring`` rates tokens with the draft's attention, ``job`` runs one request's sparse
prefill a piece per engine step, ``positions`` keeps RoPE positions request-local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpecPrefillConfig:
    draft: Any  # the draft's mlx-lm model (same tokenizer as the target)
    threshold: int  # uncached prompt tokens from which SpecPrefill applies by default
    keep_pct: float  # share of the sparse part's chunks the target prefills
    chunk_size: int
    lookahead: int


@dataclass
class SpecPrefillStats:
    requests: int = 0
    sparse_tokens: int = 0  # prompt tokens in the sparse parts
    kept_tokens: int = 0  # of those, the ones the target prefilled
    draft_tokens: int = 0  # prompt tokens the draft prefilled (its cached prefixes are not)
    draft_time: float = 0.0
    target_time: float = 0.0

    def record(self, job) -> None:
        self.requests += 1
        self.sparse_tokens += job.sparse_tokens
        self.kept_tokens += job.kept_tokens - (job.dense_end - job.start)
        self.draft_tokens += job.draft_tokens
        self.draft_time += job.draft_time
        self.target_time += job.target_time

    def snapshot(self) -> dict:
        return {
            "requests": self.requests,
            "sparse_tokens": self.sparse_tokens,
            "kept_tokens": self.kept_tokens,
            "keep_ratio": self.kept_tokens / self.sparse_tokens if self.sparse_tokens else 0.0,
            "draft_tokens": self.draft_tokens,
            "draft_time_s": self.draft_time,
            "target_time_s": self.target_time,
        }
