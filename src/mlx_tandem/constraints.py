"""Grammar-constrained decoding: JSON schemas, forced tool calls, Lark and regex grammars.

Built on llguidance (Microsoft's grammar engine, also used by vLLM, SGLang and llama.cpp):
it computes a token mask from an Earley parser over the tokenizer's trie in ~50-100 us per
token, supports JSON Schema and Lark with embedded JSON, treats special tokens exactly,
and its Python API (LLMatcher) exposes consume/rollback/deep_copy, which the budget-aware
closing (closing.py) needs. Outlines-core and xgrammar were the alternatives; llguidance is
already a dependency of mlx-vlm and the only one with a Lark front end that embeds JSON.

Split across threads the way the engine is split: ``GrammarCompiler`` compiles on the
caller's thread (so a bad schema fails the call at once, with a typed error), and
``closing.GrammarProcessor`` runs on the owner thread as a per-row mlx-lm logits processor.

A constraint must also *finish* within the request's token budget, even on a model that
never wants to close a string (a random-weight model, or a real one in a loop). Near the
end of the budget the processor simulates a shortest-path completion on a copy of the
matcher; when the remaining budget only just covers it, the request is steered onto that
completion. So structured output is always valid JSON unless the budget is smaller than
the smallest valid answer (then finish_reason is "length").
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .chat_format import ChatFormat
from .closing import TokenClasses, token_classes
from .errors import ConstraintError
from .pattern_witness import schema_patterns, shortest_match, witnesses
from .schema_positions import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS
from .xml_calls import lark_regex, xml_body_rules, xml_expressible

logger = logging.getLogger(__name__)

# Compact JSON with the separators chat templates print: in-distribution for real models,
# and no free whitespace a looping model could fill its budget with.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the output must match. Build with the class methods."""

    kind: str  # "json_schema" | "lark" | "regex"
    source: str  # the schema (JSON text), grammar or pattern
    description: str = ""
    # Texts, as the output spells them, that get a string past its pattern: closing mode
    # writes one out where no single token shows progress (pattern_witness.py).
    hints: tuple[str, ...] = field(default=(), compare=False)
    # The grammar's structure is ordinary text (an XML call's ``</parameter>``,
    # ``</function>``; xml_calls.py), not JSON punctuation, so no closer token shows closing
    # mode the way out: it writes out the hints (markup every completion writes) first
    # wherever the grammar takes them (closing.py).
    text_markup: bool = field(default=False, compare=False)

    @classmethod
    def json_schema(cls, schema: dict | str, *, name: str = "") -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
            except RecursionError:
                raise ConstraintError("the JSON schema is nested too deeply") from None
        if not isinstance(schema, dict):
            raise ConstraintError("a JSON schema must be an object")
        text = _schema_text(lambda: _prepared_schema(schema))
        return cls("json_schema", text, name or "json_schema", _string_hints(text))

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json_schema", json.dumps({"type": "object"}), "json_object")

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        return cls("lark", grammar, "lark")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        if isinstance(pattern, str):
            refuse_dangling_escape(pattern)
        witness = shortest_match(pattern) if isinstance(pattern, str) else None
        return cls("regex", pattern, "regex", (witness,) if witness else ())


# Closing mode tries each hint on every free-text step it takes: keep them few.
_MAX_HINTS = 8


def _string_hints(schema_text: str) -> tuple[str, ...]:
    """Witnesses of a schema's string patterns, escaped as they appear inside a JSON string."""
    found = witnesses(schema_patterns(json.loads(schema_text)))[:_MAX_HINTS]
    return tuple(json.dumps(w, ensure_ascii=False)[1:-1] for w in found)


def _schema_text(build: Callable[[], Any]) -> str:
    """``build()``'s schema as JSON text; a schema too deep to walk, or holding what JSON
    cannot (NaN, objects, a cycle), is a ConstraintError."""
    try:
        return json.dumps(build(), allow_nan=False)
    except ConstraintError:
        raise
    except RecursionError:
        raise ConstraintError("the JSON schema is nested too deeply") from None
    except (TypeError, ValueError) as exc:
        raise ConstraintError(f"the JSON schema is not JSON data: {exc}") from None


