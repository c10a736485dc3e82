"""Structured-output parsers that refuse an answer cut at ``max_tokens``.

langchain-core's JSON parsers read partial JSON leniently (they close what is open), so an
answer cut by the token budget, ``{"a": -``, would parse as ``{}`` and reach the caller as
a result, with required keys missing. Constrained decoding guarantees a complete document
whenever the answer ends by itself; one that ended with ``finish_reason="length"`` is an
``OutputParserException`` (with ``include_raw=True``: ``parsing_error``), as LlamaIndex's
structured predict and OpenAI's ``parse`` API treat it. A stream yields its partial results
as before and then raises the same exception when the cut chunk arrives, instead of ending
on a partial document; and a stream whose whole answer does not validate raises at its end,
as ``invoke`` does.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterator

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import BaseMessage
from langchain_core.output_parsers import (JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser,
                                           PydanticToolsParser)
from langchain_core.outputs import ChatGeneration, Generation


def _refuse_cut(message: Any) -> None:
    finish = (getattr(message, "response_metadata", None) or {}).get("finish_reason")
    if finish == "length":
        text = message.content if isinstance(message.content, str) else ""
        raise OutputParserException(
            "the answer was cut at max_tokens (finish_reason 'length') before its JSON was complete; "
            "raise max_tokens", llm_output=text)


def _refusing_cut(chunks: Iterator[Any]) -> Iterator[Any]:
    for chunk in chunks:
        _refuse_cut(chunk)
        yield chunk


async def _arefusing_cut(chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for chunk in chunks:
        _refuse_cut(chunk)
        yield chunk


def _summing(chunks: Iterator[Any], whole: list) -> Iterator[Any]:
    for chunk in chunks:
        whole[0] = chunk if whole[0] is None else whole[0] + chunk
        yield chunk


async def _asumming(chunks: AsyncIterator[Any], whole: list) -> AsyncIterator[Any]:
    async for chunk in chunks:
        whole[0] = chunk if whole[0] is None else whole[0] + chunk
        yield chunk


class _WholeAnswer:
    def parse_result(self, result: list, *, partial: bool = False) -> Any:
        if not partial and result:
            _refuse_cut(getattr(result[0], "message", None))
        return super().parse_result(result, partial=partial)

    def _transform(self, input: Iterator[Any]) -> Iterator[Any]:
        whole: list = [None]
        yield from super()._transform(_refusing_cut(_summing(input, whole)))
        self._parse_whole(whole[0])

    async def _atransform(self, input: AsyncIterator[Any]) -> AsyncIterator[Any]:
        whole: list = [None]
        async for value in super()._atransform(_arefusing_cut(_asumming(input, whole))):
            yield value
        self._parse_whole(whole[0])

    def _parse_whole(self, whole: Any) -> None:
        """The whole answer, parsed strictly once the stream ends. Core's stream yields only
        the partial results that parse, so an answer that never validated (a type whose schema
        does not say what it takes, such as ``Json[...]``) ended the stream with
        nothing and no error, where ``invoke`` raises."""
        if isinstance(whole, BaseMessage):
            self.parse_result([ChatGeneration(message=whole)])
        elif isinstance(whole, str):
            self.parse_result([Generation(text=whole)])


class WholeJsonParser(_WholeAnswer, JsonOutputParser):
    pass


class WholePydanticParser(_WholeAnswer, PydanticOutputParser):
    pass


class WholePydanticToolsParser(_WholeAnswer, PydanticToolsParser):
    pass


class WholeJsonKeyToolsParser(_WholeAnswer, JsonOutputKeyToolsParser):
    pass
