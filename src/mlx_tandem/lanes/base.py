"""The lane protocol: what the engine core needs from a batched executor.

A lane is driven only by the owner thread. Later lanes (media, speculative) implement the
same protocol, so the core's step loop does not change when they are added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

from ..errors import InvalidRequestError, TandemError
from ..request import Request
from ..token_logprobs import RawLogprob, gather


@dataclass
class TokenEvent:
    """New tokens for one request from one step. ``tokens`` may hold several (speculation)."""

    request_id: str
    tokens: list[int]
    finish_reason: Optional[str] = None  # "stop" (EOS) or "length", decided by the lane
    error: Optional[BaseException] = None  # a failure attributed to this request only
    #: Per token of ``tokens``, for a request that asked for logprobs (token_logprobs.py).
    logprobs: Optional[list[RawLogprob]] = None


@dataclass
class LaneStepStats:
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    decode_time: float = 0.0
    batch_size: int = 0


class RowIds:
    """The two-way map between engine request ids and a batch generator's row uids."""

    def __init__(self):
        self._rid: dict[int, str] = {}
        self._uid: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._uid)

    def add(self, uid: int, request_id: str) -> None:
        self._rid[uid] = request_id
        self._uid[request_id] = uid

    def request_id(self, uid: int) -> Optional[str]:
        return self._rid.get(uid)

    def uid(self, request_id: str) -> Optional[int]:
        return self._uid.get(request_id)

    def pop(self, request_id: str) -> Optional[int]:
        """Forget a request; its uid, or None if it was not here."""
        uid = self._uid.pop(request_id, None)
        if uid is not None:
            del self._rid[uid]
        return uid

    def clear(self) -> list[str]:
        """Forget every request; their ids."""
        dropped = list(self._uid)
        self._rid.clear()
        self._uid.clear()
        return dropped


def attach_logprobs(asked: list) -> None:
    """``asked``: (event, the distribution its token was drawn from, the token, how many
    of the most likely tokens to list, the ids its sampler bans), in the order of the
    event's tokens. One gather for the whole step. A token without a distribution (none is
    expected) reads NaN."""
    if not asked:
        return
    have = [(lp, tok, k, ban) for _, lp, tok, k, ban in asked if lp is not None]
    got = iter(gather(*zip(*have)) if have else ())
    for ev, lp, *_ in asked:
        if ev.logprobs is None:
            ev.logprobs = []
        ev.logprobs.append(next(got) if lp is not None else (float("nan"), ()))


def fail_errored(events: list[TokenEvent], errors: list, remove) -> list[TokenEvent]:
    """Requests whose logits processors raised during the step: drop their token events,
    remove their rows (``remove``) and give each one error event. ``errors`` is emptied."""
    if not errors:
        return events
    failed = dict(errors)
    errors.clear()
    remove(list(failed))
    events = [e for e in events if e.request_id not in failed]
    return events + [TokenEvent(rid, [], "error", _processor_error(exc)) for rid, exc in failed.items()]


def _processor_error(exc: BaseException) -> TandemError:
    """A request's own logits processor raised: its input's fault, typed as such."""
    if isinstance(exc, TandemError):
        return exc
    error = InvalidRequestError(f"logits processor failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class Lane(Protocol):
    name: str

    def prepare(self, request: Request) -> None:
        """Learn the request's real prompt before the memory check (the vision lane expands
        its images here); raises the request's own typed error. Runs again for a request
        that waited, so it must be cheap the second time."""

    def defer(self, request: Request) -> bool:
        """Should the request wait in the queue a little longer (the text lane: a row now in
        prefill is about to store a prefix of its prompt)? It does not hold back others."""

    def add(self, request: Request, waiting: Iterable[Request] = ()) -> None:
        """Start the request; ``waiting`` are the requests still queued (the text lane looks
        for a prefix they share with it, to store it for them)."""

    def remove(self, request_ids: Sequence[str]) -> None: ...

    def scoring_tokens(self, request_id: str) -> tuple[int, int]:
        """SpecPrefill: (tokens the draft's cache will hold, the tokens the row holds while
        the draft scores); (0, 0) for a request without it."""

    def prefill_plainly(self, request: Request) -> bool:
        """Take back a request given SpecPrefill and add it again with a plain prefill (its
        draft's cache made it too large); False where the request asked for SpecPrefill."""

    def discard_tokens(self, n: int) -> None:
        """``n`` tokens of a step's event went unused (cut by a stop string): stats that
        count what reached the output (MTP's accepted drafts) take them back."""

    def has_work(self) -> bool: ...

    @property
    def num_active(self) -> int: ...

    def step(self) -> tuple[list[TokenEvent], LaneStepStats]: ...

    def reset(self) -> list[str]: ...

    def close(self) -> None: ...