# llguidance's date formats allow year 0000, a leap second :60 and February 29 in any year;
# Python's datetime (so Pydantic, and jsonschema's format checker) refuses all three. These
# patterns are intersected with the format by llguidance; a string with its own pattern
# keeps it.
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_FORMAT_PATTERNS = {
    "date": rf"^{_DATE}$",
    "date-time": rf"^{_DATE}[Tt ][0-9]{{2}}:[0-9]{{2}}:[0-5][0-9].*$",
    "time": r"^[0-9]{2}:[0-9]{2}:[0-5][0-9].*$",
}
#: The string formats llguidance 1.x holds; any other name fails its whole grammar.
_HELD_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                           "uuid"})


def _prepared_schema(schema: Any) -> Any:
    """The caller's schema as the grammar gets it; every output still validates against it.

    - ``additionalProperties`` defaults to false on objects that list their properties: it
      only forbids keys the schema did not name, and a tool never receives arguments it does
      not declare. Left open where closing would refuse what the schema allows, because
      other subschemas name keys too: an ``allOf`` branch (inline or a ``$defs`` entry it
      refers to), an ``anyOf``/``oneOf`` branch beside its parent's own properties, an object
      combined with such subschemas or a ``$ref``, and an object that requires a key it does
      not list.
    - ``date``, ``date-time`` and ``time`` strings also exclude year 0000 and second 60.
    - A ``format`` llguidance does not hold is dropped (an annotation, as JSON Schema allows
      validators to treat it), and so is ``uniqueItems``, which it cannot hold, and a
      ``multipleOf`` it refuses (0.07: it cannot scale it exactly).
    - A ``propertyNames`` that lists the keys (an enum or const) becomes those keys as
      optional properties, and no others (``_names_as_properties``).
    - Numeric bounds llguidance 1.9 would not hold as written are rewritten to ones it holds,
      or refused (``_held_bounds``).

    A ``$defs`` entry that is only a reference back to itself (through other such entries)
    describes no value: a ConstraintError, since llguidance compiled it into a grammar that
    rejected the model's tokens mid-answer, or ended a "stop" answer at ``{"a": ``.
    """
    out = _prepare(schema, open_defs=_defs_combined(schema), keep_open=False, defs=_local_defs(schema))
    _refuse_empty_ref_cycles(out)
    for pattern in schema_patterns(out):
        refuse_dangling_escape(pattern)
    return out


def refuse_dangling_escape(pattern: str) -> None:
    """A pattern ending in an unpaired backslash is not a regex (Python's ``re`` and
    ECMA-262 refuse it); llguidance 1.x dropped the backslash and held the answer to the
    rest (``[0-9]+\\`` answered "0")."""
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
        raise ConstraintError(f"invalid pattern {pattern!r}: it ends in an unpaired backslash")


# Keys that say nothing about the value: a schema of a $ref and these is the $ref alone.
_ANNOTATIONS = frozenset({"$ref", "title", "description", "default", "examples", "$comment", "deprecated"})


def _refuse_empty_ref_cycles(schema: Any) -> None:
    if not isinstance(schema, dict):
        return
    defs = _local_defs(schema)
    for start in defs:
        seen, ref = set(), start
        while isinstance(ref, str) and ref in defs:
            if ref in seen:
                raise ConstraintError(f"the schema's {start!r} is only a reference to itself: it describes no value")
            seen.add(ref)
            entry = defs[ref]
            if not (isinstance(entry, dict) and set(entry) <= _ANNOTATIONS):
                break
            ref = entry.get("$ref")


def _local_defs(schema: Any) -> dict[str, Any]:
    """The schema's ``$defs``/``definitions`` entries by their local pointer ("#/$defs/A")."""
    if not isinstance(schema, dict):
        return {}
    return {f"#/{key}/{name}": entry for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)
            for name, entry in schema[key].items()}


