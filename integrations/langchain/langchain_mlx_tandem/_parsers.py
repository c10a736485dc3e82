"""Structured-output parsers that refuse an answer cut at ``max_tokens``.

langchain-core's JSON parsers read partial JSON leniently (they close what is open), so an
answer cut by the token budget, ``{"a": -``, would parse as ``{}`` and reach the caller as
a result, with required keys missing. Constrained decoding guarantees a complete document
whenever the answer ends by itself; one that ended with ``finish_reason="length"`` is an
``OutputParserException`` (with ``include_raw=True``: ``parsing_error``), as LlamaIndex's
structured predict and OpenAI's ``parse`` API treat it. Streaming partial results
(``partial=True``) are unchanged.
"""

from __future__ import annotations

from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import (JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser,
                                           PydanticToolsParser)


def _refuse_cut(result: list) -> None:
    message = getattr(result[0], "message", None) if result else None
    finish = (getattr(message, "response_metadata", None) or {}).get("finish_reason")
    if finish == "length":
        text = message.content if isinstance(message.content, str) else ""
        raise OutputParserException(
            "the answer was cut at max_tokens (finish_reason 'length') before its JSON was complete; "
            "raise max_tokens", llm_output=text)


class _WholeAnswer:
    def parse_result(self, result: list, *, partial: bool = False) -> Any:
        if not partial:
            _refuse_cut(result)
        return super().parse_result(result, partial=partial)


class WholeJsonParser(_WholeAnswer, JsonOutputParser):
    pass


class WholePydanticParser(_WholeAnswer, PydanticOutputParser):
    pass


class WholePydanticToolsParser(_WholeAnswer, PydanticToolsParser):
    pass


class WholeJsonKeyToolsParser(_WholeAnswer, JsonOutputKeyToolsParser):
    pass
