"""JSON schemas of Pydantic models for grammars: what the grammar allows, the model validates.

Pydantic writes a ``Decimal`` field as ``{"anyOf": [{"type": "number"}, {"type": "string"}]}``.
Its string branch takes any text, so a grammar compiled from it let the model write
``"price": "about twelve"``; and its number branch takes ``-8e5647``, which a JSON parser
reads as a float, ``-inf``, which no Decimal takes. Either way the answer failed its own
model (seen with sampled answers). ``json_schema`` writes a Decimal as follows:

- without bounds: a string held to a decimal's pattern, within ``max_digits`` and
  ``decimal_places``, as Pydantic itself writes a Decimal out (``model_dump_json``), which
  also keeps its digits exact;
- with bounds (``gt``, ``ge``, ``lt``, ``le``) and no digit limits: the number alone, whose
  bounds the grammar holds (llguidance then writes no exponent, so no infinity either);
- otherwise (``multiple_of``, or bounds with digit limits): Pydantic's two branches, the
  string one held to the pattern. Neither branch holds everything there (a pattern cannot
  hold a bound; llguidance's numbers hold neither ``multiple_of`` nor digits), so such an
  answer may still fail its model, as before.

``Json[...]`` (a string that holds a JSON document) stays a free string: no grammar holds
the escaped document inside it to its schema.

The engine takes JSON schemas; the adapters (and users) turn their models into them here.
Needs Pydantic 2, which both adapters' frameworks require; the engine itself never imports it.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic.json_schema import GenerateJsonSchema

#: What ``Decimal(text)`` takes, less exponents and surrounding spaces (a grammar may allow
#: less than the model validates, never more).
DECIMAL_PATTERN = r"^[+-]?(\d+(\.\d*)?|\.\d+)$"
_BOUNDS = ("gt", "ge", "lt", "le")


class GrammarJsonSchema(GenerateJsonSchema):
    def decimal_schema(self, schema: Any) -> dict:
        out = super().decimal_schema(schema)
        branches = out.get("anyOf")
        pattern = decimal_pattern(schema.get("max_digits"), schema.get("decimal_places"))
        if not isinstance(branches, list) or pattern is None:
            return out
        rest = {k: v for k, v in out.items() if k != "anyOf"}
        bounded = any(schema.get(k) is not None for k in _BOUNDS)
        digits = schema.get("max_digits") is not None or schema.get("decimal_places") is not None
        if schema.get("multiple_of") is None and not (bounded and digits):
            if not bounded:
                return {**rest, "type": "string", "pattern": pattern}
            number = [b for b in branches if b.get("type") == "number"]
            if len(number) == 1:
                return {**rest, **number[0]}
        for branch in branches:
            if branch.get("type") == "string" and "pattern" not in branch:
                branch["pattern"] = pattern
        return out


def decimal_pattern(max_digits: Optional[int] = None, decimal_places: Optional[int] = None) -> Optional[str]:
    """A decimal's text within ``max_digits`` digits in all and ``decimal_places`` after the
    point; None where no text fits. Every digit written counts (leading zeros too), so it
    allows no more than Pydantic counts."""
    if max_digits is None and decimal_places is None:
        return DECIMAL_PATTERN
    if max_digits is None:
        return rf"^[+-]?\d+(\.\d{{0,{decimal_places}}})?$"
    # Pydantic also holds the whole part to max_digits - decimal_places digits.
    most_whole = max_digits - (decimal_places or 0)
    if most_whole < 1:  # all digits after the point
        places = max_digits if decimal_places is None else min(decimal_places, max_digits)
        return rf"^[+-]?0?\.\d{{1,{places}}}$" if places >= 1 else None
    forms = []
    for whole in range(1, most_whole + 1):
        places = max_digits - whole if decimal_places is None else min(decimal_places, max_digits - whole)
        forms.append(rf"\d{{{whole}}}" + (rf"(\.\d{{0,{places}}})?" if places > 0 else ""))
    return rf"^[+-]?({'|'.join(forms)})$"


def json_schema(model: type) -> dict:
    """``model.model_json_schema()`` with the branches Pydantic leaves open written as what
    the model validates."""
    return model.model_json_schema(schema_generator=GrammarJsonSchema)


def narrowed_schema(model: Any) -> Optional[dict]:
    """``json_schema(model)`` where it differs from Pydantic's (a Pydantic 2 model with a
    ``Decimal`` somewhere); None otherwise, and for anything else."""
    if not (isinstance(model, type) and hasattr(model, "model_json_schema")):
        return None
    try:
        ours = json_schema(model)
        return ours if ours != model.model_json_schema() else None
    except Exception:  # noqa: BLE001 - a model Pydantic cannot write: the caller's own path reports it
        return None
