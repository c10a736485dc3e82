"""EngineCore: the one thread that owns MLX, and its step loop.

Model load, every forward, every cache operation and every mx.array creation happen on
this thread. Other threads only put commands in the inbox (thread-safe) and read their
request's sink. The loop is schedule -> step lanes -> process outputs; errors become values
attached to requests, and a failed step fails only the requests in it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx

from .detokenizer import RequestDetokenizer
from .errors import (EngineClosedError, EngineStepError, InvalidRequestError, QueueFullError, own_copy,
                     RequestTimeoutError, RequestTooLargeError, TandemError)
from .fork_guard import claim_process, inherited_engine_error
from .lanes import Lane, TokenEvent
from .memory import CacheFootprint, MemoryLedger
from .model_loader import LoadedModel, load_text_model, resolve_model_path
from .options import EngineOptions
from .outputs import StreamDelta, Usage
from .owner_random import restore_key, seed_from_os
from .teardown import clear_frames, drain_device, keep_exit_hook_first, release_arrays
from .request import Request, RequestState, dispatch
from .startup import build_lanes, make_ledger
from .stats import EngineStats
from .token_text import TokenTexts

logger = logging.getLogger(__name__)

OWNER_THREAD_NAME = "mlx-tandem-engine"

_STOP = object()


class EngineCore:
    def __init__(self, model: Any, options: EngineOptions):
        self.model = model  # as given: a path, a repo id, or None for the default model
        self.model_path: Optional[Path] = None
        self.options = options
        self.stats = EngineStats()
        self.ready: concurrent.futures.Future[LoadedModel] = concurrent.futures.Future()
        # Running from the start, so no caller can cancel it: one that gives up waiting for
        # the load (a cancelled task awaiting it, wrap_future passes the cancel on) would
        # otherwise cancel the load for every caller, and the owner thread's set_result fail.
        self.ready.set_running_or_notify_cancel()
        self.loaded: Optional[LoadedModel] = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=OWNER_THREAD_NAME, daemon=True)
        self._lanes: dict[str, Lane] = {}
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}
        self._memory = MemoryLedger({"text": CacheFootprint(0)}, budget=0)  # the real one is made at load
        self._held_for_memory = 0
        self._deferred: dict[str, int] = {}  # per lane: requests _admit last kept for a prefix (TextLane.defer)
        self._outbox: list[tuple[Request, Any]] = []  # (request, delta or error) to deliver
        self._closed = threading.Event()
        # Held while checking "closed" and putting in the inbox, and while closing before
        # the last drain of the inbox: nothing can land in an inbox that nobody reads.
        self._inbox_lock = threading.Lock()
        self._pid = os.getpid()  # a forked child sees another: the engine is not its own

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        claim_process()
        self._thread.start()

    def forked(self) -> bool:
        """This engine's thread lives in a parent process (``fork_guard``): checked before
        any lock, which a parent thread may have held at the fork."""
        return os.getpid() != self._pid

    @property
    def owner_thread(self) -> threading.Thread:
        return self._thread

    @property
    def closed(self) -> bool:
        return self._closed.is_set() or self.forked()

    def submit(self, request: Request) -> None:
        if self.forked():
            raise inherited_engine_error()
        with self._inbox_lock:
            if self._closed.is_set():
                raise EngineClosedError("the engine is closed")
            # Counted before the put: once it is in, the owner thread may finish it at once,
            # and stats() must never show more finished than submitted.
            self.stats.count("requests_submitted")
            try:
                self._inbox.put(("add", request))
            except BaseException:  # a KeyboardInterrupt between the two: it was never submitted
                self.stats.count("requests_submitted", -1)
                raise

    def abort(self, request: Request) -> None:
        """Abort ``request`` (the object, not its id: a refused duplicate id aborts nothing).

        No lock: streams abort from ``__del__``, which the garbage collector may run inside
        ``submit``'s locked section on the same thread; an abort lost at close is harmless."""
        if not self._closed.is_set():
            self._inbox.put(("abort", request))

    def time_out(self, request: Request) -> None:
        """``request``'s reader gave up at its deadline: fail it as the engine's own deadline
        check does (``_expire``), so a timeout counts the same whichever noticed it first."""
        if not self._closed.is_set():
            self._inbox.put(("timeout", request))

    def finish_early(self, request: Request, kept_tokens: int) -> None:
        """``request``'s reader has its whole answer (parallel_tool_calls=False: the answer
        ends at its call) in its first ``kept_tokens`` tokens: free its row, count it
        finished, not aborted, and count only the kept tokens as generated (as its usage
        does), wherever the row was when the reader cut it."""
        if not self._closed.is_set():
            self._inbox.put(("finish", (request, kept_tokens)))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the owner thread (for hooks that touch mlx state) and return its future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if threading.current_thread() is self._thread:
            # Already on the owner thread (a processor, or a call inside a call): run it now;
            # queued, it would wait for the loop this call blocks.
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001
                fut.set_exception(exc)
            return fut
        if self.forked():
            fut.set_exception(inherited_engine_error())
            return fut
        with self._inbox_lock:
            if not self._closed.is_set():
                self._inbox.put(("call", (fn, fut)))
                return fut
        fut.set_exception(EngineClosedError("the engine is closed"))
        return fut

    def _mark_closed(self) -> None:
        """Refuse new commands; after this the inbox only shrinks, so one drain empties it."""
        with self._inbox_lock:
            self._closed.set()

    def shutdown(self, timeout: Optional[float] = None) -> None:
        if self._thread.is_alive():
            self._inbox.put((_STOP, None))
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
        self._closed.set()

    # ------------------------------------------------------------------ owner thread
    def _run(self) -> None:
        try:
            seed_from_os()  # this thread's own key: a new thread starts from the process's
            self._build_lanes()
            # The owner thread decodes with its own tokenizer copy: HF fast tokenizers raise
            # "Already borrowed" when one instance is used from several threads at once.
            # Inside the try: a failure here must reach ``ready`` too, or start() waits forever.
            hf_tokenizer = copy.deepcopy(self.loaded.tokenizer._tokenizer)
            self._decode = lambda ids: hf_tokenizer.decode(ids, skip_special_tokens=False)
            self._token_texts = TokenTexts(hf_tokenizer, self._decode)
            self._eos = frozenset(self.loaded.eos_token_ids)
        except BaseException as exc:  # noqa: BLE001 - reported through the ready future
            self._mark_closed()
            # What loaded before the failure (weights, head) is freed here, on this thread:
            # the error and the errors it chains keep frames whose locals hold arrays.
            clear_frames(exc)
            self._shut_down(fail_requests=False)
            self.ready.set_exception(exc)
            self._fail_inbox(exc)
            return
        self.ready.set_result(self.loaded)
        try:
            self._loop()
        except BaseException:  # noqa: BLE001 - last resort: never leave callers hanging
            logger.exception("engine loop crashed")
        finally:
            self._mark_closed()
            self._shut_down(fail_requests=True)

    def _shut_down(self, *, fail_requests: bool) -> None:
        # Each step on its own: one that fails must not skip the rest (callers left hanging,
        # or arrays freed by another thread at exit, which aborts). No lane is named in the
        # caller's frame, so _release_arrays frees them before it clears MLX's cache.
        steps = (self._fail_everything_at_close,) if fail_requests else ()
        for step in (*steps, self._close_lanes, drain_device, self._release_arrays):
            try:
                step()
            except BaseException:  # noqa: BLE001
                logger.exception("engine shutdown step failed")

    def _build_lanes(self) -> None:
        """Load the model (and head, draft, vision tower) and build the lanes and the ledger.
        A method of its own so no local outlives it: shutdown must be able to free them."""
        # Resolved here, not by the caller: building the default model uses mlx.
        self.model_path = resolve_model_path(self.model)
        self.loaded = load_text_model(self.model_path, show_progress=self.options.show_progress)
        mtp_head = build_lanes(self.loaded, self.options, self._lanes)
        keep_exit_hook_first()  # loading may have imported mlx-vlm, which registers its own
        self._memory = make_ledger(self.loaded, self.options, self._lanes, mtp_head)
        self._update_queue_stats()
        for lane in self._lanes.values():  # the configured budgets show before the first step
            self._publish_lane_stats(lane)

    def _fail_everything_at_close(self) -> None:
        self._fail_everything(EngineClosedError("the engine was closed"))

    def _close_lanes(self) -> None:
        for name in list(self._lanes):
            try:
                self._lanes[name].close()
            except BaseException:  # noqa: BLE001 - the other lanes still close
                logger.exception("closing the %s lane failed", name)

    def _release_arrays(self) -> None:
        release_arrays(self._lanes, self.loaded)

    def _loop(self) -> None:
        coalesce = self.options.coalesce_ms / 1000.0
        while True:
            busy = bool(self._waiting) or any(l.has_work() for l in self._lanes.values())
            if not self._drain_inbox(block=not busy):
                return
            if not busy and coalesce > 0:
                # Woken from idle: concurrent callers are usually still tokenizing their
                # prompts; a short wait lets them join the first prefill instead of trickling in.
                time.sleep(coalesce)
                if not self._drain_inbox(block=False):
                    return
            self._admit()
            for lane in self._lanes.values():
                if lane.has_work():
                    self._step_lane(lane)
            self._expire()
            self._flush()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply pending commands; False when asked to stop."""
        while True:
            try:
                kind, arg = self._inbox.get() if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind is _STOP:
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "finish":
                self._finish_early(*arg)
            elif kind == "timeout":
                self._time_out(arg)
            elif kind == "call":
                fn, fut = arg
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001
                        fut.set_exception(exc)
            self._flush()

    def _add(self, req: Request) -> None:
        rid = req.request_id
        if rid in self._running or any(w.request_id == rid for w in self._waiting):
            # Not _fail: retiring it would drop the live request that owns the id.
            self._emit(req, InvalidRequestError(f"request_id {rid!r} is already in use by a live request"))
            self.stats.count("requests_failed")
            return
        too_large = self._never_fits(req)
        if too_large is not None:
            self._fail(req, too_large)
            return
        if len(self._waiting) >= self.options.max_waiting:
            self._admit()  # a burst drained in one go: start what free slots can take first
        if self._queued() >= self.options.max_waiting:
            self._fail(req, QueueFullError(
                f"no request can start now (every batch slot is busy or the memory budget is reached) and "
                f"{self.options.max_waiting} requests already wait (engine option max_waiting); try again later"))
            return
        self._waiting.append(req)
        self._update_queue_stats()

    def _abort(self, request: Request) -> None:
        if self._take_out(request):
            self._finish_aborted(request)

    def _finish_early(self, request: Request, kept_tokens: int) -> None:
        with self.stats.held():  # finished, its tokens and MTP's counts move together
            if self._take_out(request):
                request.finish_time = time.perf_counter()
                self._retire(request)
                self._count(request, "finished")
            # The row decoded on until now (or ended by itself, past the call, in the same
            # step): count what the answer kept, MTP's accepted drafts included.
            self.stats.count("generation_tokens", -max(0, request.num_generated - kept_tokens))
            if (lane := self._lanes.get(request.lane)) is not None:
                lane.discard_tokens(sum(max(0, s + n - max(s, kept_tokens)) for s, n in request.draft_spans))
                self._publish_lane_stats(lane)

    def _time_out(self, request: Request) -> None:
        if self._take_out(request):
            self._fail(request, RequestTimeoutError(f"request {request.request_id} exceeded its timeout"))
        elif request.outcome == "finished":
            # It finished in the step that ran while its reader's deadline passed: the caller
            # got RequestTimeoutError, not the answer, so it counts as the caller saw it.
            self._count(request, "failed", was="finished")

    def _count(self, request: Request, outcome: str, *, was: Optional[str] = None) -> None:
        request.outcome = outcome
        if was is None:
            self.stats.count(f"requests_{outcome}")
        else:
            self.stats.recount(f"requests_{was}", f"requests_{outcome}")

    def _take_out(self, request: Request) -> bool:
        """Remove a live request from the queue or its lane; False if it is not live."""
        for i, req in enumerate(self._waiting):  # by identity: Requests compare by fields
            if req is request:
                del self._waiting[i]
                return True
        if self._running.get(request.request_id) is request:
            self._lanes[request.lane].remove([request.request_id])
            return True
        return False

    def _expire(self) -> None:
        """Requests past their deadline leave now, whether or not their stream is being read:
        a caller holding an unread stream must not keep a slot."""
        now = time.monotonic()
        late = [r for r in (*self._waiting, *self._running.values()) if r.deadline is not None and now > r.deadline]
        for req in late:
            self._take_out(req)
            self._fail(req, RequestTimeoutError(f"request {req.request_id} exceeded its timeout"))

    def _never_fits(self, req: Request) -> Optional[RequestTooLargeError]:
        """The error for a request whose cache alone passes the memory budget, else None."""
        need = self._memory.alone_bytes(req.lane, self._row_tokens(req))
        return self._too_large(req, need) if need > self._memory.budget else None

    def _too_large(self, req: Request, need: int) -> RequestTooLargeError:
        return RequestTooLargeError(
            f"request {req.request_id}: its cache ({req.num_prompt_tokens} prompt tokens + max_tokens "
            f"{req.max_tokens}) needs {need} bytes, over the engine's request memory budget of "
            f"{self._memory.budget} bytes; lower max_tokens or raise the engine option request_memory_bytes")

    def _queued(self) -> int:
        """The waiting requests that count against ``max_waiting``: those waiting for a slot
        or for memory. One its lane keeps back a step for a prefix another row is storing
        (TextLane.defer) could start now, up to the lane's free slots: counted, it made a
        burst sharing a system prompt (or ChatMLX's ``n``) fail with QueueFullError while
        slots were free (review h164)."""
        startable = sum(min(n, self.options.max_batch_size - lane.num_active)
                        for name, n in self._deferred.items() if (lane := self._lanes.get(name)) is not None)
        return len(self._waiting) - max(0, startable)

    def _admit(self) -> None:
        """Start waiting requests, in arrival order, on lanes with a free slot while their
        caches fit the memory budget (memory.py). A full lane, or a request its lane defers,
        holds back no other; one waiting for memory holds back every later one (memory is
        shared, and letting small requests pass would starve a large one)."""
        full: set[str] = set()
        kept: deque[Request] = deque()
        memory = self._memory
        held = 0  # requests kept because the memory budget is reached (the first and all after it)
        deferred: dict[str, int] = {}
        while self._waiting:
            req = self._waiting.popleft()
            lane = self._lanes.get(req.lane)
            if lane is not None and not held and (req.lane in full or lane.num_active >= self.options.max_batch_size):
                full.add(req.lane)
                kept.append(req)
                continue
            if lane is not None and not held and lane.defer(req):
                deferred[req.lane] = deferred.get(req.lane, 0) + 1
                kept.append(req)
                continue
            if lane is not None and not held and not self._prepared(lane, req):
                continue
            # A request held before for its draft's cache (below) is checked with it: handed
            # to the lane and taken back on every step, it redid its prefix-cache lookup and
            # SparsePrefill job each time.
            if lane is not None and (held or not memory.fits(req.lane, self._row_tokens(req),
                                                              req.extra.get("scoring_bytes", 0))):
                held += 1
                self._hold_for_memory(req)
                kept.append(req)
                continue
            try:
                if lane is None:
                    raise InvalidRequestError(f"this model has no {req.lane} lane")
                req.detokenizer = RequestDetokenizer(self._decode, req.params.stop, req.stop_exempt)
                lane.add(req, itertools.chain(kept, self._waiting))  # it may share a prefix with them
                # A request the text lane gives SpecPrefill also holds its draft's cache:
                # known only once the lane took it, so measured again.
                tokens = self._row_tokens(req)
                side = memory.scoring_bytes(req.lane, tokens, *lane.scoring_tokens(req.request_id))
                if side and memory.alone_bytes(req.lane, tokens) + side > memory.budget and lane.prefill_plainly(req):
                    side = 0  # too large only with SpecPrefill's draft cache: prefilled plainly
                if not memory.fits(req.lane, tokens, side):
                    lane.remove([req.request_id])
                    if memory.alone_bytes(req.lane, tokens) + side > memory.budget:
                        raise self._too_large(req, memory.alone_bytes(req.lane, tokens) + side)
                    # It waits at its place, now with its real size.
                    req.extra["scoring_bytes"] = side
                    held += 1
                    self._hold_for_memory(req)
                    kept.append(req)
                    continue
                memory.reserve(req.request_id, req.lane, tokens, side)
            except TandemError as exc:
                self._fail(req, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a bad request must not stop the loop
                logger.exception("could not admit %s", req.request_id)
                self._fail(req, InvalidRequestError(f"could not start the request: {exc}"))
                continue
            req.state = RequestState.RUNNING
            self._running[req.request_id] = req
            self.stats.count("prompt_tokens", req.num_prompt_tokens)
            self.stats.count_lane(req.lane)
            if req.extra.get("constrained"):
                self.stats.count("constrained_requests")
        self._waiting = kept
        self._held_for_memory = held
        self._deferred = deferred
        self._update_queue_stats()

    def _prepared(self, lane: Lane, req: Request) -> bool:
        """The lane learns the request's real prompt (images expanded) before its memory is
        checked; False when that failed the request (or showed it can never fit)."""
        try:
            lane.prepare(req)
            too_large = self._never_fits(req)
            if too_large is not None:
                raise too_large
            return True
        except TandemError as exc:
            self._fail(req, exc)
        except Exception as exc:  # noqa: BLE001 - a bad request must not stop the loop
            logger.exception("could not prepare %s", req.request_id)
            self._fail(req, InvalidRequestError(f"could not start the request: {exc}"))
        return False

    def _row_tokens(self, req: Request) -> int:
        return self._memory.row_tokens(req.lane, req.num_prompt_tokens, req.max_tokens)

    def _hold_for_memory(self, req: Request) -> None:
        if not req.extra.get("waited_for_memory"):
            req.extra["waited_for_memory"] = True
            self.stats.count("memory_waits")

    def _step_lane(self, lane: Lane) -> None:
        rng_key = mx.random.state[0]  # a failed step puts it back (owner_random.restore_key)
        try:
            events, st = lane.step()
        except BaseException as exc:  # noqa: BLE001 - fail the step's requests, keep serving
            restore_key(rng_key)
            self.stats.count("step_errors")
            error = EngineStepError(f"the forward step failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            # Every running request of the lane, not only the rows reset() still knows: a
            # row that finished earlier in the failed step has left the lane, and its
            # answer went with the step's events.
            ids = set(lane.reset()) | {rid for rid, r in self._running.items() if r.lane == lane.name}
            logger.error("step of lane %r failed; failing its requests %s and recovering", lane.name,
                         sorted(ids), exc_info=exc)
            for rid in ids:
                req = self._running.get(rid)
                if req is not None:
                    self._fail(req, own_copy(error))
            return
        with self.stats.held():  # no snapshot between the step's tokens and what takes them back
            self.stats.record_step(
                batch_size=st.batch_size,
                prompt_tokens=st.prompt_tokens,
                prompt_time=st.prompt_time,
                generation_tokens=st.generation_tokens,
                decode_time=st.decode_time,
            )
            for ev in events:
                self._process(lane, ev)
            self._publish_lane_stats(lane)  # after the events: a stop string takes back drafts

    def _publish_lane_stats(self, lane: Lane) -> None:
        mtp = getattr(lane, "mtp_stats", None)
        if mtp is not None and (snap := mtp()) is not None:
            self.stats.set_mtp(lane.name, snap)
        for section in ("prefix_cache", "specprefill", "vision_prefix_cache"):
            report = getattr(lane, f"{section}_stats", None)
            if report is not None and (snap := report()) is not None:
                self.stats.set_section(section, snap)

    def _process(self, lane: Lane, ev: TokenEvent) -> None:
        req = self._running.get(ev.request_id)
        if req is None:
            return
        if ev.error is not None:
            err = ev.error
            if not isinstance(err, TandemError):  # lanes type their errors; this is a backstop
                err = EngineStepError(f"the request failed: {type(ev.error).__name__}: {ev.error}")
                err.__cause__ = ev.error
            self._fail(req, err)
            return
        now = time.perf_counter()
        if req.first_token_time is None and ev.tokens:
            req.first_token_time = now
            self.stats.record_ttft(now - req.arrival)
        eos = self._eos
        text, new_ids, ends, finish = "", [], [], None
        start = req.num_generated
        for i, tok in enumerate(ev.tokens):
            req.num_generated += 1
            if tok in eos:
                finish = "stop"
                break
            new_ids.append(tok)
            text += req.detokenizer.add(tok)
            ends.append(len(text))
            if req.detokenizer.stopped:
                finish = "stop"
                lane.remove([req.request_id])
                # A speculative step's tokens past the stop never reach the output: the
                # stats count what did (generation_tokens as usage counts it).
                lane.discard_tokens(len(ev.tokens) - i - 1)
                self.stats.count("generation_tokens", -(len(ev.tokens) - i - 1))
                break
        if req.num_generated - start > 1:  # a speculative step: its tokens after the first are drafts
            req.draft_spans.append((start + 1, req.num_generated - start - 1))
        finish = finish or ev.finish_reason
        logprobs = tuple(map(self._token_texts.logprob, new_ids, ev.logprobs or ()))  # new_ids begin ev.tokens
        if finish is None:
            if text or new_ids:
                self._emit(req, StreamDelta(req.request_id, text, tuple(new_ids), text_ends=tuple(ends),
                                            logprobs=logprobs, call_starts=req.detokenizer.take_call_starts()))
            return
        text += req.detokenizer.finish()
        if req.detokenizer.stopped:  # a stop string completed by the last text held back
            finish = "stop"
        req.finish_time = now
        self._emit(req, StreamDelta(
            req.request_id, text, tuple(new_ids), finish_reason=finish,
            usage=Usage(req.num_prompt_tokens, req.num_generated, req.cached_tokens), text_ends=tuple(ends),
            logprobs=logprobs, call_starts=req.detokenizer.take_call_starts()))
        self._retire(req)
        self._count(req, "finished")

    # ------------------------------------------------------------------ helpers
    def _emit(self, req: Request, item) -> None:
        self._outbox.append((req, item))

    def _flush(self) -> None:
        if self._outbox:
            items, self._outbox = self._outbox, []
            closed = dispatch([(req.sink, item) for req, item in items])
            # Nobody can read a stream whose event loop has closed: free its slot now
            # rather than decode on for a reader that is gone.
            if closed:
                for req in {id(r): r for r, _ in items if r.sink.loop in closed}.values():
                    self._abort(req)

    def _retire(self, req: Request) -> None:
        req.state = RequestState.FINISHED
        self._running.pop(req.request_id, None)
        self._memory.release(req.request_id)
        self._update_queue_stats()

    def _fail(self, req: Request, exc: BaseException) -> None:
        # The error goes to a caller's thread: its frames' locals (a lane, its caches, a
        # step's arrays) would keep this thread's MLX state alive there, past close().
        clear_frames(exc)
        self._emit(req, exc)
        self._retire(req)
        self._count(req, "failed")

    def _finish_aborted(self, req: Request) -> None:
        self._emit(req, StreamDelta(req.request_id, "", (), finish_reason="abort",
                                    usage=Usage(req.num_prompt_tokens, req.num_generated, req.cached_tokens)))
        self._retire(req)
        self._count(req, "aborted")

    def _fail_everything(self, exc: BaseException) -> None:
        for req in list(self._waiting) + list(self._running.values()):
            self._fail(req, own_copy(exc))
        self._waiting.clear()
        self._update_queue_stats()
        self._fail_inbox(exc)
        self._flush()

    def _fail_inbox(self, exc: BaseException) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._emit(arg, own_copy(exc))
                self.stats.count("requests_failed")
            elif kind == "call" and arg[1].set_running_or_notify_cancel():  # not if cancelled
                arg[1].set_exception(EngineClosedError("the engine is closed"))
        self._flush()

    def _update_queue_stats(self) -> None:
        # Requests leave the queue outside _admit (deadlines, aborts, close); only _admit
        # knows which wait for memory, but never more than wait at all.
        self._held_for_memory = min(self._held_for_memory, len(self._waiting))
        self.stats.set_queue(running=len(self._running), waiting=len(self._waiting),
                             memory={**self._memory.snapshot(), "waiting_for_memory": self._held_for_memory})

