"""The text lane: continuous batching of text-only requests over mlx-lm's BatchGenerator.

mlx-lm's generator already batches hybrid caches (KVCache + ArraysCache), interleaves
chunked prefill with decode, pipelines the next step with async_eval and takes per-row
samplers and logits processors. This lane maps engine requests onto its uids, and turns
its responses into TokenEvents. Owner thread only.

With a PrefixCache, a request starts from the longest cached prefix of its prompt, and the
rest of its prompt is inserted as segments that end at its cache points, so mlx-lm reports
when each boundary is reached and the row's exact state there (recurrent state included)
is snapshotted. A finished request's full cache (prompt + answer) is kept too.

Requests that arrive together with one system prompt wait for the first one's snapshot
instead of each prefilling it (``defer``, claims.py). A request waits no longer than the
claiming row takes to prefill tokens it would otherwise have prefilled itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from ..closing import GrammarProcessor
from ..constraints import TokenBan
from ..errors import EngineStepError, TandemError
from ..prefix_cache import PrefixCache
from ..request import Request
from ..samplers import BannedSampler, SeededSampler, banned_sampler, make_request_processors, make_request_sampler
from ..tool_call_grammar import LazyToolCallGrammar
from ..spec.batch import MTPTextModel, RowSpec, SpecBatchGenerator, SpecConfig
from ..specprefill import SpecPrefillConfig, SpecPrefillStats
from ..specprefill.job import SparsePrefill
from ..specprefill.positions import positioned
from .base import LaneStepStats, RowIds, TokenEvent, attach_logprobs, fail_errored
from .claims import Claim, PrefillClaims, PromptsInPrefill, shared_with_waiting, spaced
from .prefill_cut import cut_pending_prompt

logger = logging.getLogger(__name__)

#: "Shared" points one request may make: each is a snapshot (a copy of the row's state).
_MAX_SHARED_POINTS = 4


@dataclass
class _RowCaching:
    """Where a row's prompt started (tokens restored from the cache) and what to snapshot."""

    start: int
    points: list[tuple[int, str]] = field(default_factory=list)  # (prompt length, kind), ascending
    store_final: bool = True
    claimed: list[Claim] = field(default_factory=list)  # one per point, same order
    prompt_tokens: Optional[int] = None  # where its answer starts in its final entry


@dataclass
class _Sparse:
    """A request in its SpecPrefill, before it joins the generator."""

    request: Request
    job: SparsePrefill
    sampler: object
    processors: list
    claimed: Optional[Claim] = None  # the shared prefix its dense part will store (once it is prefilling it)


def split_at(tokens: list[int], cuts: Sequence[int]) -> list[list[int]]:
    """``tokens`` cut into segments ending at each of ``cuts`` (ascending, inside the list)."""
    out, prev = [], 0
    for c in cuts:
        out.append(tokens[prev:c])
        prev = c
    out.append(tokens[prev:])
    return [seg for seg in out if seg]


def _prefix_keys(request: Request) -> dict[int, tuple[int, ...]]:
    """``prompt[:p]`` of each of the request's cache points, made once: ``defer`` reads them
    on every admission pass it waits through, and the claims keep the same tuples."""
    keys = request.extra.get("prefix_keys")
    if keys is None:
        n = len(request.prompt_ids)
        keys = request.extra["prefix_keys"] = {p: tuple(request.prompt_ids[:p]) for p, _ in request.cache_points
                                               if p < n}
    return keys


def _prompt_key(request: Request) -> tuple[int, ...]:
    """The prompt as a tuple, made once: ``defer`` reads it on every admission pass it waits
    through, and requests added before it compare their prompts with it."""
    key = request.extra.get("prompt_key")
    if key is None:
        key = request.extra["prompt_key"] = tuple(request.prompt_ids)
    return key


