"""What callers receive: plain data, no mlx arrays."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens restored from the prefix cache instead of prefilled.
    cached_tokens: int = 0
    #: Completion tokens spent reasoning (``<think>`` ... ``</think>``, markers included), as
    #: OpenAI's ``completion_tokens_details.reasoning_tokens``; 0 for raw prompts.
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call. ``arguments`` is the decoded JSON object."""

    id: str
    name: str
    arguments: dict[str, Any]
    #: The call's place among the answer's calls, valid and invalid ones counted together,
    #: in the order the model wrote them (as OpenAI's streamed ``tool_calls[].index``).
    index: int = 0
    #: How much of the answer's ``content`` (characters) came before this call. Content and
    #: calls are kept apart, as OpenAI's messages keep them; this is where the call sat in
    #: the text (LangChain's v1 content blocks keep that order).
    content_offset: int = 0

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class InvalidToolCall:
    """A tool call the model wrote but that could not be parsed (kept, not dropped).

    ``arguments`` is the arguments' text where the body is a JSON object (as OpenAI and
    LangChain keep an invalid call's arguments), else the whole body; ``text`` is always the
    whole body. ``truncated``: the answer reached ``max_tokens`` inside this call, so its
    arguments are only those written so far: never run it (the adapters do not)."""

    id: str
    name: Optional[str]
    arguments: Optional[str]
    error: str
    text: str = ""
    index: int = 0  # as ToolCall.index
    truncated: bool = False
    content_offset: int = 0  # as ToolCall.content_offset


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at an answer token's place."""

    token_id: int
    #: The token's text on its own (U+FFFD where it holds part of a character: ``bytes``
    #: has it whole), and its UTF-8 bytes, as OpenAI's ``token`` and ``bytes``.
    token: str
    logprob: float
    bytes: bytes = b""


@dataclass(frozen=True)
class TokenLogprob:
    """An answer token's log-probability (``SamplingParams.logprobs``), and the
    ``top_logprobs`` most likely tokens at its place, most likely first."""

    token_id: int
    token: str
    logprob: float
    bytes: bytes = b""
    top_logprobs: tuple[TopLogprob, ...] = ()

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``logprobs.content[]`` entry (bytes as a list of ints)."""
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes),
                "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}
                                 for t in self.top_logprobs]}


@dataclass(frozen=True)
class StreamDelta:
    """One piece of a streamed answer. The last one has ``finish_reason`` and ``usage`` set.

    ``text`` is the raw generated text. For chats it is also split into ``content``,
    ``reasoning`` and complete ``tool_calls`` (the stream's parser holds back text that may
    be a marker, so these can lag ``text`` by a few characters).
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: Optional[FinishReason] = None
    usage: Optional[Usage] = None
    content: Optional[str] = None
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    invalid_tool_calls: tuple[InvalidToolCall, ...] = ()
    #: Per token of ``token_ids``: how much of ``text`` had come out once it was decoded. The
    #: text a token ends is then known however the tokens were grouped into deltas (MTP).
    text_ends: tuple[int, ...] = field(default=(), repr=False)
    #: Per token of ``token_ids`` when the request asked for ``logprobs``, else empty.
    logprobs: tuple[TokenLogprob, ...] = ()
    #: Where, in the answer's text so far, a tool call's start marker was written by its own
    #: special token (the output parser opens calls only there; see ``CallMarkers``).
    call_starts: tuple[int, ...] = field(default=(), repr=False)


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
    # Chats: the answer split by the output parser (``content`` is ``text`` for raw prompts).
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)
    #: Per token of ``token_ids`` (reasoning, content and calls alike) when the request
    #: asked for ``logprobs``; None when it did not.
    logprobs: Optional[list[TokenLogprob]] = None
