"""The text lane: continuous batching of text-only requests over mlx-lm's BatchGenerator.

mlx-lm's generator already batches hybrid caches (KVCache + ArraysCache), interleaves
chunked prefill with decode, pipelines the next step with async_eval and takes per-row
samplers and logits processors. This lane maps engine requests onto its uids, and turns
its responses into TokenEvents. Owner thread only.
"""

from __future__ import annotations

import logging
from typing import Sequence

from mlx_lm.generate import BatchGenerator

from ..request import Request
from ..samplers import make_request_processors, make_request_sampler
from .base import LaneStepStats, TokenEvent

logger = logging.getLogger(__name__)


class TextLane:
    name = "text"

    def __init__(
        self,
        model,
        *,
        eos_token_ids: Sequence[int],
        max_batch_size: int,
        prefill_batch_size: int,
        prefill_step_size: int,
    ):
        self.model = model
        self._eos = [[int(t)] for t in eos_token_ids]
        self._opts = dict(
            completion_batch_size=max_batch_size,
            prefill_batch_size=min(prefill_batch_size, max_batch_size),
            prefill_step_size=prefill_step_size,
        )
        self._gen = self._new_generator()
        self._uid_to_rid: dict[int, str] = {}
        self._rid_to_uid: dict[str, int] = {}
        self._errors: list[tuple[str, BaseException]] = []

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(self.model, stop_tokens=self._eos, **self._opts)

    @property
    def num_active(self) -> int:
        return len(self._rid_to_uid)

    def has_work(self) -> bool:
        return bool(self._rid_to_uid)

    def add(self, request: Request) -> None:
        rid = request.request_id
        sampler = make_request_sampler(request.params)
        processors = make_request_processors(
            request.params, on_error=lambda exc, rid=rid: self._errors.append((rid, exc)),
            extra=request.processors,
        )
        (uid,) = self._gen.insert(
            [request.prompt_ids],
            max_tokens=[request.max_tokens],
            samplers=[sampler],
            logits_processors=[processors],
        )
        self._uid_to_rid[uid] = rid
        self._rid_to_uid[rid] = uid

    def remove(self, request_ids: Sequence[str]) -> None:
        uids = [self._rid_to_uid.pop(r) for r in request_ids if r in self._rid_to_uid]
        for uid in uids:
            del self._uid_to_rid[uid]
        if uids:
            self._gen.remove(uids)

    def step(self) -> tuple[list[TokenEvent], LaneStepStats]:
        with self._gen.stats() as s:
            _, responses = self._gen.next()
        events = []
        for r in responses:
            rid = self._uid_to_rid.get(r.uid)
            if rid is None:  # removed while its token was in flight
                continue
            events.append(TokenEvent(rid, [r.token], r.finish_reason))
            if r.finish_reason is not None:
                del self._uid_to_rid[r.uid]
                del self._rid_to_uid[rid]
        if self._errors:
            failed = dict(self._errors)
            self._errors.clear()
            self.remove(list(failed))
            events = [e for e in events if e.request_id not in failed]
            events += [TokenEvent(rid, [], "error", exc) for rid, exc in failed.items()]
        stats = LaneStepStats(
            prompt_tokens=s.prompt_tokens,
            prompt_time=s.prompt_time,
            generation_tokens=s.generation_tokens,
            decode_time=s.decode_time,
            batch_size=len(responses),
        )
        return events, stats

    def reset(self) -> list[str]:
        """Drop every request and start from a fresh generator (after a failed step)."""
        dropped = list(self._rid_to_uid)
        self._uid_to_rid.clear()
        self._rid_to_uid.clear()
        self._errors.clear()
        self._gen.close()
        self._gen = self._new_generator()
        return dropped

    def close(self) -> None:
        self._gen.close()
