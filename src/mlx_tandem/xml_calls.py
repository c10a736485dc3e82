"""Qwen3-Coder's XML tool-call body (Qwen3.5's native syntax): Lark rules that hold it to
the tools' schemas, and the reading of its values back into arguments.

A call in this syntax, as Qwen3.5's chat template writes one::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

``xml_body_rules`` writes the rule ``body`` (from ``<function=`` to ``</function>``) so that
a forced call, or one the model opens under tool_choice="auto", is held to the listed tools
in the model's own syntax instead of a JSON body it was not trained on. ``read_arguments``
reads the values back by the same rules:

- A string parameter is raw text, not quoted: anything but text holding ``</parameter>``
  (mlx-lm's parser cuts there) or the call's end marker (chat_output.py ends the call
  there), or spelling ``null`` in any case (the parser reads None). Its ``pattern``,
  ``minLength`` (up to ``_MAX_MIN_LENGTH``), ``maxLength`` (up to ``_MAX_LENGTH``) and the
  formats in ``_FORMATS`` hold (a pattern's ``\\d`` and ``\\w`` ASCII, as ECMA-262 reads
  them: ``ascii_classes``). Enum and const values are literals, booleans and nulls
  in either spelling (below).
- Numbers, objects and arrays are JSON text; the JSON grammar holds their schemas. A
  number without bounds is held to 16 digits and a two-digit exponent (``1e999`` reads as
  infinity). A boolean is ``true``/``false`` or Python's ``True``/``False``, and a null
  ``null`` or ``None``: Qwen3.5's template writes scalars with Python's ``str``,
  Qwen3.6's with JSON.
- A union (``anyOf``, ``oneOf``, a list of types) is any of its branches; an ``allOf``
  whose branches constrain different keywords is one schema. A value without a type is
  a JSON object or array, a null, or text.
- Parameters come in the schema's order: required ones always, optional ones may be left
  out, as llguidance orders a JSON object's keys. Only listed parameters.

A string inside a JSON-valued parameter (a list of strings, a nested model) may not spell
``</parameter>`` or the end marker either: marker_free.py adds a pattern to each, since
llguidance's JSON grammar takes no exclusions. Not held: a free-form object's keys; a
``minLength`` or ``maxLength`` over the caps above. Not expressible, so such tools keep a JSON body
(``xml_expressible``): parameters that are not a closed object with ``properties`` (a
top-level union, ``patternProperties``, a free-form object), and names the parser cannot
read back (whitespace, ``<`` or ``>``).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional, Sequence

from .marker_free import marker_free_schema
from .pattern_witness import shortest_match

# What closes a raw string value: closing mode (closing.py) writes it out whole, since no
# single token of a free-text value shows progress towards it.
PARAMETER_END = "\n</parameter>\n"
_NAME_UNREADABLE = re.compile(r"[\s<>]")
_JSON_KINDS = ("integer", "number", "boolean", "object", "array")
_NUMERIC = {"integer": r"-?(0|[1-9][0-9]{0,15})",
            "number": r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,2})?"}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# llguidance 1.9.1's lexer runs out of expressions ("too many expressions constructed", the
# request failed) intersecting a bounded repeat over about 35 characters with a raw value's
# exclusions: a larger maxLength is left to the tool.
_MAX_LENGTH = 16
# A larger minLength ran llguidance out of fuel ("fuel exhausted"); left to the tool.
_MAX_MIN_LENGTH = 500
_MAX_DEPTH = 16
# String formats a raw value is held to (on top of schema_prep.py's date patterns, which
# check the date and leave the rest to llguidance's own format check in a JSON body).
_CLOCK = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?"
_OFFSET = r"([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_FORMATS = {
    # RFC 3339's, as a JSON body's: an offset (one left optional let AwareDatetime go without).
    "date-time": rf"[0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}}[Tt ]{_CLOCK}{_OFFSET}",
    "time": rf"{_CLOCK}{_OFFSET}?",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[^@\s<>]+@[^@\s<>.]+(\.[^@\s<>.]+)+",
}


def xml_expressible(tools: Sequence[dict], names: Sequence[str]) -> bool:
    """Can every named tool's call be written in this syntax (see the module docstring)?"""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    for name in names:
        params = by_name[name].get("parameters") or {"type": "object", "properties": {}}
        props = params.get("properties")
        if _NAME_UNREADABLE.search(name) or not isinstance(props, dict):
            return False  # no properties: a free-form object
        if params.get("type", "object") != "object" or any(
                k in params for k in ("anyOf", "oneOf", "allOf", "$ref", "patternProperties")):
            return False
        if params.get("additionalProperties", False) is not False:
            return False  # keys the grammar could not name
        if any(not isinstance(k, str) or not k or _NAME_UNREADABLE.search(k) for k in props):
            return False
        if any(not isinstance(v, dict) for v in props.values()):
            return False  # a boolean subschema: the JSON body reads those
        required = params.get("required", [])
        if not isinstance(required, list) or any(not isinstance(k, str) or k not in props for k in required):
            return False
    return True


