"""A request inside the engine: its inputs, its state, and the sink its outputs go to.

The sinks are the only bridge from the owner thread back to callers: the engine thread
calls ``put``; callers read on their own thread or event loop.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .detokenizer import CallMarkers
from .errors import TandemError
from .outputs import StreamDelta
from .params import SamplingParams

_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


Item = Union[StreamDelta, TandemError]


class SyncSink:
    """For threads: a blocking queue."""

    loop = None  # not tied to an event loop: dispatch() puts items directly

    def __init__(self):
        self._q: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def put(self, item: Item) -> None:
        self._q.put(item)

    def get(self, timeout: Optional[float] = None) -> Item:
        return self._q.get(timeout=timeout)


class AsyncSink:
    """For event loops: an asyncio.Queue fed through ``call_soon_threadsafe``.

    The engine groups the items of one step per loop (see ``dispatch``), so a step costs
    one wake-up per loop, not one per token.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._q: asyncio.Queue[Item] = asyncio.Queue()

    def put(self, item: Item) -> None:
        self.loop.call_soon_threadsafe(self._q.put_nowait, item)

    def put_nowait_on_loop(self, item: Item) -> None:
        self._q.put_nowait(item)

    async def get(self) -> Item:
        return await self._q.get()

    def get_nowait(self) -> Optional[Item]:
        """The next item if one has arrived, else None."""
        try:
            return self._q.get_nowait()
        except asyncio.QueueEmpty:
            return None


def _deliver(batch):
    for sink, item in batch:
        sink.put_nowait_on_loop(item)


def dispatch(items: list[tuple[Any, Item]]) -> set:
    """Deliver (sink, item) pairs: one call_soon_threadsafe per event loop. Returns the
    event loops that are closed (nobody is listening on them any more)."""
    by_loop: dict[Any, list] = {}
    for sink, item in items:
        if sink.loop is None:
            sink.put(item)
        else:
            by_loop.setdefault(sink.loop, []).append((sink, item))
    closed = set()
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:
            closed.add(loop)
    return closed


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Any
    lane: str = "text"
    state: RequestState = RequestState.WAITING
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_generated: int = 0
    # (first index, count) of the generated tokens that were MTP's accepted drafts: what
    # parallel_tool_calls=False takes back from the stats when it cuts the answer short.
    draft_spans: list[tuple[int, int]] = field(default_factory=list)
    max_tokens: int = 0
    # How stats() counted it once retired: "finished", "failed" or "aborted".
    outcome: Optional[str] = None
    # Set by the owner thread when admitted: per-request state the lane and output processor keep.
    lane_state: Any = None
    detokenizer: Any = None
    extra: dict = field(default_factory=dict)
    # Engine-made logits processors (grammar, token bans), applied after the params' ones.
    processors: list = field(default_factory=list)
    # Prompt positions worth a prefix-cache snapshot: (length, kind), e.g. the end of the
    # system prompt ("system") and of the conversation before this turn ("turn").
    cache_points: list = field(default_factory=list)
    # Prompt tokens served from the prefix cache (set by the lane when admitted).
    cached_tokens: int = 0
    # time.monotonic() past which the engine fails the request with TimeoutError (None: never).
    deadline: Optional[float] = None
    # A tool call's markers (and reasoning's), between which stop strings are not matched
    # (detokenizer.CallMarkers).
    stop_exempt: Optional[CallMarkers] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)
