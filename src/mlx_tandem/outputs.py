"""What callers receive: plain data, no mlx arrays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class StreamDelta:
    """One piece of a streamed answer. The last one has ``finish_reason`` and ``usage`` set."""

    request_id: str
    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: Optional[FinishReason] = None
    usage: Optional[Usage] = None


@dataclass
class RequestOutput:
    """The whole answer to one request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    # Seconds from submission to the first token, and for the whole request.
    time_to_first_token: Optional[float] = None
    latency: Optional[float] = None