def _listed_names(names: Any, defs: dict[str, Any]) -> Optional[list[str]]:
    """The keys a ``propertyNames`` lists (an enum or const of strings, inline or through
    local ``$ref``s, as Pydantic writes ``dict[Literal[...], X]`` and ``dict[AnEnum, X]``);
    None where it does not list them."""
    for _ in range(8):
        if not (isinstance(names, dict) and isinstance(names.get("$ref"), str) and names["$ref"] in defs):
            break
        if set(names) - _ANNOTATIONS:  # a $ref beside other keywords: they restrict it too
            return None
        names = defs[names["$ref"]]
    if not isinstance(names, dict) or set(names) - _ANNOTATIONS - {"enum", "const", "type"} \
            or names.get("type", "string") != "string":
        return None  # other keywords (maxLength, pattern, not) restrict the names further
    values = [names["const"]] if "const" in names else names.get("enum")
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        return None
    return list(dict.fromkeys(values))


def _names_as_properties(out: dict, defs: dict[str, Any]) -> None:
    """An object whose ``propertyNames`` lists its keys, as the same keys listed as optional
    properties of the ``additionalProperties`` schema, and no others: the values it takes
    are the same. llguidance 1.x holds no ``propertyNames`` ("Unimplemented keys"), and
    every request with an enum-keyed dict failed."""
    names = _listed_names(out.get("propertyNames"), defs)
    if names is None or "patternProperties" in out or "unevaluatedProperties" in out:
        return
    value = out.get("additionalProperties", True)
    listed = out.get("properties") or {}
    required = out.get("required") or []
    if not isinstance(listed, dict) or not isinstance(required, list) or not set(required) <= set(names):
        return  # a key the names refuse is required: no object fits, and llguidance says so
    del out["propertyNames"]
    # A listed property keeps its own schema; the other names take additionalProperties'.
    out["properties"] = {k: listed[k] if k in listed else ({} if value is True else value)
                         for k in names if k in listed or value is not False}
    out["additionalProperties"] = False


def _defs_combined(schema: Any) -> set[str]:
    """Names of the ``$defs``/``definitions`` entries that an ``allOf`` (or an ``anyOf``/
    ``oneOf`` beside properties) refers to: they share their object with other subschemas."""
    names: set[str] = set()
    stack, visited = [schema], set()
    while stack:
        node = stack.pop()
        if id(node) in visited:  # a schema that holds itself: _prepare refuses it
            continue
        visited.add(id(node))
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key in ("allOf", "anyOf", "oneOf"):
                branches = node.get(key)
                if not isinstance(branches, list):
                    continue
                # A lone allOf branch is only a wrapper (Pydantic v1's description beside a
                # $ref): its object shares keys with nothing.
                shares = "properties" in node or (key == "allOf" and len(branches) > 1)
                if shares:
                    for b in branches:
                        ref = b.get("$ref") if isinstance(b, dict) else None
                        if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                            names.add(ref.rsplit("/", 1)[1])
            stack.extend(node.values())
    return names


@functools.lru_cache(maxsize=256)
def multiple_held(step: Any) -> bool:
    """Does llguidance take ``multipleOf: step`` (a number)?"""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "number", "multipleOf": step})
    except (ValueError, TypeError):
        return False
    return not llguidance.LLMatcher.validate_grammar(grammar)


_BOUND_KEYS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
#: llguidance 1.9 reads every bound as a double and an integer bound as a saturated int64.
#: The widest integer range it holds exactly: the int64 extremes that are doubles.
_INT_HELD = (-(2**63) + 1024, 2**63 - 1024)


def _bound_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)  # (an int past 1e308 has no float)


def _inside(bound: float, other: float) -> float:
    """The least number past ``bound`` (a whole number) toward ``other`` whose decimal
    llguidance can still write as a range: a step of 10**-k, a millionth of the range or
    less (the next double after 0 is 5e-324, whose range nests past llguidance's 250
    parentheses); never ``bound`` itself, which a float of a step too small rounds back to."""
    k = 6 - math.floor(math.log10(other - bound))
    if k > 200:
        raise ConstraintError(f"the range ({bound}, {other}) is narrower than the grammar can write: "
                              "its numbers need more than 200 places")
    return max(float(Fraction(bound) + Fraction(1, 10 ** k)), math.nextafter(bound, math.inf))


