"""SparsePrefill: one request's SpecPrefill, advanced a bounded piece per engine step.

Owner thread only. The request is not in the continuous batch yet: the draft scores its
prompt, then the target prefills the kept tokens into the request's own one-row cache, each
contiguous run at its original RoPE positions. Other requests keep decoding between pieces,
and nothing they share (model, RoPE modules, batch caches) is changed. When done, the row's
cache carries the gap between stored entries and positions (``PositionedKVCache``) and the
request joins the batch with only its last prompt token left to feed.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .positions import as_batch_of_one, from_batch_of_one, positioned, set_position
from .scoring import DraftScorer, select_chunks

logger = logging.getLogger(__name__)


class SparsePrefill:
    """Prefill ``prompt[:-1]`` sparsely: ``[start, dense_end)`` densely (it is already cached
    or worth caching exactly, e.g. a system prompt), then the top ``keep_pct`` chunks of the
    rest as scored by ``draft``. ``start`` tokens are already in ``cache``."""

    def __init__(self, model, draft, prompt: Sequence[int], cache: Optional[list[Any]], *,
                 start: int, dense_end: int, keep_pct: float, chunk_size: int,
                 lookahead: int, step_size: int, draft_cache=None, dense_kind: str = "system"):
        self.model = model
        self.dense_kind = dense_kind  # the prefix cache kind of the dense part's snapshot
        self.prompt = list(prompt)
        self.start = start
        self.dense_end = max(start, min(dense_end, len(self.prompt) - 1))
        self.keep_pct = keep_pct
        self.chunk_size = chunk_size
        self.step_size = step_size
        self.cache = as_batch_of_one(positioned(cache if cache is not None else make_prompt_cache(model)))
        # keep_pct 1.0 keeps everything: the draft's scores would not change anything.
        self.scorer = None
        self.draft_cache = draft_cache  # the draft's own PrefixCache: its state for the dense part
        if keep_pct < 1.0 and self.dense_end < len(self.prompt) - 1:
            restored, n = draft_cache.fetch(self.prompt) if draft_cache is not None else (None, 0)
            self.scorer = DraftScorer(draft, self.prompt, lookahead=lookahead, step_size=step_size,
                                      cache=restored, start=n,
                                      snapshot_at=self.dense_end if self.dense_end > n else None)
        self.runs: Optional[list[tuple[int, int]]] = None if self.scorer else self._plan(None)
        self._run = 0
        self._pos = self.runs[0][0] if self.runs else self.dense_end
        self.at_dense_end = False  # the dense part just finished (the lane may snapshot it)
        self.draft_time = 0.0
        self.draft_tokens = 0  # prompt tokens the draft prefilled (a cached prefix is not)
        self.target_time = 0.0
        self.kept_tokens = sum(e - s for s, e in self.runs) if self.runs is not None else 0

    @property
    def dense_pending(self) -> bool:
        """Scored, with its dense part (exact, so worth storing) still being prefilled: what is
        left of it comes in the next steps."""
        return self.runs is not None and self.start < self.dense_end and self._pos < self.dense_end

    @property
    def sparse_tokens(self) -> int:
        """Prompt tokens the sparse part covers (the denominator of the keep ratio)."""
        return len(self.prompt) - 1 - self.dense_end

    def _plan(self, scores) -> list[tuple[int, int]]:
        runs = [(self.start, self.dense_end)] if self.dense_end > self.start else []
        end = len(self.prompt) - 1
        for s, e in select_chunks(scores, start=self.dense_end, end=end, keep_pct=self.keep_pct,
                                  chunk_size=self.chunk_size) if self.dense_end < end else []:
            if runs and runs[-1][1] == s:
                runs[-1] = (runs[-1][0], e)
            else:
                runs.append((s, e))
        return runs

    @property
    def done(self) -> bool:
        return self.runs is not None and self._run >= len(self.runs)

    def advance(self) -> int:
        """One bounded piece of work; returns the target prompt tokens it prefilled."""
        self.at_dense_end = False
        if self.runs is None:
            tic = time.perf_counter()
            done = self.scorer.advance()
            if self.scorer.snapshot is not None and self.draft_cache is not None:
                self.draft_cache.store(self.prompt[: self.dense_end], self.scorer.snapshot, self.dense_kind)
            self.draft_tokens = self.scorer.prefilled_tokens
            if done:
                self.runs = self._plan(self.scorer.scores)
                self.kept_tokens = sum(e - s for s, e in self.runs)
                self._pos = self.runs[0][0] if self.runs else self.dense_end
                self.scorer = None
            self.draft_time += time.perf_counter() - tic
            return 0
        tic = time.perf_counter()
        budget = self.step_size
        fed = 0
        while budget > 0 and not self.done:
            s, e = self.runs[self._run]
            stop = min(e, self._pos + budget)
            if self._pos < self.dense_end:
                stop = min(stop, self.dense_end)  # pause at the dense end: it may be snapshotted
            set_position(self.cache, self._pos)
            self.model(mx.array(self.prompt[self._pos:stop])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            fed += stop - self._pos
            budget -= stop - self._pos
            self._pos = stop
            if stop == e:
                self._run += 1
                if not self.done:
                    self._pos = self.runs[self._run][0]
            if stop == self.dense_end and self.dense_end > self.start:
                self.at_dense_end = True
                break
        self.target_time += time.perf_counter() - tic
        return fed

    def dense_snapshot(self) -> list[Any]:
        """The exact cache after ``prompt[:dense_end]`` (valid right after ``at_dense_end``)."""
        return [c.extract(0) for c in self.cache]

    def row_cache(self) -> list[Any]:
        """The request's cache, its next token (the last prompt token) at its true position."""
        return from_batch_of_one(self.cache, len(self.prompt) - 1)
