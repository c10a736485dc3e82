"""Qwen3-Coder's XML tool-call body (Qwen3.5's native syntax) as Lark rules over the tools' schemas.

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

This module writes the rule ``body`` (from ``<function=`` to ``</function>``) so that a
forced call, or one the model opens under tool_choice="auto", is held to the listed tools
in the model's own syntax instead of a JSON body it was not trained on. Every value is one
that mlx-lm's ``qwen3_coder`` parser (mlx-lm 0.32) reads back as a value of its parameter's
schema, which sets the rules:

- A string parameter is raw text, not quoted: anything but text holding ``</parameter>``
  (the parser cuts there) or the call's end marker (chat_output.py ends the call there),
  or spelling ``null`` in any case (the parser reads None). Its
  ``enum``, ``const``, ``pattern``, ``minLength`` and ``maxLength`` (up to ``_MAX_LENGTH``)
  hold; its ``format`` holds where constraints.py turns it into a pattern (dates, times).
- Numbers, objects and arrays are JSON text, which is what the parser converts
  (``int(float(v))``, ``json.loads``); the JSON grammar holds their schemas. A number
  without bounds is held to what a float reads back (``_NUMERIC``). A boolean is
  ``true`` or ``false``, or ``True`` or ``False`` as Qwen's template writes Python's.
- A union (``anyOf``, ``oneOf``, a list of types) is any of its branches.
- Parameters come in the schema's order: required ones always, optional ones may be left
  out, as llguidance orders a JSON object's keys. Only listed parameters.

Not expressible here, so such requests keep a JSON body (``xml_expressible``): parameters
that are not an object with ``properties`` (a top-level ``anyOf``, ``patternProperties`` or
``additionalProperties`` alone), and names the parser cannot read back (whitespace, ``<``
or ``>``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence

from .pattern_witness import shortest_match

# What closes a raw string value: closing mode (closing.py) writes it out whole, since no
# single token of a free-text value shows progress towards it.
PARAMETER_END = "\n</parameter>\n"
_NAME_UNREADABLE = re.compile(r"[\s<>]")
_SCALARS = ("integer", "number", "boolean", "object", "array")
# The parser reads a number through a float (``int(float(v))`` for an integer): an unbounded
# JSON number such as 2E888888888 became infinity and failed the call. Unbounded numbers
# are held to what a float reads exactly enough (16 digits, a two-digit exponent); bounded
# ones keep llguidance's range grammar, which writes no exponent.
_NUMERIC = {"integer": r"-?(0|[1-9][0-9]{0,15})",
            "number": r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,2})?"}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# A maxLength above this is left out of the grammar (a bounded repeat that large costs
# llguidance a large automaton): such a value may run longer than its schema allows.
_MAX_LENGTH = 1000
_MAX_REF_DEPTH = 16


def xml_expressible(tools: Sequence[dict], names: Sequence[str]) -> bool:
    """Can every named tool's call be written in this syntax (see the module docstring)?"""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    for name in names:
        params = by_name[name].get("parameters") or {"type": "object", "properties": {}}
        props = params.get("properties", {})
        if _NAME_UNREADABLE.search(name) or not isinstance(props, dict):
            return False
        if params.get("type", "object") != "object" or any(
                k in params for k in ("anyOf", "oneOf", "allOf", "$ref", "patternProperties")):
            return False
        if not props and isinstance(params.get("additionalProperties"), dict):
            return False
        if any(not isinstance(k, str) or not k or _NAME_UNREADABLE.search(k) for k in props):
            return False
        required = params.get("required", [])
        if not isinstance(required, list) or any(k not in props for k in required):
            return False
    return True


