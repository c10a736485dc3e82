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
from ..samplers import SeededSampler, make_request_processors, make_request_sampler
from ..spec.batch import MTPTextModel, RowSpec, SpecBatchGenerator, SpecConfig
from .base import LaneStepStats, TokenEvent, fail_errored

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
        mtp_head=None,
        mtp_mode: str = "off",
        mtp_depth: int = 2,
    ):
        self.model = model
        # Speculation needs a head and a mode other than "off"; per-request "on" cannot
        # conjure a head, so without one every request decodes plainly.
        self.spec = (SpecConfig(head=mtp_head, depth=mtp_depth, mode=mtp_mode)
                     if mtp_head is not None and mtp_mode != "off" else None)
        self._spec_model = MTPTextModel(model, mtp_head) if self.spec is not None else None
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
        if self.spec is not None:
            self.spec.rows.clear()
            return SpecBatchGenerator(self._spec_model, self.spec, stop_tokens=self._eos, **self._opts)
        return BatchGenerator(self.model, stop_tokens=self._eos, **self._opts)

    def _row_spec(self, request: Request, sampler, processors) -> RowSpec:
        mode = request.params.mtp or self.spec.mode
        # Auto keeps a seeded sampled request on plain steps: whether a step speculates
        # depends on timing, and a seeded request's output must depend only on its seed.
        seeded_sampling = isinstance(sampler, SeededSampler)
        drafts = not processors and (mode == "on" or (mode == "auto" and not seeded_sampling))
        return RowSpec(params=request.params, sampler=sampler, drafts=drafts, forces=mode == "on")

    def mtp_stats(self) -> dict | None:
        return self.spec.stats.snapshot() if self.spec is not None else None

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
        if self.spec is not None:
            self.spec.rows[uid] = self._row_spec(request, sampler, processors)

    def remove(self, request_ids: Sequence[str]) -> None:
        uids = [self._rid_to_uid.pop(r) for r in request_ids if r in self._rid_to_uid]
        for uid in uids:
            del self._uid_to_rid[uid]
        if uids:
            self._gen.remove(uids)
            if self.spec is not None:
                self._gen.forget(uids)

    def step(self) -> tuple[list[TokenEvent], LaneStepStats]:
        with self._gen.stats() as s:
            _, responses = self._gen.next()
        # A speculative step sends several responses per row, in order: one event per row.
        by_rid: dict[str, TokenEvent] = {}
        for r in responses:
            rid = self._uid_to_rid.get(r.uid)
            if rid is None:  # removed while its token was in flight
                continue
            ev = by_rid.setdefault(rid, TokenEvent(rid, []))
            ev.tokens.append(r.token)
            if r.finish_reason is not None:
                ev.finish_reason = r.finish_reason
                del self._uid_to_rid[r.uid]
                del self._rid_to_uid[rid]
                if self.spec is not None:
                    self.spec.rows.pop(r.uid, None)
        events = list(by_rid.values())
        events = fail_errored(events, self._errors, self.remove)
        stats = LaneStepStats(
            prompt_tokens=s.prompt_tokens,
            prompt_time=s.prompt_time,
            generation_tokens=s.generation_tokens,
            decode_time=s.decode_time,
            batch_size=len({r.uid for r in responses}),
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
