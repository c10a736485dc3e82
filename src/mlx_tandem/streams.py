"""Stream handles: what a caller holds for one submitted request.

Async and blocking twins over the request's sink: accumulate deltas, parse chat output,
detect the end, enforce an optional deadline, and abort the request when left early.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Optional

from .chat_output import ChatOutputParser
from .core import EngineCore
from .errors import InvalidRequestError, RequestTimeoutError
from .outputs import RequestOutput, StreamDelta, Usage
from .request import Request


class _StreamBase:
    """Shared bookkeeping of a request's stream: accumulate, parse, detect the end, abort if left early."""

    def __init__(self, core: EngineCore, req: Request, sink, parser: Optional[ChatOutputParser] = None):
        self._core = core
        self._req = req
        self._sink = sink
        self._parser = parser
        self._done = False
        self._last: Optional[StreamDelta] = None  # the final delta, once it arrived
        self.text_parts: list[str] = []
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.tool_calls: list = []
        self.invalid_tool_calls: list = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # TokenLogprob per token of token_ids, when the request asked
        # Per token: how much of the text had come out once it was decoded (StreamDelta.text_ends).
        self._text_ends: list[int] = []
        self._text_len = 0
        # len(token_ids) after the delta in which reasoning ended (the parser is text-based).
        self._reasoning_left_at: Optional[int] = None
        self._cut_early = False  # the reader ended the answer at its call (finish_early)

    @property
    def request_id(self) -> str:
        return self._req.request_id

    @property
    def deadline(self) -> Optional[float]:
        """time.monotonic() past which the request is cancelled: the reader gets TimeoutError,
        and the engine frees the slot even if nobody reads."""
        return self._req.deadline

    @deadline.setter
    def deadline(self, value: Optional[float]) -> None:
        self._req.deadline = value

    def _accept(self, item) -> StreamDelta:
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self.text_parts.append(item.text)
        self.token_ids.extend(item.token_ids)
        self.logprobs.extend(item.logprobs)
        ends = item.text_ends if len(item.text_ends) == len(item.token_ids) else [len(item.text)] * len(item.token_ids)
        self._text_ends.extend(self._text_len + e for e in ends)
        self._text_len += len(item.text)
        finish = item.finish_reason
        if self._parser is None:
            item = dataclasses.replace(item, content=item.text)
        else:
            parsed = self._parser.feed(item.text, call_starts=item.call_starts)
            if self._reasoning_left_at is None and self._parser.reasoned and not self._parser.in_reasoning:
                self._reasoning_left_at = len(self.token_ids)
            if finish is not None:
                end = self._parser.finish(truncated=finish == "length")
                parsed.content += end.content
                parsed.reasoning += end.reasoning
                parsed.tool_calls += end.tool_calls
                parsed.invalid_tool_calls += end.invalid_tool_calls
            usage = item.usage
            if self._parser.calls_exhausted:
                # parallel_tool_calls=False: the answer ends at its call; free the row now.
                # A speculative step can bring the call's end and what follows (EOS, more
                # text) in one delta, so cut there: the output is the same however the
                # tokens were grouped into deltas (MTP on or off).
                item = self._cut_after_call(item)
                self._core.finish_early(self._req, len(self.token_ids))
                self._cut_early = True
                finish = "tool_calls"
                usage = Usage(self._req.num_prompt_tokens, len(self.token_ids), self._req.cached_tokens)
            if finish == "stop" and (self.tool_calls or parsed.tool_calls):
                finish = "tool_calls"
            if usage is not None:
                usage = dataclasses.replace(usage, reasoning_tokens=self._reasoning_tokens())
            item = dataclasses.replace(
                item, content=parsed.content, reasoning=parsed.reasoning, finish_reason=finish, usage=usage,
                tool_calls=tuple(parsed.tool_calls), invalid_tool_calls=tuple(parsed.invalid_tool_calls))
        self.content_parts.append(item.content)
        self.reasoning_parts.append(item.reasoning)
        self.tool_calls.extend(item.tool_calls)
        self.invalid_tool_calls.extend(item.invalid_tool_calls)
        if finish is not None:
            self._done = True
            self._last = item
        return item

    def _output(self) -> RequestOutput:
        """What arrived; a stream cancelled before its end reads as aborted there."""
        last = self._last
        req = self._req
        return RequestOutput(
            request_id=req.request_id,
            text="".join(self.text_parts),
            token_ids=self.token_ids,
            finish_reason=last.finish_reason if last else "abort",
            usage=(last and last.usage) or Usage(req.num_prompt_tokens, len(self.token_ids), req.cached_tokens,
                                                 reasoning_tokens=self._reasoning_tokens()),
            prompt_token_ids=req.prompt_ids,
            time_to_first_token=(req.first_token_time - req.arrival) if req.first_token_time else None,
            latency=(req.finish_time - req.arrival) if req.finish_time else None,
            content="".join(self.content_parts),
            reasoning="".join(self.reasoning_parts),
            tool_calls=list(self.tool_calls),
            invalid_tool_calls=list(self.invalid_tool_calls),
            logprobs=list(self.logprobs) if req.params.logprobs else None,
        )

    def _cut_after_call(self, item: StreamDelta) -> StreamDelta:
        """``item`` (the last delta, already accumulated) without what follows the end of
        the call that ended the answer, in its text and in its tokens, through the token
        that completed the marker. The parser says where that marker ends: not the first
        marker in the delta, which may close an invalid call (that does not count) before
        the valid one. The marker may begin in an earlier delta (how tokens group into deltas
        depends on MTP), and its last token may carry what follows (a tokenizer's ``>\n\n``):
        the cut is mapped to tokens by their text ends, not by the marker's own token ids."""
        n = len(item.token_ids)
        cut = self._parser.exhausted_at
        if cut is None:  # the call ran to the end of the answer (Mistral's have no end marker)
            return item
        delta_at = self._text_len - len(item.text)
        first = len(self.token_ids) - n
        if cut <= delta_at:  # the call ended before this delta: none of it is kept
            keep = 0
        elif len(item.text_ends) == n:
            keep = next((k + 1 for k in range(n) if self._text_ends[first + k] >= cut), n)
        else:  # no per-token text: the marker's own ids, where they appear
            ids = list(self._parser.format.tool_call_end_ids)
            keep = next((i - first + len(ids) for i in range(max(0, first - len(ids) + 1),
                                                              len(self.token_ids) - len(ids) + 1)
                         if ids and self.token_ids[i: i + len(ids)] == ids), n)
        del self.token_ids[first + keep:]
        del self._text_ends[first + keep:]
        if self.logprobs:
            del self.logprobs[first + keep:]
        text = item.text[: max(0, cut - delta_at)]
        self.text_parts[-1] = text
        return dataclasses.replace(item, text=text, token_ids=tuple(item.token_ids[:keep]),
                                   text_ends=tuple(min(e, len(text)) for e in item.text_ends[:keep]),
                                   logprobs=item.logprobs[:keep],
                                   call_starts=tuple(c for c in item.call_starts if c < cut))

    def _reasoning_tokens(self) -> int:
        """Completion tokens up to the end of the reasoning: through the first ``think_end``
        token sequence, or, where the model spelled the marker in other tokens, through the
        token that completed its text; all of them while it still reasons. Either way the
        count does not depend on how the tokens were grouped into deltas (MTP)."""
        p = self._parser
        if p is None or not p.reasoned:
            return 0
        if p.in_reasoning or self._reasoning_left_at is None:
            return len(self.token_ids)
        ids, end = list(p.think_end_ids), self._reasoning_left_at
        if ids:
            for i in range(end - len(ids) + 1):
                if self.token_ids[i: i + len(ids)] == ids:
                    return i + len(ids)
        # The first </think> in the text closes the reasoning: one before it would be content,
        # after which nothing opens a reasoning.
        marker = p.format.think_end
        at = "".join(self.text_parts).find(marker) if marker else -1
        if at >= 0:
            done = at + len(marker)
            j = next((j for j, e in enumerate(self._text_ends[:end]) if e >= done), None)
            if j is not None:
                return j + 1
        return end

    def _counted(self):
        """A future done once the engine has counted an answer this reader cut at its call,
        else None. ``finish_early`` goes through the engine's inbox, which the owner thread
        reads between steps, so ``stats()`` read as ``chat()`` returned lagged it (running 1,
        the tokens past the call still counted). A call queued after it runs after it; a
        closed engine fails the future at once. At most one engine step's wait."""
        return self._core.call(lambda: None) if self._cut_early else None

    def cancel(self) -> None:
        """Abort the request now: it leaves the batch within one engine step."""
        if not self._done:
            self._done = True
            self._core.abort(self._req)

    def _time_out(self) -> RequestTimeoutError:
        """The reader's deadline passed: the request leaves now, counted as timed out (failed),
        as when the engine notices first."""
        if not self._done:
            self._done = True
            self._core.time_out(self._req)
        return RequestTimeoutError(f"request {self.request_id} exceeded its timeout")

    def __del__(self):
        try:
            self.cancel()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class AsyncStream(_StreamBase):
    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        if self._done:
            raise StopAsyncIteration
        if asyncio.get_running_loop() is not self._sink.loop:
            # Its items are delivered to the loop that opened it; waiting here would hang.
            self.cancel()
            raise InvalidRequestError(
                f"request {self.request_id}: an async stream is read on the event loop that opened it "
                "(this one was opened in another asyncio.run or thread); it is cancelled")
        try:
            item = await self._next_item()
        except BaseException:
            self.cancel()  # cancelled while waiting: free the slot
            raise
        return self._accept(item)

    async def _next_item(self):
        if self.deadline is None:
            return await self._sink.get()
        left = self.deadline - time.monotonic()
        if left > 0:
            # Not asyncio.wait_for: before Python 3.12 it swallows a cancel that arrives as
            # its get completes, and the caller's task.cancel() was lost (the request ran on).
            getter = asyncio.ensure_future(self._sink.get())
            try:
                done, _ = await asyncio.wait({getter}, timeout=left)
            finally:
                if not getter.done():
                    getter.cancel()
            if done:
                return getter.result()
        # Past the deadline, what arrived in time is still the caller's (asyncio.wait_for with
        # no time left cancels even a get that has an item ready); a wait only times out.
        await asyncio.sleep(0)  # deliveries already scheduled on this loop land first
        item = self._sink.get_nowait()
        if item is None:
            raise self._time_out()
        return item

    async def collect(self) -> RequestOutput:
        async with self:
            async for _ in self:
                pass
        if (counted := self._counted()) is not None:
            settled = asyncio.wrap_future(counted)
            try:
                await asyncio.wait([settled])
            finally:
                # Its outcome does not matter (a closed engine fails it), but read it, or
                # cancel it if the caller gave up first: an exception nobody retrieved is
                # logged as an error when the future is freed.
                if not settled.done():
                    settled.cancel()
                elif not settled.cancelled():
                    settled.exception()
        return self._output()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.cancel()


class SyncStream(_StreamBase):
    def __iter__(self):
        return self

    def __next__(self) -> StreamDelta:
        if self._done:
            raise StopIteration
        try:
            if self.deadline is None:
                item = self._sink.get()
            else:
                left = self.deadline - time.monotonic()
                try:
                    # A wait past threading.TIMEOUT_MAX (292 years) is an OverflowError.
                    item = self._sink.get(timeout=min(max(left, 0.0) or 1e-6, threading.TIMEOUT_MAX))
                except queue.Empty:
                    raise self._time_out() from None
        except BaseException:
            self.cancel()
            raise
        return self._accept(item)

    def collect(self) -> RequestOutput:
        with self:
            for _ in self:
                pass
        if (counted := self._counted()) is not None:
            concurrent.futures.wait([counted])  # its outcome does not matter
        return self._output()

    def close(self) -> None:
        self.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()
