"""Qwen3-Coder's XML tool calls (Qwen3.5's native syntax, xml_calls.py) read back: a block
of calls split and normalized as the template writes one, the names the parser cut short,
and each value read by its parameter's schema the way the grammar writes it.

On top of mlx-lm's (0.32) ``qwen3_coder`` parser, which chat_output.py calls with each
normalized call; each function says which of its misreadings it goes around and why.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional, Sequence

from .xml_calls import _MAX_DEPTH, _defs, _flatten, _spellings


def read_arguments(arguments: dict, parameters: Any, body: str = "") -> dict:
    """A call's values, as mlx-lm's ``qwen3_coder`` parser hands them back when given no
    tools (each the raw text; None for ``null``), read by the parameter's schema the way
    ``xml_body_rules`` writes them. ``body``, the call's text, gives back the case a string
    parameter spelled "null" in (the parser lowers it: "Null" came back "null").

    Why not the parser's own conversion (mlx-lm 0.32, given the tools): it converts by a
    schema's ``type`` alone. ``Optional[int]`` (an ``anyOf``) came back as the string "3",
    an ``Optional[str]`` that looked like JSON as a dict, ``Literal[1, "one"]`` as "1",
    integers went through a float (17 digits read back changed; 400 failed the call), and
    ``True`` for an ``Optional[bool]`` stayed a string. Here a value is read as the first
    of its schema's branches (in the schema's order) that reads the text: an enum or const
    value the text spells (``True``/``true``, ``None``/``null`` alike), a string as the
    text, a null from ``null``/``None`` in any case, a boolean from ``true``/``false`` in
    any case, a number, object or array from JSON (or the Python literal that Qwen3-Coder's
    older template wrote for a dict); a value without a type is an object or array where
    the text is one, else the text. What no branch reads stays text, for the tool to refuse.
    """
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(props, dict):
        return arguments
    defs = _defs(parameters)
    nulls = _null_spellings(body)
    return {key: _read(value, props[key], defs, nulls.get(key, "null")) if key in props else value
            for key, value in arguments.items()}


# mlx-lm's (0.32) qwen3_coder parser reads a header's name as its first run of characters
# other than whitespace, "<" and ">" (its ``_name_regex``), and a function's or parameter's
# text up to its closing tag.
_PARSER_NAME = re.compile(r"\s*([^\s<>]+)")
_FUNCTION = re.compile(r"<function=(.*?)</function>$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)</parameter>", re.DOTALL)
# Where a header's name ends: at its ">" (or, with none, a line break or the next tag).
_NAME_END = re.compile(r"[ \t]*(?:>|(?=\n|<|$))")


def reread_names(body: str, call: Any, tools: Optional[Sequence[dict]]) -> Any:
    """``call`` (mlx-lm's reading of the XML call ``body``, given no tools) with the names
    its headers spell. The parser ends a name at whitespace, "<" or ">", so a listed tool
    ``get weather`` written ``<function=get weather>`` came back as a call of ``get``, and
    another listed tool ran; a parameter ``max results`` came back as ``max``, its value the
    header's rest. The grammar cannot hold such names (``xml_expressible``), so under
    ``tool_choice="auto"`` the model writes them freely. Here a name the parser cut short
    is read as the listed name its header spells (a parameter's value then as the parser
    reads one: a line break off each end, ``null`` in any case None); a header that spells
    no listed name is a ValueError, so the call comes back invalid, never as another call.
    A call the parser read whole is returned as it is."""
    match = _FUNCTION.search(body)
    if not tools or not isinstance(call, dict) or match is None or not isinstance(call.get("name"), str):
        return call
    header = match.group(1)
    names = [t["function"]["name"] for t in tools]
    # The longest listed name the header spells: ``a>b`` over ``a`` where both are listed.
    name = _spelled(header, [*names, call["name"]])
    if name is None:
        raise ValueError(f"the call's header <function={_first_line(header)} names no listed tool")
    tool = next((t["function"] for t in tools if t["function"]["name"] == name), {})
    parameters = tool.get("parameters")
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    props = props if isinstance(props, dict) else {}
    arguments, misread = {}, name != call["name"]
    for block in _PARAMETER.finditer(header):
        text = block.group(1)
        parsed = _PARSER_NAME.match(text)
        if parsed is None:
            continue  # the parser skips a parameter without a name too
        read = parsed.group(1)
        ends = _NAME_END.match(text, parsed.end())
        spelled = None if ends and read in props else _spelled(text, list(props))
        if spelled is None and not ends:
            raise ValueError(f"the call's header <parameter={_first_line(text)} names no parameter of {name!r}")
        key = spelled or read
        misread |= key != read
        value = text[_NAME_END.match(text, len(text) - len(text.lstrip()) + len(key)).end():]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = None if value.lower() == "null" else value
    return {**call, "name": name, "arguments": arguments} if misread else call


# Where a call may end: a ``</function>`` followed, past white space, by the next call or
# the block's end.
_CALL_END = re.compile(r"</function>(?=\s*(?:<function=|\Z))")
_BARE_CALL = re.compile(r"<function=[^<>\n]*>\s*\Z")  # a call of no parameters, up to its end
# A CR before a line break that frames a tag: after a header or closing tag, or before a tag.
_CRLF_AFTER_TAG = re.compile(r"(<(?:function|parameter)=[^<>\r\n]*>|</(?:function|parameter)>)\r\n")
_CRLF_CALL = re.compile(r"<function=[^<>\r\n]*>\r\n")  # the call's framing, read off its header
_CRLF_BEFORE_TAG = re.compile(r"\r\n(?=</?(?:function|parameter)[=>])")
# A header with white space before its ">": no name ends in it.
_LOOSE_HEADER = re.compile(r"(<(?:function|parameter)=[^<>\n]*?[^\s<>])[ \t]+>")


def split_calls(body: str) -> list[str]:
    """The calls of a free-written call block (the text between ``<tool_call>`` and
    ``</tool_call>``), each as written, from its ``<function=``; [] where there is none.
    ``normalized_call`` rewrites one as the template writes it, for mlx-lm's (0.32)
    parser and the readers here. The parser takes the text from the first ``<function=``
    to a ``</function>`` at the text's end (or before one final "\n"), so models' variants
    that vLLM's parser reads came back wrong (review h161):

    - Two calls in one block (Qwen3-Coder writes them) read as one call of the first tool
      with both calls' values; here each is a call. A call ends at a ``</function>`` right
      after a ``</parameter>`` (or after its header, for a call of no parameters) that the
      next ``<function=`` or the block's end follows. No value can hold ``</parameter>``
      (the grammar keeps it out, and the parser would cut the value there), so a value
      holding ``</function><function=...`` stays one value (review h162: it fired a call
      of another tool).
    - Anything but one "\n" after ``</function>`` (a blank line, a space: "\n\n" is one
      token) made the call invalid, "No function provided".
    - A call with no ``</function>`` was invalid; it runs to the block's end. (One cut off
      by max_tokens is still reported cut off: chat_output.py.)
    """
    calls = []
    start = body.find("<function=")
    while start != -1:
        end = next((m.end() for m in _CALL_END.finditer(body, start) if _closes_call(body[start:m.start()])), None)
        if end is None:
            calls.append(body[start:])
            break
        calls.append(body[start:end])
        start = body.find("<function=", end)
    return calls


def _closes_call(text: str) -> bool:
    """Can a ``</function>`` after ``text`` (a call so far) be the call's end?"""
    text = text.rstrip()
    return text.endswith("</parameter>") or bool(_BARE_CALL.match(text + "\n"))


