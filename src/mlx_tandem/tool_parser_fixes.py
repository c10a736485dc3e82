"""Where a tool parser of mlx-lm (0.32) misreads a call its own model writes, gone around
in one place. ``fixed(fmt, parser)`` is the parser the engine uses for format ``fmt``.

- ``longcat``: a call of no arguments, ``<longcat_tool_call>now</longcat_tool_call>``
  (what the model writes for a tool without parameters, as GLM-4.7 does, whose parser
  reads it), raised AttributeError: the parser looks for the name before the first
  ``<longcat_arg_key>`` only. Such a call came back invalid, and an agent could never
  call a tool without parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

Parser = Callable[[str, Any], Any]


def fixed(fmt: Optional[str], parser: Optional[Parser]) -> Optional[Parser]:
    fix = _FIXES.get(fmt or "")
    return fix(parser) if parser is not None and fix is not None else parser


def _longcat(parser: Parser) -> Parser:
    def parse(text: str, tools: Any = None) -> Any:
        body = text.strip()
        if "<longcat_arg_key>" not in body and (len(body.split()) == 1 or body in _names(tools)) \
                and not body.startswith("{"):
            return {"name": body, "arguments": {}}
        return parser(text, tools)  # prose is no call: the parser's error makes it an invalid one

    parse.__module__ = parser.__module__  # ChatFormat names the format by its parser's module
    return parse


def _names(tools: Any) -> list:
    return [t.get("function", {}).get("name") for t in tools or () if isinstance(t, dict)]


_FIXES: dict[str, Callable[[Parser], Parser]] = {"longcat": _longcat}
