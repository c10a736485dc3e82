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
in the model's own syntax instead of a JSON body it was not trained on.
``xml_call_reading.read_arguments`` reads the values back by the same rules:

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


# -------------------------------------------------- shared with the reading (xml_call_reading.py)
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