def normalized_call(call: str) -> str:
    """One call of ``split_calls`` as the template writes it:

    - ``</function>`` at its end, added where the model left it out;
    - a last parameter with no ``</parameter>`` closed where the call ends (it was dropped,
      ``{}`` came back valid). One whose value runs into the next ``<parameter=`` is not
      split there, as vLLM splits it: a value may hold a line that spells a parameter's tag
      (the grammar allows it), and the two readings cannot be told apart;
    - no white space before a header's ">" (``<parameter=city >`` put " >" in the value),
      in the headers the parser reads only, never inside a value;
    - CRLF line breaks between the tags (a model trained on Windows text; the parser found
      no ``</function>`` at the end) read as LFs, in a call whose header ends in CRLF only:
      an LF call's value may end in a CR of its own. A CR inside a value stays."""
    text = call.rstrip()
    text = text[:-len("</function>")] if text.endswith("</function>") else text
    if _CRLF_CALL.match(call):
        text = _CRLF_BEFORE_TAG.sub("\n", _CRLF_AFTER_TAG.sub("\\1\n", text))
    parts, at = [], 0
    if header := _LOOSE_HEADER.match(text):  # the call's own
        parts.append(header.group(1) + ">")
        at = header.end()
    # The parameter headers the parser reads: the first <parameter= after the call's header
    # and after each </parameter> (its regex matches from there to the next </parameter>).
    while (opened := text.find("<parameter=", at)) != -1:
        if header := _LOOSE_HEADER.match(text, opened):
            parts.append(text[at:opened] + header.group(1) + ">")
            at = header.end()
        closed = text.find("</parameter>", max(at, opened))
        if closed == -1:  # the last parameter, left open: it ends with the call
            value = text[at:]
            parts.append(value + ("" if value.endswith("\n") else "\n") + "</parameter>")
            at = len(text)
            break
        parts.append(text[at:closed + len("</parameter>")])
        at = closed + len("</parameter>")
    parts.append(text[at:])
    body = "".join(parts)
    return body + ("" if body.endswith("\n") else "\n") + "</function>"


