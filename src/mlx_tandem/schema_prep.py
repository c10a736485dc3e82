"""The caller's JSON schema as llguidance (1.9) gets it: what the grammar cannot hold as
written is rewritten to what it holds (never to more than the schema allows), dropped
where JSON Schema makes it an annotation, or refused with a ConstraintError.

Every answer the prepared schema allows still validates against the caller's schema; the
rules and the failures each one answers are in ``prepared_schema``'s docstring and beside
each rule. Used by constraints.py for response formats and tool arguments alike.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any, Optional

from .errors import ConstraintError
from .pattern_witness import schema_patterns
from .schema_positions import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS

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


def prepared_schema(schema: Any) -> Any:
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
