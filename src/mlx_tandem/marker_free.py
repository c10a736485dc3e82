"""JSON values that cannot spell a call's markup: for JSON-valued XML parameters.

In Qwen3.5's XML calls (xml_calls.py) an object or array parameter is JSON text between
``<parameter=NAME>`` and ``</parameter>``. mlx-lm's parser (0.32, ``qwen3_coder``) cuts a
value at the first ``</parameter>`` and the output parser ends the call at the text of
``</tool_call>``, wherever they stand; a string inside the JSON (an item of a list of
strings, a field of a nested model) that spelled either cut the call into an invalid one.
The raw string values of the XML body exclude them with Lark's ``~``; llguidance's JSON
grammar takes no exclusions, so each string the JSON may hold gets a ``pattern`` that
refuses them instead:

- a string schema's own pattern and format stay: the exclusion is one more pattern
  (an ``allOf`` branch beside the first);
- a value of any type (``{}``, ``Any``), an array's items and a free-form object's values
  that the schema leaves open are held to "any JSON value whose strings are free of the
  markers" (a recursive ``$defs`` entry), which accepts the same values otherwise.

Not held: a string with a ``minLength`` over ``MAX_MIN_LENGTH`` (below); the keys of a
free-form object (``dict[str, int]``; llguidance 1.9.1 has no ``propertyNames``); and the
values of keys an object leaves open beside properties that other subschemas name
(schema_prep.py keeps such objects open).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .schema_positions import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS

#: The ``$defs`` entry for any JSON value whose strings spell no marker.
ANY_VALUE = "mlx_tandem_marker_free_value"
_ANY_REF = {"$ref": f"#/$defs/{ANY_VALUE}"}
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated"})
_COMBINED = ("$ref", "allOf", "anyOf", "oneOf", "not", "if", "enum", "const")
#: llguidance 1.9.1 refused a string whose minLength is over 42 beside this pattern ("Unable
#: to determine if regex is empty"), failing every call of the tool: such a string is left
#: without it.
MAX_MIN_LENGTH = 32


def free_of(words: Sequence[str]) -> Optional[str]:
    """An anchored regex for the strings holding none of ``words``, or None where this
    construction does not apply: every word must start with one character that it holds
    nowhere else (``<``, as markup does). Then a string is free of them exactly where no
    piece after a ``<`` (up to the next one) starts with a word's rest, which a regex
    without look-ahead can say (llguidance's patterns have none)."""
    words = [w for w in dict.fromkeys(words) if w]
    if not words or len({w[0] for w in words}) != 1 or any(len(w) < 2 or w[0] in w[1:] for w in words):
        return None
    lead = words[0][0]
    piece = _not_starting_with([w[1:] for w in words], lead)
    return f"^{_cls(lead, negate=True)}*({_escape(lead)}({piece}))*$"


def _not_starting_with(rests: list[str], lead: str) -> str:
    """Strings without ``lead`` that start with none of ``rests``."""
    firsts = sorted({r[0] for r in rests})
    free = _cls(lead, negate=True)
    alts = ["", f"{_cls(lead + ''.join(firsts), negate=True)}{free}*"]
    for c in firsts:
        deeper = [r[1:] for r in rests if r[0] == c]
        if all(deeper):  # else this character ends a word: nothing may follow it here
            alts.append(f"{_escape(c)}({_not_starting_with(deeper, lead)})")
    return "|".join(alts)


_META = frozenset("\\.+*?()|[]{}^$-&~#")


def _escape(c: str) -> str:
    # Only what is special: Rust's regex (llguidance's) reads \< and \> as word boundaries.
    return "\\" + c if c in _META else c


def _cls(chars: str, *, negate: bool) -> str:
    return "[" + ("^" if negate else "") + "".join(_escape(c) for c in dict.fromkeys(chars)) + "]"


def marker_free_schema(schema: dict, words: Sequence[str]) -> dict:
    """``schema`` (with its ``$defs``) whose strings cannot spell ``words``; unchanged where
    ``free_of`` does not apply."""
    pattern = free_of(words)
    if pattern is None:
        return schema
    out = _walk(schema, pattern)
    defs = dict(out.get("$defs") or {}) if isinstance(out.get("$defs"), dict) else {}
    defs[ANY_VALUE] = {"anyOf": [
        {"type": "string", "pattern": pattern}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
        {"type": "array", "items": _ANY_REF}, {"type": "object", "additionalProperties": _ANY_REF}]}
    return {**out, "$defs": defs}


def _walk(schema: Any, pattern: str) -> Any:
    if schema is True:
        return _ANY_REF
    if not isinstance(schema, dict):
        return schema
    if set(schema) <= _ANNOTATIONS:  # any value at all
        return dict(_ANY_REF)
    out = dict(schema)
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(v, pattern) for name, v in out[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_walk(v, pattern) for v in out[key]]
    for key in SUBSCHEMA:
        value = out.get(key)
        if key == "propertyNames":
            continue  # keys: not held (above)
        if isinstance(value, list):  # draft 7 tuple "items"
            out[key] = [_walk(v, pattern) for v in value]
        elif isinstance(value, dict) or value is True:
            out[key] = _walk(value, pattern)
    if any(k in out for k in _COMBINED):
        return out  # its branches (or the entry it refers to) are walked; enums are data
    kinds = out.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds} if isinstance(kinds, str) else None
    low = out.get("minLength")
    if (kinds is None or "string" in kinds) and not (isinstance(low, int) and low > MAX_MIN_LENGTH):
        if "pattern" in out:
            out["allOf"] = [{"pattern": pattern}]
        else:
            out["pattern"] = pattern
    if (kinds is None or "array" in kinds) and "items" not in out and "prefixItems" not in out:
        out["items"] = _ANY_REF
    if (kinds is None or "object" in kinds) and not any(
            k in out for k in ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties")):
        out["additionalProperties"] = _ANY_REF
    return out
