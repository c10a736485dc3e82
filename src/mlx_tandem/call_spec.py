"""One engine call's inputs as given, with its keyword options checked by name.

The engine API takes its per-call options as keywords (``tools=``, ``response_format=``...):
a misspelt one must be an InvalidRequestError naming it, not Python's TypeError, on every
call form (chats, raw prompts); the values are validated later, in ``RequestBuilder.build`` (request_builder.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

from .errors import InvalidRequestError
from .params import is_finite_number


_CHAT_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "reasoning",
                 "template_kwargs", "request_id")
_COMPLETE_OPTIONS = ("response_format", "request_id")  # a raw prompt has no template to shape


@dataclasses.dataclass
class CallSpec:
    """One call's inputs, as given (validated in RequestBuilder.build)."""

    messages: Optional[Sequence[dict]] = None
    prompt: Optional[str | Sequence[int]] = None
    params: Any = None
    tools: Optional[Sequence[dict]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict] = None
    reasoning: Optional[bool] = None
    template_kwargs: Optional[dict] = None
    request_id: Optional[str] = None

    @classmethod
    def chat(cls, messages, params, options: dict) -> "CallSpec":
        unknown = set(options) - set(_CHAT_OPTIONS)
        if unknown:
            raise InvalidRequestError(f"unknown chat options {sorted(unknown)}; known: {list(_CHAT_OPTIONS)}")
        if messages is None:
            raise InvalidRequestError("messages are required")
        return cls(messages=messages, params=params, **options)

    @classmethod
    def complete(cls, prompt, params, options: dict) -> "CallSpec":
        unknown = set(options) - set(_COMPLETE_OPTIONS)
        if unknown:
            raise InvalidRequestError(f"unknown complete options {sorted(unknown)}; known: {list(_COMPLETE_OPTIONS)}")
        return cls(prompt=prompt, params=params, **options)


def deadline_of(timeout: Optional[float]) -> Optional[float]:
    """time.monotonic() at which a request given ``timeout`` seconds is cancelled."""
    if timeout is None:
        return None
    if not is_finite_number(timeout) or timeout < 0:
        raise InvalidRequestError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    return time.monotonic() + timeout