class _Rules:
    """Collects the Lark rules and terminals of one body."""

    def __init__(self, json_style: dict, end_marker: str):
        self.lines: list[str] = []
        self._end_marker = end_marker
        self.hints: list[str] = []
        self._style = json_style
        self._n = 0

    def fresh(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def json_value(self, schema: dict, defs: dict) -> str:
        return f"%json {json.dumps({**defs, **schema, 'x-guidance': self._style})}"

    def text(self, schema: dict) -> str:
        """A terminal for a raw string value and the end of its parameter (see the module
        docstring): one lexeme, so the value cannot end anywhere but at that end."""
        parts = [r"/(.|\n)*/", "~/[nN][uU][lL][lL]/"]
        parts += ["~" + _regex(rf"(.|\n)*{re.escape(m)}(.|\n)*") for m in ("</parameter>", self._end_marker) if m]
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            parts.append(_regex(_anchored(pattern)))
            witness = shortest_match(pattern)
            if witness:
                self.hints.append(witness + PARAMETER_END)
        low = schema.get("minLength", 0)
        high = schema.get("maxLength")
        low = low if isinstance(low, int) and not isinstance(low, bool) and low > 0 else 0
        high = high if isinstance(high, int) and not isinstance(high, bool) and 0 <= high <= _MAX_LENGTH else None
        if low or high is not None:
            parts.append(f"/(.|\\n){{{low},{'' if high is None else high}}}/")
        name = self.fresh("TEXT")
        self.lines.append(f"{name}: ({' & '.join(parts)}) {json.dumps(PARAMETER_END)}")
        return name

    def value(self, schema: Any, defs: dict, depth: int = 0) -> str:
        """A Lark expression for one parameter's value and the end of its parameter."""
        end = json.dumps(PARAMETER_END)
        if not isinstance(schema, dict) or depth > _MAX_REF_DEPTH:
            return self.text({})
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = _resolve(ref, defs)
            if not isinstance(target, dict):
                return f"{self.json_value(schema, defs)} {end}"
            siblings = {k: v for k, v in schema.items() if k != "$ref"}
            return self.value({**target, **siblings}, defs, depth + 1)
        if "const" in schema or isinstance(schema.get("enum"), list):
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if values and all(isinstance(v, (str, int, float, bool)) or v is None for v in values):
                return f"({' | '.join(_literal(_as_text(v)) for v in values)})"
            return f"{self.json_value(schema, defs)} {end}"
        kind = schema.get("type")
        if isinstance(kind, list):
            branches = [{**schema, "type": k} for k in kind if isinstance(k, str)]
            return self._union(branches, defs, depth)
        for key in ("anyOf", "oneOf"):
            if kind is None and isinstance(schema.get(key), list) and schema[key]:
                return self._union(schema[key], defs, depth)
        if kind == "string":
            return self.text(schema)
        if kind == "null":  # Qwen3.5's template writes Python's None (typed_arguments reads it)
            return f"({_literal('null')} | {_literal('None')})"
        if kind in _NUMERIC and not any(k in schema for k in _BOUNDS):
            return f"/{_NUMERIC[kind]}/ {end}"
        if kind == "boolean":  # the parser reads any case; Qwen's template writes Python's True
            return f"/[tT]rue|[fF]alse/ {end}"
        if kind in _SCALARS:
            return f"{self.json_value(schema, defs)} {end}"
        return self.text({})  # any value: the parser hands back the text

    def _union(self, branches: list, defs: dict, depth: int) -> str:
        name = self.fresh("value")
        self.lines.append(f"{name}: " + " | ".join(self.value(b, defs, depth + 1) for b in branches))
        return name


def xml_body_rules(tools: Sequence[dict], names: Sequence[str], *, json_style: dict, prepare,
                   end_marker: str) -> tuple[str, tuple[str, ...]]:
    """Lark rules defining ``body``, one call of any of ``names``, and closing-mode hints.

    ``prepare``: constraints.py's schema preparation (formats as patterns, closed objects),
    applied to each tool's parameters as the JSON body applies it. ``end_marker``: the
    format's ``</tool_call>``, which a raw value may not spell either (the output parser
    finds the end of a call by its text)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    rules = _Rules(json_style, end_marker)
    choices = []
    for name in names:
        params = prepare(by_name[name].get("parameters") or {"type": "object", "properties": {}})
        defs = {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}
        required = set(params.get("required", []))
        items = []
        for key, schema in params.get("properties", {}).items():
            rule, opening = rules.fresh("param"), json.dumps(f"<parameter={key}>\n")
            rules.lines.append(f"{rule}: {opening} {rules.value(schema, defs)}")
            items.append(rule if key in required else f"{rule}?")
        call, opening = rules.fresh("call"), json.dumps(f"<function={name}>\n")
        rules.lines.append(f"{call}: {opening} {' '.join(items)} \"</function>\"")
        choices.append(call)
    lines = [f"body: {' | '.join(choices)}", *rules.lines]
    return "\n".join(lines), (PARAMETER_END, *dict.fromkeys(rules.hints))


def _literal(text: str) -> str:
    """A literal value and the end of its parameter, as one lexeme: beside a raw string in a
    union, llguidance's lexer follows the longer lexeme, and "null" then the end as two
    lexemes was lost to the string, which "null" may not be."""
    return json.dumps(text + PARAMETER_END)


def _as_text(value: Any) -> str:
    """An enum or const value as the parser reads it back (strings raw, the rest JSON)."""
    return value if isinstance(value, str) else json.dumps(value)


def _anchored(pattern: str) -> str:
    """A JSON Schema pattern (unanchored, ECMA-262) as a whole-value regex. Anchors are
    read at its ends only: ``^a|b$`` is read as ``^(a|b)$``."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not pattern.endswith("\\$")
    core = f"({pattern[int(start):len(pattern) - int(end)]})"
    return ("" if start else "(.|\\n)*") + core + ("" if end else "(.|\\n)*")


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def _resolve(ref: str, defs: dict) -> Optional[Any]:
    for key in ("$defs", "definitions"):
        prefix = f"#/{key}/"
        if ref.startswith(prefix) and ref[len(prefix):] in defs.get(key, {}):
            return defs[key][ref[len(prefix):]]
    return None


def typed_arguments(arguments: dict, parameters: Any) -> dict:
    """``arguments`` as mlx-lm's ``qwen3_coder`` parser read them, with the values its
    conversion leaves as text read as JSON where the parameter takes no string.

    The parser (mlx-lm 0.32) converts a value by its schema's ``type`` only: a parameter
    without one (``Optional[int]`` is ``anyOf: [integer, null]``; a nested model is a
    ``$ref``) keeps "3" as the string "3" unless it is a JSON object or array, so a strict
    tool got a string for its integer. Where the schema admits no string, such a value is
    read as JSON; where it admits one, the text stays, as the model wrote it. ``None``
    (any case), which Qwen3.5's template writes for a null, is None where the schema
    admits null, as vLLM's parser reads it (mlx-lm's reads only ``null``).
    """
    if not isinstance(parameters, dict) or not isinstance(parameters.get("properties"), dict):
        return arguments
    defs = {k: parameters[k] for k in ("$defs", "definitions") if isinstance(parameters.get(k), dict)}
    out = dict(arguments)
    for key, value in arguments.items():
        schema = parameters["properties"].get(key)
        if not (isinstance(value, str) and isinstance(schema, dict)):
            continue
        if value.strip().lower() == "none" and _admits(schema, defs, "null", 0):
            out[key] = None
        elif not _admits(schema, defs, "string", 0):
            try:
                out[key] = json.loads(value)
            except (ValueError, RecursionError):
                pass
    return out


def _admits(schema: Any, defs: dict, kind: str, depth: int) -> bool:
    """Might a value of JSON type ``kind`` ("string" or "null") be valid for ``schema``
    (or is it unknown)?"""
    if not isinstance(schema, dict) or depth > _MAX_REF_DEPTH:
        return True
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return any(isinstance(v, str) if kind == "string" else v is None for v in values)
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, defs)
        return target is None or _admits(target, defs, kind, depth + 1)
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared == kind
    if isinstance(declared, list):
        return kind in declared
    branches = [b for key in ("anyOf", "oneOf") for b in (schema.get(key) or [])]
    if branches:
        return any(_admits(b, defs, kind, depth + 1) for b in branches)
    return True