def xml_body_rules(tools: Sequence[dict], names: Sequence[str], *, json_style: dict, prepare,
                   end_marker: str) -> tuple[str, tuple[str, ...]]:
    """Lark rules defining ``body``, one call of any of ``names``, and closing-mode hints:
    the end of a value (and witnesses of its pattern or minLength), ``</function>``, and the
    opening of each required parameter, which closing mode writes out whole where the
    grammar takes it (closing.py, ``text_markup``): a greedy walk wrote every optional
    parameter whose name shares a first token with a required one.

    ``prepare``: schema_prep.py's schema preparation (formats as patterns, closed objects),
    applied to each tool's parameters as the JSON body applies it. ``end_marker``: the
    format's ``</tool_call>``, which a raw value may not spell either."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    rules = _Rules(json_style, end_marker)
    choices = []
    for name in names:
        params = prepare(by_name[name].get("parameters") or {"type": "object", "properties": {}})
        defs = _defs(params)
        required = set(params.get("required", []))
        rules.hints += [f"<parameter={key}>\n" for key in params.get("properties", {}) if key in required]
        items = []
        for key, schema in params.get("properties", {}).items():
            rule, opening = rules.fresh("param"), json.dumps(f"<parameter={key}>\n")
            rules.lines.append(f"{rule}: {opening} {rules.value(schema, defs)}")
            items.append(rule if key in required else f"{rule}?")
        call, opening = rules.fresh("call"), json.dumps(f"<function={name}>\n")
        rules.lines.append(f"{call}: {opening} {' '.join(items)} \"</function>\"")
        choices.append(call)
    lines = [f"body: {' | '.join(choices)}", *rules.lines]
    return "\n".join(lines), (PARAMETER_END, "</function>", *dict.fromkeys(rules.hints))


class _Rules:
    """Collects the Lark rules and terminals of one body."""

    def __init__(self, json_style: dict, end_marker: str):
        self.lines: list[str] = []
        self.hints: list[str] = []
        self._style = json_style
        self._end_marker = end_marker
        self._n = 0

    def fresh(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def value(self, schema: Any, defs: dict, depth: int = 0) -> str:
        """A Lark expression for one parameter's value and the end of its parameter."""
        end = json.dumps(PARAMETER_END)
        schema = _flatten(schema, defs)
        if schema is None or depth > _MAX_DEPTH:
            return self._text({})
        if "const" in schema or isinstance(schema.get("enum"), list):
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if values and all(isinstance(v, (str, int, float, bool)) or v is None for v in values):
                return self._choice([_literal(t) for v in values for t in _spellings(v)])
            return f"{self._json(schema, defs)} {end}"
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._union([{**schema, "type": k} for k in kind if isinstance(k, str)], defs, depth)
        branches = schema.get("anyOf") or schema.get("oneOf")
        if kind is None and isinstance(branches, list):
            return self._union(branches, defs, depth)
        if kind == "string":
            return self._text(schema)
        if kind == "null":
            return f"({_literal('null')} | {_literal('None')})"
        if kind in _NUMERIC and not any(k in schema for k in _BOUNDS):
            return f"/{_NUMERIC[kind]}/ {end}"
        if kind == "boolean":
            return f"/[tT]rue|[fF]alse/ {end}"
        if kind in _JSON_KINDS or "allOf" in schema or "$ref" in schema:  # a $ref not resolved here
            return f"{self._json(schema, defs)} {end}"
        # Any value (no type): an object or array as JSON, else the text (as _read reads it).
        containers = {"anyOf": [{"type": "object"}, {"type": "array"}]}
        return f"({self._json(containers, {})} {end} | {self.value({'type': 'null'}, defs)} | {self._text({})})"

    def _choice(self, literals: list[str]) -> str:
        """An alternation of literals as one terminal: llguidance refuses a grammar row of
        over 2,000 items, and as rules a 2,500-value enum failed the call at its first
        token; one lexeme is one item however many values it holds."""
        name = self.fresh("CHOICE")
        self.lines.append(f"{name}: " + " | ".join(dict.fromkeys(literals)))
        return name

    def _union(self, branches: list, defs: dict, depth: int) -> str:
        name = self.fresh("value")
        self.lines.append(f"{name}: " + " | ".join(self.value(b, defs, depth + 1) for b in branches))
        return name

    def _json(self, schema: dict, defs: dict) -> str:
        whole = marker_free_schema({**defs, **schema}, ("</parameter>", self._end_marker))
        return f"%json {json.dumps({**whole, 'x-guidance': self._style})}"

    def _text(self, schema: dict) -> str:
        """A terminal for a raw string value and the end of its parameter (see the module
        docstring): one lexeme, so the value cannot end anywhere but at that end."""
        parts = [r"/(.|\n)*/", "~/[nN][uU][lL][lL]/"]
        parts += ["~" + lark_regex(rf"(.|\n)*{re.escape(m)}(.|\n)*") for m in ("</parameter>", self._end_marker) if m]
        if isinstance(schema.get("pattern"), str):
            parts.append(lark_regex(_anchored(schema["pattern"])))
        if isinstance(schema.get("format"), str) and schema["format"] in _FORMATS:
            parts.append(lark_regex(_FORMATS[schema["format"]]))  # a whole value
        low, high = schema.get("minLength"), schema.get("maxLength")
        low = low if isinstance(low, int) and not isinstance(low, bool) and 0 < low <= _MAX_MIN_LENGTH else 0
        high = high if isinstance(high, int) and not isinstance(high, bool) and 0 <= high <= _MAX_LENGTH else None
        if low or high is not None:
            parts.append(f"/(.|\\n){{{low},{'' if high is None else high}}}/")
        witness = shortest_match(schema["pattern"]) if isinstance(schema.get("pattern"), str) else None
        if witness or low:
            self.hints.append((witness or "x" * low) + PARAMETER_END)
        name = self.fresh("TEXT")
        self.lines.append(f"{name}: ({' & '.join(parts)}) {json.dumps(PARAMETER_END)}")
        return name