def _held_bounds(out: dict) -> None:
    """Rewrite numeric bounds into ones llguidance 1.9 holds exactly (in place).

    - An integer beyond 2**53 is rounded to a double: ``minimum: 2**53+1`` answered 2**53.
      Such a bound moves inward to the nearest double, so no invalid value gets in.
    - Integer ranges saturate to int64: ``minimum: 2**70, maximum: 2**70+3`` answered
      9223372036854775807, and both bounds below -2**63 crashed the process (SIGSEGV).
      Ranges reaching past int64 are narrowed to it; a range wholly beyond it, and a
      ``number`` bound of 2**63 or more (its grammar is built on int64 too), are refused.
    - ``exclusiveMinimum: n`` (an integer, n >= 0) with an upper bound below n + 1 also
      took the bare ``n`` ("0" for ``gt=0, lt=1e-3``), as ``exclusiveMaximum: n`` (n <= 0)
      with a lower bound above n - 1 took ``-n``: the bound becomes an inclusive one just
      inside it (``_inside``: the numbers within a millionth of the range from it are lost).
    """
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if not any(t in (None, "number", "integer") for t in types):
        return  # bounds say nothing of a string, an object, ...
    if any(isinstance(out.get(k), bool) for k in ("exclusiveMinimum", "exclusiveMaximum")):
        return  # draft 4's flags on minimum/maximum: left as written (llguidance reads them)
    lo = hi = None  # (value as an exact Fraction, exclusive)
    for key in _BOUND_KEYS:
        value = out.get(key)
        if not _bound_number(value):
            continue
        f, excl, lower = Fraction(value), key.startswith("exclusive"), key.endswith("inimum")
        cur = lo if lower else hi
        if cur is None or (f > cur[0] if lower else f < cur[0]) or (f == cur[0] and excl):
            if lower:
                lo = (f, excl)
            else:
                hi = (f, excl)
    if lo is None and hi is None:
        return
    if "integer" in types and "number" not in types:
        lo_i = None if lo is None else (math.floor(lo[0]) + 1 if lo[1] else math.ceil(lo[0]))
        hi_i = None if hi is None else (math.ceil(hi[0]) - 1 if hi[1] else math.floor(hi[0]))
        if all(b is None or abs(b) <= 2**53 for b in (lo_i, hi_i)):
            return
        if (lo_i is not None and lo_i > _INT_HELD[1]) or (hi_i is not None and hi_i < _INT_HELD[0]):
            raise ConstraintError(f"integer bounds [{lo_i}, {hi_i}] lie beyond +-{_INT_HELD[1]}, "
                                  "the range the grammar holds")
        if lo_i is not None:
            lo_i = max(lo_i, _INT_HELD[0])
            lo_i = int(float(lo_i) if float(lo_i) >= lo_i else math.nextafter(float(lo_i), math.inf))
        if hi_i is not None:
            hi_i = min(hi_i, _INT_HELD[1])
            hi_i = int(float(hi_i) if float(hi_i) <= hi_i else math.nextafter(float(hi_i), -math.inf))
        if lo_i is not None and hi_i is not None and lo_i > hi_i:
            raise ConstraintError(f"no integer in [{lo_i}, {hi_i}] the grammar can hold: it holds "
                                  "an integer bound beyond 2**53 only as a double")
        for key in _BOUND_KEYS:
            out.pop(key, None)
        if lo_i is not None:
            out["minimum"] = lo_i
        if hi_i is not None:
            out["maximum"] = hi_i
        return
    if any(b is not None and abs(b[0]) >= 2**63 for b in (lo, hi)):
        raise ConstraintError("a number bound of magnitude 2**63 or more is beyond what the grammar holds")
    changed = False

    def inward(b, up):  # a bound that is not a double: the nearest double inside it
        nonlocal changed
        r = float(b[0])
        if Fraction(r) == b[0]:
            return (r, b[1])
        changed = True
        if (Fraction(r) < b[0]) == up:
            r = math.nextafter(r, math.inf if up else -math.inf)
        return (r, False)

    lo = None if lo is None else inward(lo, True)
    hi = None if hi is None else inward(hi, False)
    if lo is not None and hi is not None:
        if lo[1] and lo[0].is_integer() and lo[0] >= 0 and lo[0] < hi[0] < lo[0] + 1:
            lo, changed = (_inside(lo[0], hi[0]), False), True
        if hi[1] and hi[0].is_integer() and hi[0] <= 0 and hi[0] - 1 < lo[0] < hi[0]:
            hi, changed = (-_inside(-hi[0], -lo[0]), False), True
    if not changed:
        return
    for key in _BOUND_KEYS:
        out.pop(key, None)
    if lo is not None:
        out["exclusiveMinimum" if lo[1] else "minimum"] = lo[0]
    if hi is not None:
        out["exclusiveMaximum" if hi[1] else "maximum"] = hi[0]