def _banned_ids(bans) -> tuple[int, ...]:
    return tuple(sorted({t for b in bans for t in b.token_ids}))


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
        prefix_cache: Optional[PrefixCache] = None,
        specprefill: Optional[SpecPrefillConfig] = None,
        wait_for_shared_prefill: bool = True,
        shared_points: bool = True,
    ):
        self.model = model
        self.prefix_cache = prefix_cache
        self.specprefill = specprefill
        self.sp_stats = SpecPrefillStats()
        # The draft's own snapshots (its state for system prompts), so that a cached prefix
        # is not scored again: a small share of the budget, the draft is small.
        self.draft_cache = (PrefixCache(prefix_cache.budget_bytes // 8, min_tokens=prefix_cache.min_tokens)
                            if specprefill is not None and prefix_cache is not None else None)
        self._sparse: dict[str, _Sparse] = {}  # by request id, in arrival order
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
        self._rows = RowIds()
        self._errors: list[tuple[str, BaseException]] = []
        self._caching: dict[int, _RowCaching] = {}
        self._claims = PrefillClaims()
        self._wait_for_shared = wait_for_shared_prefill and prefix_cache is not None
        self._shared_points = shared_points and prefix_cache is not None
        self._in_prefill = PromptsInPrefill()  # for shared points (prompts of rows in prefill)
        self._logprobs: dict[int, tuple] = {}  # uid -> (top_logprobs, banned ids), rows that asked

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
        # A grammar (a whole-answer one, or the lazy call grammar under "auto") does not stop
        # drafting: the step walks the drafts through it (spec/walks.GrammarWalk). Nor does a
        # token ban or a logit bias, which change every position alike, nor a penalty (a pure
        # function of the token context: the step applies it at each position with the
        # context a plain step there would hold, spec/walks.PenaltyWalk). A user's processor
        # may keep state, so it needs every position's logits in turn: no drafting.
        bans = [p for p in request.processors if isinstance(p, TokenBan)]
        others = [p for p in request.processors if not isinstance(p, TokenBan)]
        # ``processors`` also holds the params' own, and the bans unless the sampler took them.
        # The params' own come first, the bias, then the penalties (make_request_processors).
        params = request.params.with_defaults()
        bias = params.logit_bias or ()
        n_bias = 1 if bias else 0
        n_pen = (params.repetition_penalty != 1.0) + bool(params.presence_penalty or params.frequency_penalty)
        penalties = tuple(processors[n_bias: n_bias + n_pen])
        n_others = len(processors) - (0 if isinstance(sampler, BannedSampler) else len(bans)) - n_bias - n_pen
        alone = others[0] if n_others == 1 and len(others) == 1 else None
        grammar = alone if isinstance(alone, (GrammarProcessor, LazyToolCallGrammar)) else None
        drafts = (n_others == 0 or grammar is not None) and (
            mode == "on" or (mode == "auto" and not seeded_sampling))
        rid = request.request_id
        return RowSpec(params=request.params, sampler=sampler, drafts=drafts, forces=mode == "on",
                       banned=_banned_ids(bans), grammar=grammar, logprobs=request.params.logprobs, bias=bias,
                       penalties=penalties,
                       on_error=lambda exc, rid=rid: self._errors.append((rid, exc)))

    def mtp_stats(self) -> dict | None:
        return self.spec.stats.snapshot() if self.spec is not None else None

    @property
    def num_active(self) -> int:
        return len(self._rows) + len(self._sparse)

    def has_work(self) -> bool:
        return bool(self._rows or self._sparse)

    def prepare(self, request: Request) -> None:  # a text prompt is known from the start
        pass

    def defer(self, request: Request) -> bool:
        """Should the request wait for a row in prefill to store a prefix of its prompt?

        Only when that prefix gives at least ``prefix_cache_min_tokens`` more than the cache
        gives now (the bar for storing one at all): the wait costs the request a step. Only
        for claims older than its first wait, or on a prefix longer than any it waited for
        (claims.py): each further wait is for a longer prefix, so the waits are as many as
        its cache points at most.
        """
        if not self._wait_for_shared:
            return False
        prompt, cached = _prompt_key(request), None
        if self._shared_points and "late_point" not in request.extra:
            cached = self.prefix_cache.cached_length(prompt)
            request.extra["late_point"] = self._late_point(request, cached)  # tried once per request
        if not self._claims:
            return False
        since = request.extra.get("prefill_wait_since", self._claims.serial)
        waited = request.extra.get("prefill_waited_for", 0)
        claimed = self._claims.longest_prefix_of(prompt, since=since, beyond=waited)
        if cached is None:
            cached = self.prefix_cache.cached_length(prompt)
        if claimed - cached < self.prefix_cache.min_tokens:
            return False
        if "prefill_wait_since" not in request.extra:
            request.extra["prefill_wait_since"] = since
            self.prefix_cache.prefill_waits += 1
        request.extra["prefill_waited_for"] = max(waited, claimed)
        return True

    def _late_point(self, request: Request, cached: int) -> bool:
        """Give a row in prefill that shares a long stretch of this request's prompt a
        "shared" point where they part, if it has not prefilled that far: it stores the
        stretch on the way and this request waits for it (``defer``), instead of prefilling
        it beside the row. The row came alone, a moment before the others (a first question
        about a document), and had no reason to cut its prompt there (prefill_cut.py)."""
        pc, prompt = self.prefix_cache, _prompt_key(request)
        shared, uids = self._in_prefill.sharing(prompt[:-1])
        if shared - cached < pc.min_tokens or pc.would_refuse(shared, "shared") \
                or pc.contains(prompt[:shared]):
            return False
        for uid in uids:
            caching = self._caching.get(uid)
            if caching is None or len(caching.claimed) != len(caching.points) or any(
                    0 <= shared - p < pc.min_tokens for p, _ in caching.points) or \
                    sum(k == "shared" for _, k in caching.points) >= _MAX_SHARED_POINTS:
                # Not a row that stores points, one of its points serves as well, or enough.
                # A point serves as well only if it lies just before ``shared``: one after it
                # does not serve this request, which parts from the row there.
                continue
            if not cut_pending_prompt(self._gen, uid, shared - caching.start):
                continue
            at = sum(p < shared for p, _ in caching.points)
            caching.points.insert(at, (shared, "shared"))
            caching.claimed.insert(at, self._claims.take(prompt[:shared]))
            return True
        return False

    def add(self, request: Request, waiting: Iterable[Request] = ()) -> None:
        rid = request.request_id
        sampler = make_request_sampler(request.params)
        extra = list(request.processors)
        bans = [p for p in extra if isinstance(p, TokenBan)]
        if bans and not isinstance(sampler, SeededSampler):  # a seeded row samples alone anyway
            sampler = banned_sampler(sampler, _banned_ids(bans))
            extra = [p for p in extra if not isinstance(p, TokenBan)]
        processors = make_request_processors(
            request.params, on_error=lambda exc, rid=rid: self._errors.append((rid, exc)), extra=extra,
            prompt_tokens=len(request.prompt_ids))
        prompt = list(request.prompt_ids)
        cache, start = None, 0
        if self.prefix_cache is not None:
            if "prefix_lookup" in request.extra:  # added again (it waited): the new lookup counts
                self.prefix_cache.uncount(request.extra["prefix_lookup"])
            cache, start = self.prefix_cache.fetch(prompt)
            request.extra["prefix_lookup"] = self.prefix_cache.last_lookup
            if self._shared_points:
                self._add_shared_point(request, start, waiting)
        request.cached_tokens = start
        try:
            job = self._sparse_prefill(request, cache, start)
        except TandemError:
            raise
        except Exception as exc:  # noqa: BLE001 - setting up SpecPrefill is the engine's part
            raise EngineStepError(f"SpecPrefill failed: {type(exc).__name__}: {exc}") from exc
        if job is not None:
            self._sparse[rid] = _Sparse(request, job, sampler, processors)
            return
        # Every row gets PositionedKVCaches, so any batch can take a sparse-prefilled row.
        points = self._snapshot_points(request, start)
        self._insert(request, split_at(prompt[start:], [p - start for p, _ in points]),
                     positioned(cache if cache is not None else make_prompt_cache(self._gen.model)),
                     prompt[:start], sampler, processors, _RowCaching(start, points, prompt_tokens=len(prompt)))

    def _add_shared_point(self, request: Request, start: int, waiting: Iterable[Request]) -> None:
        """"Shared" points where the prompt parts from a stored one (prefix_cache.py) or the
        prompt of a row still in prefill, and where it parts from those of requests queued
        behind it (requests that arrive together with one document: the first stores it,
        the others wait for it), each at least ``min_tokens`` past the cache and its
        earlier points."""
        pc, prompt = self.prefix_cache, request.prompt_ids
        # Found again when a request is added again (held for memory, prefilled plainly):
        # the queue it parted from has changed.
        request.cache_points = [(p, k) for p, k in request.cache_points if k != "shared"]
        request.extra.pop("prefix_keys", None)  # made again with these points (claims)

        def usable(shared: int) -> bool:
            # A point of its own just before it holds nearly as much (the history before the
            # question); one after it (its turn point) is not shared.
            return shared - start >= pc.min_tokens and not any(
                0 <= shared - p < pc.min_tokens for p, _ in request.cache_points)

        seen = max(pc.shared_point(prompt, start) or 0, self._in_prefill.shared_length(prompt[:-1]))
        seen = seen if usable(seen) else 0
        # Every prefix it shares with the queue (questions about two documents that begin
        # with one header: the header, and its own document), where queued requests wait
        # for it, and with what is stored or in prefill (a review: the shortest alone left a
        # document out), a few at most, that one kept.
        others = (_prompt_key(w) for w in waiting if w is not request and w.lane == self.name)
        queued = shared_with_waiting(_prompt_key(request), others, usable) if self._wait_for_shared else []
        points = spaced([*queued, *([seen] if seen else [])], pc.min_tokens)
        if len(points) > _MAX_SHARED_POINTS:
            points = sorted({*points[:_MAX_SHARED_POINTS - 1], seen}) if seen in points \
                else points[:_MAX_SHARED_POINTS]
        request.cache_points = [*request.cache_points, *((p, "shared") for p in points)]

    def _snapshot_points(self, request: Request, start: int) -> list[tuple[int, str]]:
        """The request's cache points worth a snapshot: new ones, long enough to be stored,
        and not known to be too large for the budget.

        Each point cuts the prefill into one more chunk, which changes float rounding (a
        near-tie in the logits can then flip), so the prompt is cut only where a snapshot
        will really be stored. A point left out is not claimed either, so no request waits
        for a snapshot the budget would refuse.
        """
        pc = self.prefix_cache
        if pc is None:
            return []
        n = len(request.prompt_ids)
        return sorted((p, k) for p, k in request.cache_points
                      if start < p < n and p >= pc.min_tokens and not pc.would_refuse(p, k)
                      and not pc.contains(request.prompt_ids[:p]))

    def _insert(self, request: Request, segments, cache, all_tokens, sampler, processors,
                caching: _RowCaching) -> None:
        (uid,) = self._gen.insert_segments(
            [segments],
            max_tokens=[request.max_tokens],
            caches=[cache],
            all_tokens=[all_tokens],
            samplers=[sampler],
            logits_processors=[processors],
        )
        if self.prefix_cache is not None:
            if self._wait_for_shared:
                keys = _prefix_keys(request)
                caching.claimed = [self._claims.take(keys[p]) for p, _ in caching.points]
            if self._shared_points:
                self._in_prefill.add(uid, request.prompt_ids[:-1])
            self._caching[uid] = caching
        self._rows.add(uid, request.request_id)
        if request.params.logprobs:  # and the ids a folded ban keeps its sampler from drawing
            self._logprobs[uid] = (request.params.top_logprobs,
                                   sampler.banned if isinstance(sampler, BannedSampler) else ())
        if self.spec is not None:
            self.spec.rows[uid] = self._row_spec(request, sampler, processors)

    # ------------------------------------------------------------------ SpecPrefill
    def _sparse_prefill(self, request: Request, cache, start: int) -> Optional[SparsePrefill]:
        """A SparsePrefill job when this request gets SpecPrefill, else None.

        The prompt up to its system-prompt boundary, or its shared history (few-shot
        examples), is prefilled densely (and snapshotted), so the next request that shares it
        hits the cache; the rest is scored by the draft and prefilled sparsely when it is at
        least ``threshold`` tokens long (or the request asks for SpecPrefill). ``keep_pct``
        1.0 drops nothing, so such a request takes the plain path: batched with others, and
        its snapshots stored, which a sparse row's (not the exact state of its tokens) cannot be.
        """
        sp = self.specprefill
        want = request.params.specprefill
        if sp is None or want is False or request.extra.get("plain_prefill"):
            return None
        keep = request.params.keep_pct if request.params.keep_pct is not None else sp.keep_pct
        if keep >= 1.0:  # keeping every token is a plain prefill: exact, batched, and cached
            return None
        n = len(request.prompt_ids)
        # The dense part ends at the longest shared point: the system prompt, or the history
        # (few-shot examples) once a second request holds it (prompt.py), so it is cached
        # exactly and the next requests that share it start from it; examples only to be
        # cached, so not where the budget is known to refuse them.
        pc = self.prefix_cache
        shared, kind = max(((p, k) for p, k in request.cache_points if p < n - 1 and (
            k == "system" or (k == "history" and pc is not None and not pc.would_refuse(p, k)))),
            default=(0, "system"))
        dense_end = max(start, shared)
        # The threshold counts the uncached tokens past the shared part (options.py); the draft
        # scores all of them but the last, which is always prefilled (it gives the first logits).
        if n - 1 - dense_end < 1 or (not want and n - dense_end < sp.threshold):
            return None
        return SparsePrefill(
            self._gen.model, sp.draft, request.prompt_ids, cache, start=start, dense_end=dense_end,
            keep_pct=keep, chunk_size=sp.chunk_size, lookahead=sp.lookahead,
            step_size=self._opts["prefill_step_size"], draft_cache=self.draft_cache, dense_kind=kind)

    def _advance_sparse(self) -> tuple[list[TokenEvent], int, float]:
        """One piece of the oldest sparse prefill; a finished one joins the batch."""
        rid = next(iter(self._sparse))
        pending = self._sparse[rid]
        request, job = pending.request, pending.job
        tic = time.perf_counter()
        try:
            fed = job.advance()
            if job.at_dense_end and self.prefix_cache is not None and \
                    (job.dense_end, job.dense_kind) in request.cache_points:
                self.prefix_cache.store(request.prompt_ids[: job.dense_end], job.dense_snapshot(), job.dense_kind)
                self._release_sparse(pending)
            if job.done:
                self._release_sparse(pending)
                del self._sparse[rid]
                self.sp_stats.record(job)
                prompt = list(request.prompt_ids)
                # The answer's cache is not exact (sparse), so it is not kept for reuse.
                self._insert(request, [prompt[-1:]], job.row_cache(), prompt[:-1], pending.sampler,
                             pending.processors, _RowCaching(len(prompt), store_final=False))
            elif pending.claimed is None and self._wait_for_shared and job.dense_pending and \
                    (job.dense_end, job.dense_kind) in self._snapshot_points(request, job.start):
                # Claimed only now: jobs advance one at a time, oldest first, each scoring
                # its whole prompt before its dense part, and a request waiting on a job
                # still queued or scoring waited for all of that (an audit: 25x its TTFT).
                pending.claimed = self._claims.take(request.prompt_ids[: job.dense_end])
        except Exception as exc:  # noqa: BLE001 - this request fails, the lane goes on
            logger.exception("SpecPrefill of %s failed", rid)
            self._release_sparse(pending)
            self._sparse.pop(rid, None)
            error = EngineStepError(f"SpecPrefill failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            return [TokenEvent(rid, [], "error", error)], 0, 0.0
        return [], fed, time.perf_counter() - tic

    def _release_sparse(self, pending: _Sparse) -> None:
        if pending.claimed is not None:
            self._claims.give_back([pending.claimed])
            pending.claimed = None

    def specprefill_stats(self) -> dict | None:
        return self.sp_stats.snapshot() if self.specprefill is not None else None

    def remove(self, request_ids: Sequence[str]) -> None:
        for r in request_ids:
            pending = self._sparse.pop(r, None)
            if pending is not None:
                self._release_sparse(pending)
        uids = [uid for uid in map(self._rows.pop, request_ids) if uid is not None]
        for uid in uids:
            self._drop_caching(uid)
            self._logprobs.pop(uid, None)
        if uids:
            self._gen.remove(uids)
            if self.spec is not None:
                self._gen.forget(uids)

    def scoring_tokens(self, request_id: str) -> tuple[int, int]:
        pending = self._sparse.get(request_id)
        if pending is None or pending.job.scorer is None:
            return 0, 0
        # While the draft scores, the target's row holds only what it restored from the cache:
        # its dense part is prefilled after the scoring (and the draft's cache is gone then).
        return len(pending.request.prompt_ids) + self.specprefill.lookahead, pending.job.start

    def prefill_plainly(self, request: Request) -> bool:
        """SpecPrefill is a speed-up: a request its draft's cache would make too large for
        the budget runs with a plain prefill, unless it asked for SpecPrefill itself."""
        if request.params.specprefill is True or request.request_id not in self._sparse:
            return False
        self.remove([request.request_id])
        request.extra["plain_prefill"] = True
        logger.info("%s: prefilled plainly, SpecPrefill's draft cache would not fit the memory budget",
                    request.request_id)
        self.add(request)
        return True

    def discard_tokens(self, n: int) -> None:
        # Only a speculative step emits more than one token per event: the rest are drafts.
        if self.spec is not None and n > 0:
            self.spec.stats.accepted -= n

    def step(self) -> tuple[list[TokenEvent], LaneStepStats]:
        sparse_events, sparse_tokens, sparse_time = self._advance_sparse() if self._sparse else ([], 0, 0.0)
        if not self._rows:
            return sparse_events, LaneStepStats(prompt_tokens=sparse_tokens, prompt_time=sparse_time)
        with self._gen.stats() as s:
            prompt_responses, responses = self._gen.next()
        if self._caching:
            self._snapshot_boundaries(prompt_responses)
        # A speculative step sends several responses per row, in order: one event per row.
        by_rid: dict[str, TokenEvent] = {}
        asked: list[tuple] = []  # rows that asked for logprobs (base.attach_logprobs)
        for r in responses:
            rid = self._rows.request_id(r.uid)
            if rid is None:  # removed while its token was in flight
                continue
            ev = by_rid.setdefault(rid, TokenEvent(rid, []))
            ev.tokens.append(r.token)
            if r.uid in self._logprobs:
                asked.append((ev, r.logprobs, r.token, *self._logprobs[r.uid]))
            if r.finish_reason is not None:
                ev.finish_reason = r.finish_reason
                self._rows.pop(rid)
                self._logprobs.pop(r.uid, None)
                if self.spec is not None:
                    self.spec.rows.pop(r.uid, None)
                caching = self._drop_caching(r.uid)
                if caching is not None and caching.store_final and r.prompt_cache is not None:
                    self.prefix_cache.store(r.all_tokens, r.prompt_cache, "final",
                                            answer_start=caching.prompt_tokens)
        attach_logprobs(asked)
        events = sparse_events + list(by_rid.values())
        events = fail_errored(events, self._errors, self.remove)
        stats = LaneStepStats(
            prompt_tokens=s.prompt_tokens + sparse_tokens,
            prompt_time=s.prompt_time + sparse_time,
            generation_tokens=s.generation_tokens,
            decode_time=s.decode_time,
            batch_size=len({r.uid for r in responses}),
        )
        return events, stats

    def _snapshot_boundaries(self, prompt_responses) -> None:
        """Store the state of rows whose prefill just reached one of their cache points."""
        due: dict[int, str] = {}
        for r in prompt_responses:
            caching = self._caching.get(r.uid)
            if r.end_of_prompt:
                self._in_prefill.discard(r.uid)
            if caching is not None and r.end_of_prompt and caching.claimed:
                # Past its prompt, a row stores no more boundaries: a claim left (a point
                # not met where it was expected) must not hold its waiters for its answer.
                self._claims.give_back(caching.claimed)
                caching.claimed.clear()
            if caching is None or not r.end_of_segment or r.end_of_prompt or not caching.points:
                continue
            pos, kind = caching.points[0]
            if caching.start + r.progress[0] == pos:
                caching.points.pop(0)
                due[r.uid] = kind
        if due:
            for uid, (cache, tokens) in self._gen.extract_cache(list(due)).items():
                self.prefix_cache.store(tokens, cache, due[uid])
            for uid in due:  # stored (or refused by the budget): its waiters go on either way
                self._claims.give_back(self._caching[uid].claimed[:1])
                del self._caching[uid].claimed[:1]

    def _drop_caching(self, uid: int) -> Optional[_RowCaching]:
        self._in_prefill.discard(uid)
        caching = self._caching.pop(uid, None)
        if caching is not None:
            self._claims.give_back(caching.claimed)
        return caching

    def prefix_cache_stats(self) -> dict | None:
        return self.prefix_cache.snapshot() if self.prefix_cache is not None else None

    def reset(self) -> list[str]:
        """Drop every request and start from a fresh generator (after a failed step)."""
        dropped = self._rows.clear()
        self._errors.clear()
        dropped += list(self._sparse)
        self._sparse.clear()
        self._caching.clear()
        self._claims.clear()
        self._in_prefill.clear()
        self._logprobs.clear()
        self._gen.close()
        self._gen = self._new_generator()
        return dropped

    def close(self) -> None:
        self._gen.close()
        # A closed lane keeps nothing: the frames of a failed step that a caller's error
        # still holds (the engine loop's own) may name it after the engine closed.
        vars(self).clear()