# ------------------------------------------------------------------------------ reading
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


def _spellings(value: Any) -> list[str]:
    """How the grammar writes an enum or const value: strings raw; booleans and null as
    JSON or as Python's ``str`` (Qwen3.5's template), numbers as JSON."""
    if isinstance(value, str):
        return [value]
    if value is None or isinstance(value, bool):
        return [json.dumps(value), str(value)]
    return [json.dumps(value)]


# ------------------------------------------------------------------------------ helpers
def _defs(parameters: dict) -> dict:
    return {k: parameters[k] for k in ("$defs", "definitions") if isinstance(parameters.get(k), dict)}


def _flatten(schema: Any, defs: dict) -> Optional[dict]:
    """``schema`` with a local ``$ref`` resolved and an ``allOf`` merged where its branches
    constrain different keywords (Pydantic v1's wrapper for a description beside a
    ``$ref``; {"type": "string"} with {"maxLength": 3}); None if not a schema."""
    for _ in range(_MAX_DEPTH):
        if not isinstance(schema, dict):
            return None
        ref, wrapped = schema.get("$ref"), schema.get("allOf")
        if isinstance(ref, str) and isinstance(target := _resolve(ref, defs), dict):
            schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        elif isinstance(wrapped, list) and _mergeable(schema, wrapped):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for branch in wrapped:
                merged.update(branch)
            schema = merged
        else:
            return schema
    return schema