def _prepare(schema: Any, *, open_defs: set[str], keep_open: bool, defs: dict[str, Any]) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)

    def sub(value: Any, keep: bool = False) -> Any:
        return _prepare(value, open_defs=open_defs, keep_open=keep, defs=defs)

    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            is_defs = key in ("$defs", "definitions")
            out[key] = {name: sub(v, keep=is_defs and name in open_defs) for name, v in out[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            shared = (key == "allOf" and (len(out[key]) > 1 or "properties" in out)) or (
                key in ("anyOf", "oneOf") and "properties" in out)
            out[key] = [sub(v, keep=shared) for v in out[key]]
    for key in SUBSCHEMA:
        value = out.get(key)
        if isinstance(value, list):  # draft 7 tuple "items"
            out[key] = [sub(v) for v in value]
        elif isinstance(value, dict):
            out[key] = sub(value)
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in _FORMAT_PATTERNS and "pattern" not in out:
        out["pattern"] = _FORMAT_PATTERNS[fmt]
    if isinstance(fmt, str) and fmt not in _HELD_FORMATS:
        # A format llguidance does not know failed the whole request ("Unknown format:
        # binary": pydantic's bytes, Path, SecretStr, IP networks). JSON Schema makes an
        # unknown format an annotation (validators may ignore it), so it is dropped.
        del out["format"]
    # llguidance cannot hold uniqueItems and refused the schema (every pydantic set or
    # frozenset field): the items are held, their uniqueness is not (pydantic's sets take
    # duplicates and drop them).
    out.pop("uniqueItems", None)
    step = out.get("multipleOf")
    if isinstance(step, (int, float)) and not isinstance(step, bool) and not multiple_held(step):
        # llguidance 1.9 refuses a step it cannot scale to an integer exactly in floating
        # point (0.07, 0.14, 1e-20: "too many digits"), and failed every request: dropped,
        # as an unknown format is; such an answer may fail its model's own check.
        del out["multipleOf"]
    _held_bounds(out)
    if "propertyNames" in out:
        _names_as_properties(out, defs)
    properties = out.get("properties")
    required = out.get("required", [])
    if (isinstance(properties, dict) and not keep_open and out.get("type", "object") == "object"
            and "additionalProperties" not in out and "unevaluatedProperties" not in out
            and not any(k in out for k in ("allOf", "anyOf", "oneOf", "$ref", "if"))
            and isinstance(required, list) and all(k in properties for k in required)):
        out["additionalProperties"] = False
    return out


def response_format_constraint(response_format: Optional[dict]) -> Optional[Constraint]:
    """OpenAI-style ``response_format`` -> Constraint (None for plain text)."""
    if response_format is None:
        return None
    if isinstance(response_format, Constraint):
        return response_format
    if not isinstance(response_format, dict):
        raise ConstraintError("response_format must be a dict such as {'type': 'json_object'}")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema", response_format)
        if not isinstance(spec, dict):
            raise ConstraintError("response_format json_schema must be a dict with a 'schema'")
        schema = spec.get("schema")
        if schema is None:
            raise ConstraintError("response_format json_schema needs a 'schema'")
        return Constraint.json_schema(schema, name=spec.get("name", ""))
    if kind in ("lark", "grammar", "regex"):
        key = "pattern" if kind == "regex" else "grammar"
        text = response_format.get(key)
        if not isinstance(text, str):
            raise ConstraintError(f"response_format {kind} needs a {key!r} string")
        return Constraint.regex(text) if kind == "regex" else Constraint.lark(text)
    raise ConstraintError(f"unknown response_format type {kind!r}")


def tool_names(tools: Sequence[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def tool_call_constraint(fmt: ChatFormat, tools: Sequence[dict], names: Sequence[str], *,
                         parallel: bool, marker: Callable[[str], str]) -> Constraint:
    """Force one call (or several, if ``parallel``) of the named tools.

    The body is the format's own where this module can write it (``native_body``):
    ``{"name": ..., "arguments": {...}}`` for Hermes/Qwen2.5/Qwen3 (``json_tools``), the
    XML ``<function=...>`` body for Qwen3.5 and Qwen3-Coder (``qwen3_coder``, xml_calls.py).
    For other syntaxes with markers the JSON body is forced and the output parser reads
    forced bodies as JSON (see docs/design.md).
    """
    if not fmt.tool_call_start:
        raise ConstraintError(
            "this model's chat template has no tool-call markers, so a tool call cannot be forced")
    body, hints, xml = _body_rules(fmt, tools, names)
    grammar = f"start: calls\n{_calls_rules(fmt, parallel, marker)}\n{body}\n"
    return Constraint("lark", grammar, f"tool_call({', '.join(names)})", hints, text_markup=xml)


def native_body(fmt: ChatFormat, tools: Sequence[dict], names: Sequence[str]) -> bool:
    """Is a call of ``names`` written in the format's own body (else a JSON body that the
    output parser reads as JSON)? JSON for ``json_tools``; XML for ``qwen3_coder`` where
    the tools' schemas can be written in it (xml_calls.py)."""
    if fmt.tool_format == "json_tools":
        return True
    return fmt.tool_format == "qwen3_coder" and bool(fmt.tool_call_end) and xml_expressible(tools, names)


def _body_rules(fmt: ChatFormat, tools: Sequence[dict],
                names: Sequence[str]) -> tuple[str, tuple[str, ...], bool]:
    """The Lark rule ``body`` (one call of any of ``names``), its closing-mode hints, and
    whether it is XML."""
    if fmt.tool_format == "qwen3_coder" and native_body(fmt, tools, names):
        try:
            return (*xml_body_rules(tools, names, json_style=JSON_STYLE, prepare=_prepared_schema,
                                    end_marker=fmt.tool_call_end), True)
        except RecursionError:
            raise ConstraintError("the JSON schema is nested too deeply") from None
    body = _schema_text(lambda: _call_body_schema(tools, names))
    return f"body: %json {body}", _string_hints(body), False


def _calls_rules(fmt: ChatFormat, parallel: bool, marker: Callable[[str], str]) -> str:
    """The Lark rule ``calls``: one call (or several) of JSON ``body`` rules in the format's
    markup. A format without an end marker (Mistral's, ``[TOOL_CALLS]``) writes its calls as
    one JSON list after the start marker, which mlx-lm's parser for it reads; the answer ends
    with them."""
    if not fmt.tool_call_end:
        more = '(", " body)*' if parallel else ""
        return f'calls: {marker(fmt.tool_call_start)} "[" body {more} "]"'
    call = f'{marker(fmt.tool_call_start)} "\\n" body "\\n" {marker(fmt.tool_call_end)}'
    return f'calls: call ("\\n" call)*\ncall: {call}' if parallel else f"calls: call\ncall: {call}"


def call_or_answer_constraint(fmt: ChatFormat, tools: Sequence[dict], answer: Constraint, *,
                              parallel: bool, marker: Callable[[str], str]) -> Constraint:
    """Calls of the listed tools, or an answer that matches a JSON ``response_format``.

    OpenAI's API lets a model call its tools under ``tool_choice="auto"`` and holds only its
    text answer to the ``response_format``; agents bind both (LangChain's ``create_agent``
    with a ``response_format``, through ``bind_tools(..., response_format=...)``). Calls are
    written as forced calls are (``tool_call_constraint``).
    """
    names = tool_names(tools)
    body, hints, xml = _body_rules(fmt, tools, names)
    grammar = (f"start: calls | answer\n{_calls_rules(fmt, parallel, marker)}\n{body}\n"
               f"answer: {_as_rule(answer)}\n")
    return Constraint("lark", grammar, f"tool_call({', '.join(names)}) or {answer.description}",
                      answer.hints + hints, text_markup=xml or answer.text_markup)


def after_reasoning(constraint: Constraint, think_ids: tuple[int, int], *, opened: bool) -> Constraint:
    """Reasoning first, then ``constraint`` (a request that asks for ``reasoning=True`` with a
    response_format or a forced call).

    The reasoning is free text up to the end marker; ``opened``: the prompt already opened it
    (Qwen3.5's template), else the model may open it or skip it. The markers are matched by
    token id, so reasoning text cannot end it by spelling one. vLLM applies structured output
    after its reasoning parser's end marker the same way. One grammar for both parts keeps
    closing mode exact: near the end of the budget the shortest way out is the end marker
    and the shortest answer, so the answer still closes within ``max_tokens``.
    """
    start, end = think_ids
    # The blank line Qwen's template writes after </think>, which the output parser drops;
    # only after a reasoning, so an answer without one is exactly the constraint's.
    thought = f"THOUGHT <[{end}]> /\\n{{0,2}}/"
    head = thought if opened else f"(<[{start}]> {thought})?"
    grammar = f"start: {head} answer\nTHOUGHT: /(.|\\n)*/\nanswer: {_as_rule(constraint)}\n"
    return Constraint("lark", grammar, f"reasoning, then {constraint.description}", constraint.hints,
                      text_markup=constraint.text_markup)


def _as_rule(c: Constraint) -> str:
    """``c`` as the body of a Lark rule (a nested grammar)."""
    if c.kind == "json_schema":
        schema = json.loads(c.source)
        if isinstance(schema, dict):  # what the top-level compile passes as overrides
            schema = {**schema, "x-guidance": JSON_STYLE}
        return f"%json {json.dumps(schema)}"
    if c.kind == "lark":
        return f"%lark {{\n{c.source}\n}}"
    if c.kind == "regex":
        return lark_regex(c.source)
    raise ConstraintError(f"unknown constraint kind {c.kind!r}")


def open_call_constraint(fmt: ChatFormat, tools: Sequence[dict], *, marker: Callable[[str], str]) -> Constraint:
    """The rest of one call of any listed tool, once its start marker has been emitted.

    What a lazy grammar (tool_call_grammar.py) applies after the model opens a call itself.
    """
    names = tool_names(tools)
    body, hints, xml = _body_rules(fmt, tools, names)
    grammar = f'start: "\\n" body "\\n" {marker(fmt.tool_call_end)}\n{body}\n'
    return Constraint("lark", grammar, f"open_tool_call({', '.join(names)})", hints, text_markup=xml)


def _call_body_schema(tools: Sequence[dict], names: Sequence[str]) -> dict:
    """``{"name": <one of names>, "arguments": <that tool's parameters>}`` as one JSON schema."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    variants = []
    defs: dict[str, Any] = {}
    for i, name in enumerate(names):
        params = _prepared_schema(by_name[name].get("parameters") or {"type": "object", "properties": {}})
        if _has_local_ref(params):
            # Local refs ("#/$defs/Model", as pydantic writes them) resolve against the
            # document root; nested under "arguments" they failed to compile. Keep the
            # parameter schema whole under the root's $defs and point its refs there.
            key = f"tool{i}_arguments"
            defs[key] = _rebase_refs(params, f"#/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        variants.append({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    body = variants[0] if len(variants) == 1 else {"anyOf": variants}
    body = {**body, "x-guidance": JSON_STYLE}
    if defs:
        body["$defs"] = defs
    return body


def _has_local_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_local_ref(v) for v in schema)
    return False


def _rebase_refs(schema: Any, base: str) -> Any:
    """Rewrite local ``$ref`` pointers ("#/...") for a schema moved to ``base`` ("#/...")."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebase_refs(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def _grammar_text(c: Constraint) -> str:
    import llguidance

    if c.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(c.source, overrides=JSON_STYLE)
    if c.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(c.source)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.source)
    raise ConstraintError(f"unknown constraint kind {c.kind!r}")


class GrammarCompiler:
    """Per-engine: the llguidance tokenizer (built once, lazily) and grammar compilation."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 lock: Optional[threading.Lock] = None):
        self._hf = hf_tokenizer
        self._lock = lock or threading.Lock()
        self._init_lock = threading.Lock()
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._llt = None
        self._tiers: Optional[TokenClasses] = None

    @property
    def tokenizer(self):
        if self._llt is None:
            with self._init_lock:
                if self._llt is None:
                    import llguidance.hf

                    with self._lock:  # HF tokenizers are not safe to share across threads
                        hf = copy.deepcopy(self._hf)
                    self._llt = llguidance.hf.from_tokenizer(
                        hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._llt

    def marker(self, text: str) -> str:
        """A Lark expression for a literal marker such as ``<tool_call>``.

        llguidance treats every added token as special; those only match by id.
        """
        llt = self.tokenizer
        ids = llt.tokenize_str(text)
        if len(ids) == 1 and llt.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def compile(self, constraint: Constraint):
        """A fresh LLMatcher for one request; ConstraintError if the grammar is invalid."""
        import llguidance

        try:
            grammar = _grammar_text(constraint)
        except ValueError as exc:
            raise ConstraintError(f"invalid {constraint.description}: {exc}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"invalid {constraint.description}: {matcher.get_error()}")
        # A grammar of no string (a regex of an empty character class) compiles, and fails
        # only at its first mask, which allowed just EOS: the answer was "" and "stop".
        matcher.compute_bitmask()
        if matcher.is_error():
            raise ConstraintError(f"invalid {constraint.description}: it matches no string")
        return matcher

    def hint_ids(self, constraint: Constraint) -> tuple[tuple[int, ...], ...]:
        """``constraint.hints`` as token ids, for closing mode, shortest first: a witness
        fits in any string its pattern's grammar takes, and a long one (another field's
        twenty digits) would crowd out a short one that closes in budget."""
        return tuple(sorted((tuple(self.tokenizer.tokenize_str(h)) for h in constraint.hints), key=len))

    def tiers(self) -> TokenClasses:
        """Per-token closing preference and classes (``TokenClasses``), computed once."""
        if self._tiers is None:
            self._tiers = token_classes(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._tiers



def keep_mask(banned: Sequence[int], vocab: int) -> np.ndarray:
    """(vocab,) bool, False at the banned ids (ids past the vocabulary are ignored)."""
    keep = np.ones(vocab, dtype=bool)
    keep[[t for t in banned if t < vocab]] = False
    return keep


class TokenBan:
    """mlx-lm logits processor that forbids some tokens (e.g. tool-call markers for tool_choice="none").

    Keeps a numpy mask, not an mx.array: processors live as long as the caller's stream
    object, and mx arrays must not outlive the owner thread.
    """

    def __init__(self, token_ids: Sequence[int]):
        self._ids = sorted(set(int(t) for t in token_ids))
        self._keep: Optional[np.ndarray] = None

    @property
    def token_ids(self) -> list[int]:
        """The banned ids. A ban does not depend on the tokens before it, so a speculative
        step applies it to every drafted and verified position (spec/batch.py)."""
        return list(self._ids)

    def __call__(self, tokens, logits):
        import mlx.core as mx

        if self._keep is None or self._keep.shape[-1] != logits.shape[-1]:
            self._keep = keep_mask(self._ids, logits.shape[-1])
        return mx.where(mx.array(self._keep), logits, mx.array(-float("inf"), dtype=logits.dtype))
