"""The lane protocol: what the engine core needs from a batched executor.

A lane is driven only by the owner thread. Later lanes (media, speculative) implement the
same protocol, so the core's step loop does not change when they are added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from ..request import Request


@dataclass
class TokenEvent:
    """New tokens for one request from one step. ``tokens`` may hold several (speculation)."""

    request_id: str
    tokens: list[int]
    finish_reason: Optional[str] = None  # "stop" (EOS) or "length", decided by the lane
    error: Optional[BaseException] = None  # a failure attributed to this request only


@dataclass
class LaneStepStats:
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    decode_time: float = 0.0
    batch_size: int = 0


def fail_errored(events: list[TokenEvent], errors: list, remove) -> list[TokenEvent]:
    """Requests whose logits processors raised during the step: drop their token events,
    remove their rows (``remove``) and give each one error event. ``errors`` is emptied."""
    if not errors:
        return events
    failed = dict(errors)
    errors.clear()
    remove(list(failed))
    events = [e for e in events if e.request_id not in failed]
    return events + [TokenEvent(rid, [], "error", exc) for rid, exc in failed.items()]


class Lane(Protocol):
    name: str

    def add(self, request: Request) -> None: ...

    def remove(self, request_ids: Sequence[str]) -> None: ...

    def has_work(self) -> bool: ...

    @property
    def num_active(self) -> int: ...

    def step(self) -> tuple[list[TokenEvent], LaneStepStats]: ...

    def reset(self) -> list[str]: ...

    def close(self) -> None: ...