def _mergeable(schema: dict, branches: list) -> bool:
    """Can an ``allOf`` be read as one schema: its branches (and the schema beside them)
    constrain disjoint keywords ({"type": "string"} and {"maxLength": 3})?"""
    if not branches or not all(isinstance(b, dict) for b in branches):
        return False
    seen = {k for k in schema if k not in ("allOf", *_ANNOTATIONS)}
    for branch in branches:
        keys = {k for k in branch if k not in _ANNOTATIONS}
        if keys & seen or "allOf" in keys:
            return False
        seen |= keys
    return True


_ANNOTATIONS = ("title", "description", "default", "examples", "$comment", "deprecated")


def _resolve(ref: str, defs: dict) -> Optional[Any]:
    for key in ("$defs", "definitions"):
        prefix = f"#/{key}/"
        if ref.startswith(prefix) and ref[len(prefix):] in defs.get(key, {}):
            return defs[key][ref[len(prefix):]]
    return None


def _literal(text: str) -> str:
    """A literal value and the end of its parameter, as one lexeme: beside a raw string in a
    union, llguidance's lexer follows the longer lexeme, and "null" then the end as two
    lexemes was lost to the string, which "null" may not be."""
    return json.dumps(text + PARAMETER_END)


def _anchored(pattern: str) -> str:
    """A JSON Schema pattern (unanchored, ECMA-262) as a whole-value regex: each top-level
    alternative is anchored on its own (``^a|b$``: starts with a, or ends with b), after
    leading inline flags such as ``(?i)``. Anchors inside a group are left to the regex
    engine (Lark's regex then holds them only at the value's ends)."""
    pattern = ascii_classes(pattern)
    flags = re.match(r"\(\?[a-zA-Z]+\)", pattern)
    head = flags.group(0) if flags else ""
    return head + "|".join(_anchored_branch(b) for b in _top_level_branches(pattern[len(head):]))


_ASCII = {"d": ("[0-9]", "0-9"), "w": ("[A-Za-z0-9_]", "A-Za-z0-9_"), "D": ("[^0-9]", None),
          "W": ("[^A-Za-z0-9_]", None)}


def ascii_classes(pattern: str) -> str:
    """``\\d``, ``\\w`` (and outside a class ``\\D``, ``\\W``) as ECMA-262 reads them in a JSON
    Schema pattern: ASCII. A raw value's pattern goes to llguidance as a Lark regex (Rust's
    syntax), whose classes are Unicode, and the model wrote Arabic-Indic and fullwidth
    digits into dates and durations that Pydantic refused (a fuzz, 2026-11-30)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            ascii_form = _ASCII.get(pattern[i + 1])
            form = ascii_form and ascii_form[1 if in_class else 0]
            out.append(form or pattern[i:i + 2])
            i += 2
            continue
        if in_class and ch == "]":
            in_class = False
        elif not in_class and ch == "[":
            in_class = True
            out.append(ch)
            i += 1
            for lead in ("^", "]"):  # a "]" first in a class is a literal
                if pattern[i:i + 1] == lead:
                    out.append(lead)
                    i += 1
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _anchored_branch(body: str) -> str:
    start = body.startswith("^")
    backslashes = len(body[:-1]) - len(body[:-1].rstrip("\\")) if body.endswith("$") else 0
    end = body.endswith("$") and backslashes % 2 == 0 and len(body) > int(start)
    core = f"({body[int(start):len(body) - int(end)]})"
    return ("" if start else "(.|\\n)*") + core + ("" if end else "(.|\\n)*")


def _top_level_branches(body: str) -> list[str]:
    """``body`` split at its ``|`` outside groups, character classes and escapes."""
    branches, depth, in_class, i, cut = [], 0, False, 0, 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            i += 1
            if body[i:i + 1] == "^":
                i += 1
            if body[i:i + 1] == "]":  # a "]" first in a class is a literal
                i += 1
            continue
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)
        elif ch == "|" and depth == 0:
            branches.append(body[cut:i])
            cut = i + 1
        i += 1
    return branches + [body[cut:]]


def lark_regex(pattern: str) -> str:
    """``pattern`` as a Lark regex literal: each ``/`` escaped once (an escaped ``\\/`` is
    left as it is)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        out.append("\\/" if pattern[i] == "/" else pattern[i])
        i += 1
    return "/" + "".join(out) + "/"
