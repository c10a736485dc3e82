"""Engine counters: written by the owner thread, read as a snapshot by anyone."""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from typing import Any, Iterator

from .prefix_cache import PrefixCache


# Before the text lane reports (and on an engine without a prefix cache): the same keys, zeros.
_EMPTY_PREFIX_CACHE = PrefixCache(0).snapshot()


# The vision lane's (lanes/vision_cache.py), under "prefix_cache": "vision".
_EMPTY_VISION_PREFIX_CACHE = {"hits": 0, "misses": 0, "hit_tokens": 0, "stored": 0, "evicted": 0, "entries": 0,
                              "bytes": 0, "budget_bytes": 0, "encoder_skips": 0}


_EMPTY_MEMORY = {"budget_bytes": 0, "reserved_bytes": 0, "rows": {}, "waiting_for_memory": 0}


_EMPTY_SPECPREFILL = {"requests": 0, "sparse_tokens": 0, "kept_tokens": 0, "keep_ratio": 0.0,
                      "draft_tokens": 0, "draft_time_s": 0.0, "target_time_s": 0.0}


class EngineStats:
    def __init__(self):
        # Reentrant: ``held`` wraps a step's updates, each of which locks too.
        self._lock = threading.RLock()
        self.started_at = time.perf_counter()
        self.requests_submitted = 0
        self.requests_finished = 0
        self.requests_failed = 0
        self.requests_aborted = 0
        self.running = 0
        self.waiting = 0
        self.max_batch_size_seen = 0
        self.steps = 0
        self.decode_steps = 0
        self.step_errors = 0
        self.constrained_requests = 0  # grammar-constrained (forced tool call, response_format)
        self.memory_waits = 0  # requests that waited for the memory budget before they started
        self.prompt_tokens = 0  # the prompts of admitted requests
        self.prefill_tokens = 0  # tokens the forward passes prefilled (for the rate)
        self.prompt_time = 0.0
        self.generation_tokens = 0
        self.decode_time = 0.0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.decode_rows = 0  # sum of decode batch sizes (a speculative step emits more tokens than rows)
        self.mtp_lanes: dict[str, dict] = {}
        self.lane_requests: dict[str, int] = {"text": 0, "vision": 0}
        self.sections: dict[str, dict] = {}  # "prefix_cache", "specprefill", ...: set by the lanes

    def record_step(self, *, batch_size: int, prompt_tokens: int, prompt_time: float,
                    generation_tokens: int, decode_time: float) -> None:
        with self._lock:
            self.steps += 1
            if generation_tokens:
                self.decode_steps += 1
                self.decode_rows += batch_size
            self.max_batch_size_seen = max(self.max_batch_size_seen, batch_size)
            self.prefill_tokens += prompt_tokens
            self.prompt_time += prompt_time
            self.generation_tokens += generation_tokens
            self.decode_time += decode_time

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Updates that a snapshot sees together or not at all: one engine step's tokens,
        what a stop string takes back of them, and MTP's counts. Apart, a snapshot between
        them read generation_tokens falling (12, then 11) and MTP's accepted behind it."""
        with self._lock:
            yield

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def recount(self, was: str, now: str) -> None:
        """One request moves from counter ``was`` to ``now``, in one update: no snapshot
        sees it in neither or in both."""
        with self._lock:
            setattr(self, was, getattr(self, was) - 1)
            setattr(self, now, getattr(self, now) + 1)

    def set_queue(self, *, running: int, waiting: int, memory: dict) -> None:
        """The queue's counts and the memory ledger's section, in one update: a snapshot
        never pairs counts with a ledger from another moment."""
        with self._lock:
            self.running = running
            self.waiting = waiting
            self.sections["memory"] = memory

    def count_lane(self, lane: str) -> None:
        with self._lock:
            self.lane_requests[lane] = self.lane_requests.get(lane, 0) + 1

    def set_mtp(self, lane: str, snapshot: dict) -> None:
        with self._lock:
            self.mtp_lanes[lane] = snapshot

    def set_section(self, name: str, snapshot: dict) -> None:
        with self._lock:
            self.sections[name] = snapshot

    def _mtp(self) -> dict[str, Any]:
        total = {k: sum(l[k] for l in self.mtp_lanes.values())
                 for k in ("spec_steps", "plain_steps", "drafted", "accepted", "draft_rows")}
        total["acceptance_rate"] = total["accepted"] / total["drafted"] if total["drafted"] else 0.0
        total["mean_accepted_per_step"] = total["accepted"] / total["draft_rows"] if total["draft_rows"] else 0.0
        total["lanes"] = copy.deepcopy(self.mtp_lanes)
        return total

    def record_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self.requests_submitted,
                "finished": self.requests_finished,
                "failed": self.requests_failed,
                "aborted": self.requests_aborted,
                "running": self.running,
                "waiting": self.waiting,
                "max_batch_size": self.max_batch_size_seen,
                "mean_batch_size": (self.decode_rows / self.decode_steps) if self.decode_steps else 0.0,
                "steps": self.steps,
                "step_errors": self.step_errors,
                "constrained_requests": self.constrained_requests,
                "prompt_tokens": self.prompt_tokens,
                "prefill_tokens": self.prefill_tokens,
                "generation_tokens": self.generation_tokens,
                "prompt_tokens_per_s": (self.prefill_tokens / self.prompt_time) if self.prompt_time else 0.0,
                "generation_tokens_per_s": (self.generation_tokens / self.decode_time) if self.decode_time else 0.0,
                "mean_ttft_s": (self.ttft_sum / self.ttft_count) if self.ttft_count else 0.0,
                "uptime_s": time.perf_counter() - self.started_at,
                "mtp": self._mtp(),
                "lane_requests": dict(self.lane_requests),
                "prefix_cache": {**copy.deepcopy(self.sections.get("prefix_cache") or _EMPTY_PREFIX_CACHE),
                                 "vision": copy.deepcopy(self.sections.get("vision_prefix_cache")
                                                         or _EMPTY_VISION_PREFIX_CACHE)},
                "specprefill": copy.deepcopy(self.sections.get("specprefill") or _EMPTY_SPECPREFILL),
                # Deep: a reader that edits its snapshot (annotates, pops keys) changed the
                # engine's rows, and before load the module's empty section (review h156).
                "memory": {**copy.deepcopy(self.sections.get("memory") or _EMPTY_MEMORY), "waits": self.memory_waits},
            }