# A call's opening tag and what follows it, for an invalid call's report: the name up to
# the tag's ">" (spaces kept, unlike the parser's reading), whether or not the call closed.
_FUNCTION_HEADER = re.compile(r"\s*<function=([^>\n]+)>\n?(.*)", re.DOTALL)


def function_header(body: str) -> Optional[tuple[str, str]]:
    """(name, the text after its tag) of an XML call that begins ``<function=NAME>``, else None."""
    match = _FUNCTION_HEADER.match(body)
    return (match.group(1), match.group(2)) if match else None


def _spelled(header: str, names: Sequence[str]) -> Optional[str]:
    """The longest of ``names`` that ``header`` (a tag's text after "=") spells whole."""
    text = header.lstrip()
    offset = len(header) - len(text)
    return max((n for n in names if n and text.startswith(n) and _NAME_END.match(header, offset + len(n))),
               key=len, default=None)


def _first_line(text: str) -> str:
    return text.lstrip().split("\n", 1)[0][:80]


_UNREAD = object()
# A parameter whose text is "null" in some case, as mlx-lm's parser cuts it (one newline
# each side); its name as written (whole where it holds a space: reread_names reads it so).
_NULL_PARAMETER = re.compile(r"<parameter=\s*([^\n<>]*[^\s<>])[ \t]*>?\n?((?i:null))\n?</parameter>")


def _null_spellings(body: str) -> dict:
    """Each parameter of ``body`` written as "null" in some case, with its spelling: the
    parser hands all of them back as None, and a string parameter keeps the text written."""
    return {m.group(1): m.group(2) for m in _NULL_PARAMETER.finditer(body)}


def _read(value: Any, schema: Any, defs: dict, null_text: str = "null") -> Any:
    if value is None:  # the parser reads "null" in any case as None; a string may be "Null"
        if _takes_null(schema, defs):
            return None
        got = _read_text(null_text, schema, defs)
        return None if got is _UNREAD else got
    if not isinstance(value, str):
        return value
    if value.strip().lower() == "none" and _takes_null(schema, defs):
        return None  # Python's None where the schema admits null, as vLLM's parser reads it
    got = _read_text(value, schema, defs)
    if got is _UNREAD:
        # A raw line break or tab inside a JSON string (a multi-line value written free-hand;
        # mlx-lm's own typed reading takes it), where no branch reads the text as written:
        # a union with a string branch keeps the text, which only that branch could write.
        got = _read_text(value, schema, defs, strict=False)
    return value if got is _UNREAD else got


def _read_text(text: str, schema: Any, defs: dict, depth: int = 0, strict: bool = True) -> Any:
    """``text`` as a value of ``schema``, or ``_UNREAD``; ``strict``: JSON's control
    characters only escaped."""
    schema = _flatten(schema, defs)
    if schema is None or depth > _MAX_DEPTH:
        return text
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return next((v for v in values if text in _spellings(v)), _UNREAD)
    kind = schema.get("type")
    branches = ([{**schema, "type": k} for k in kind] if isinstance(kind, list)
                else schema.get("anyOf") or schema.get("oneOf") if kind is None else None)
    if isinstance(branches, list):
        for branch in branches:
            got = _read_text(text, branch, defs, depth + 1, strict)
            if got is not _UNREAD:
                return got
        return _UNREAD
    word = text.strip().lower()
    if kind == "string":
        return text
    if kind == "null":
        return None if word in ("null", "none") else _UNREAD
    if kind == "boolean":
        return word == "true" if word in ("true", "false") else _UNREAD
    read = _json_or_literal(text, strict)
    if kind is None:  # no type: an object or array where the text is one, else the text
        return read if isinstance(read, (dict, list)) else (None if word in ("null", "none") else text)
    if isinstance(read, float) and read.is_integer() and kind == "integer":
        read = int(read)  # "3.0" for an integer
    ok = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}.get(kind)
    return read if ok is not None and ok(read) else _UNREAD


def _takes_null(schema: Any, defs: dict, depth: int = 0) -> bool:
    """Is null among ``schema``'s values (any branch of a union)?"""
    schema = _flatten(schema, defs)
    if schema is None or depth > _MAX_DEPTH:
        return False
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return any(v is None for v in values)
    kind = schema.get("type")
    if kind is not None:
        return kind == "null" or (isinstance(kind, list) and "null" in kind)
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        return any(_takes_null(b, defs, depth + 1) for b in branches)
    return "allOf" not in schema and "$ref" not in schema  # no type: any value


def _json_or_literal(text: str, strict: bool = True) -> Any:
    try:
        return json.loads(text, strict=strict)
    except (ValueError, RecursionError):
        pass
    try:
        read = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _UNREAD
    return read if isinstance(read, (dict, list)) else _UNREAD
