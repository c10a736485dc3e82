"""JSON schemas of Pydantic models for grammars: what the grammar allows, the model validates.

Pydantic writes a ``Decimal`` field as ``{"anyOf": [{"type": "number"}, {"type": "string"}]}``.
Its string branch takes any text, so a grammar compiled from it let the model write
``"price": "about twelve"``; and its number branch takes ``-8e5647``, which a JSON parser
reads as a float, ``-inf``, which no Decimal takes. Either way the answer failed its own
model (seen with sampled answers). ``json_schema`` writes a Decimal as follows:

- without bounds: a string held to a decimal's pattern, within ``max_digits`` and
  ``decimal_places``, as Pydantic itself writes a Decimal out (``model_dump_json``), which
  also keeps its digits exact. A ``multiple_of`` that is a power of ten at most 1 (0.01 for
  cents) is a limit on the places, so the pattern holds it too;
- with bounds (``gt``, ``ge``, ``lt``, ``le``) or another ``multiple_of`` (0.05), and no
  digit limits: the number alone, whose bounds and ``multipleOf`` the grammar holds
  (llguidance 1.9 holds a fractional ``multipleOf`` exactly, and writes no exponent under
  either, so no infinity). Pydantic reads a JSON number through a float, so with a step the
  number is also kept within 15 significant digits (bounds of 10**(15 - the step's places)
  where the field has none): a sampled answer's 29-digit integer failed its step;
- a ``multiple_of`` the grammar cannot hold (llguidance 1.9 refuses 0.07, which it cannot
  scale exactly; the engine drops it from any schema) counts as none: such an answer may
  fail its model's own check (before, every request failed);
- otherwise (bounds or such a ``multiple_of`` with digit limits): Pydantic's two branches,
  the string one held to the pattern. Neither branch holds everything there (a pattern
  cannot hold a bound; llguidance's numbers hold no digit limits), so such an answer may
  still fail its model, as before.

Other types whose schema allows what the type refuses (found by a fuzz, 2026-11-30):

- a ``float`` with ``multiple_of``: Pydantic checks the step in binary floating point, with
  a tolerance that holds within 2**23 when the step is no exact float (measured for steps
  from 0.01 to 1000.1: 8388822.2 fails a step of 1.1, 52176088.9 one of 0.1); a step a
  float holds exactly (0.5, 2.5, 5), to 15 significant digits, as a Decimal's. The number
  is bounded there where the field is not, or is past it (a sampled answer wrote
  -35870854620523.3 for a step of 0.1);
- a finite float (``FiniteFloat``, ``allow_inf_nan=False``): JSON's ``56E63524760826950``
  reads as infinity. llguidance 1.9 builds number ranges only within about 1e18, so the
  number is kept within 1e18 where the field is not bounded (less than the type takes);
- ``NaiveDatetime``: ``format: date-time`` is RFC 3339's, which always writes an offset,
  so every answer failed; it is a pattern of a date and time without one;
- ``timedelta``: ``format: duration`` takes any number of digits, past what a timedelta
  holds (``P51M260638593387794054D``); it is a pattern of at most 6 digits a component.

``Json[...]`` (a string that holds a JSON document) stays a free string: no grammar holds
the escaped document inside it to its schema.

The engine takes JSON schemas; the adapters (and users) turn their models into them here.
Needs Pydantic 2, which both adapters' frameworks require; the engine itself never imports it.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any, Optional

from pydantic.json_schema import GenerateJsonSchema

from .schema_prep import multiple_held

#: What ``Decimal(text)`` takes, less exponents and surrounding spaces (a grammar may allow
#: less than the model validates, never more).
DECIMAL_PATTERN = r"^[+-]?(\d+(\.\d*)?|\.\d+)$"
_BOUNDS = ("gt", "ge", "lt", "le")


class GrammarJsonSchema(GenerateJsonSchema):
    _in_decimal = False  # Pydantic writes a Decimal's number branch with float_schema

    def decimal_schema(self, schema: Any) -> dict:
        self._in_decimal = True
        try:
            out = super().decimal_schema(schema)
        finally:
            self._in_decimal = False
        branches = out.get("anyOf")
        places, step_places = schema.get("decimal_places"), _places_of_step(schema.get("multiple_of"))
        if step_places is not None:
            places = step_places if places is None else min(places, step_places)
        pattern = decimal_pattern(schema.get("max_digits"), places)
        if not isinstance(branches, list) or pattern is None:
            return out
        rest = {k: v for k, v in out.items() if k != "anyOf"}
        bounded = any(schema.get(k) is not None for k in _BOUNDS)
        number = [b for b in branches if b.get("type") == "number"]
        # A step other than a power of ten that the grammar holds (llguidance refuses 0.07,
        # which schema_prep.py drops: left to Pydantic's check, as in the pattern's string).
        other_step = (schema.get("multiple_of") is not None and step_places is None
                      and all(multiple_held(b["multipleOf"]) for b in number if "multipleOf" in b))
        if not bounded and not other_step:  # the pattern holds everything it can
            return {**rest, "type": "string", "pattern": pattern}
        digits = schema.get("max_digits") is not None or schema.get("decimal_places") is not None
        if not digits and len(number) == 1:  # the number holds the bounds and the step
            return {**rest, **_within_float_digits(number[0])}
        for branch in branches:
            if branch.get("type") == "string" and "pattern" not in branch:
                branch["pattern"] = pattern
        return out


    def float_schema(self, schema: Any) -> dict:
        out = super().float_schema(schema)
        if self._in_decimal:  # a Decimal's step is checked exactly (decimal_schema bounds it)
            return out
        if "multipleOf" in out and multiple_held(out["multipleOf"]):
            out = _float_step_bounds(out)
        if schema.get("allow_inf_nan") is False:
            out = _bounded(out, FINITE_LIMIT)
        return out

    def datetime_schema(self, schema: Any) -> dict:
        out = super().datetime_schema(schema)
        if schema.get("tz_constraint") == "naive" and out.get("format") == "date-time":
            out = {**{k: v for k, v in out.items() if k != "format"}, "pattern": NAIVE_DATETIME_PATTERN}
        return out

    def timedelta_schema(self, schema: Any) -> dict:
        out = super().timedelta_schema(schema)
        if out.get("format") == "duration":
            out = {**{k: v for k, v in out.items() if k != "format"}, "pattern": DURATION_PATTERN}
        return out


#: Significant digits a JSON number keeps through the float Pydantic reads it as.
FLOAT_DIGITS = 15
#: Where Pydantic's check of a float ``multiple_of`` holds when the step is no exact float
#: (0.1, 1.1, 123.4): it failed multiples from just past 2**23 on, whatever the step.
FLOAT_STEP_LIMIT = 2 ** 23
#: Where a finite float's number is kept: llguidance 1.9 builds number ranges within ~1e18.
FINITE_LIMIT = 10 ** 18
_DAYS = r"(0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8])"
#: A date and time with no offset, as NaiveDatetime takes it (Feb 29 and years before 1000 left out).
NAIVE_DATETIME_PATTERN = rf"^[1-9]\d{{3}}-({_DAYS})[Tt ]([01]\d|2[0-3]):[0-5]\d(:[0-5]\d(\.\d{{1,6}})?)?$"
_Q = r"\d{1,6}"
_SECONDS = rf"{_Q}(\.{_Q})?S"
_TIME = rf"T({_Q}H({_Q}M)?({_SECONDS})?|{_Q}M({_SECONDS})?|{_SECONDS})"
_DATE = rf"{_Q}Y({_Q}M)?({_Q}W)?({_Q}D)?|{_Q}M({_Q}W)?({_Q}D)?|{_Q}W({_Q}D)?|{_Q}D"
#: An ISO 8601 duration a timedelta holds: at most 6 digits a component (all of them at
#: most ~4e8 days, under its 999999999), at least one component, none after an empty "T".
DURATION_PATTERN = rf"^P(({_DATE})({_TIME})?|{_TIME})$"


def _bounded(number: dict, limit) -> dict:
    """``number`` kept within ``limit``: a side with no bound, or one past it, is bounded
    there (the field's own ``le=1e12`` let 52176088.9 through a step of 0.1)."""
    out = dict(number)
    for key, exclusive, sign in (("maximum", "exclusiveMaximum", 1), ("minimum", "exclusiveMinimum", -1)):
        own = [out[k] * sign for k in (key, exclusive) if isinstance(out.get(k), (int, float))
               and not isinstance(out.get(k), bool)]
        if not own or min(own) > limit:
            out.pop(key, None)
            out[exclusive] = sign * limit
    return out


def _float_step_bounds(number: dict) -> dict:
    """A float's number with a ``multipleOf``, kept where Pydantic's float check of the step
    holds (module docstring)."""
    step = _as_decimal(number["multipleOf"])
    if step is None:
        return number
    if Decimal(float(step)) == step:  # the float is the step written: exact to 15 digits
        return _within_float_digits(number)
    return _bounded(number, FLOAT_STEP_LIMIT)


def _within_float_digits(number: dict) -> dict:
    """A number branch with a ``multipleOf`` of k places, kept under 10**(15 - k) (where
    the field is not bounded, or is past it): Pydantic reads a JSON number through a float, and a longer one
    (a sampled answer wrote a 29-digit integer) failed the step it holds."""
    step = _as_decimal(number.get("multipleOf"))
    exponent = None if step is None else step.as_tuple().exponent
    if not isinstance(exponent, int):
        return number
    return _bounded(number, 10 ** (FLOAT_DIGITS - max(0, -exponent)))


def _places_of_step(step: Any) -> Optional[int]:
    """k where ``multiple_of`` is 10**-k (k >= 0): being its multiple is having at most k
    places. None for any other step, and for none."""
    d = _as_decimal(step)
    if d is None:
        return None
    sign, digits, exponent = d.as_tuple()
    if sign or digits != (1,) or not isinstance(exponent, int) or exponent > 0:
        return None
    return -exponent


def _as_decimal(step: Any) -> Optional[Decimal]:
    """A step as a normalized Decimal (its exponent gives its places); None for none and
    for what is not a number."""
    if step is None or isinstance(step, bool):
        return None
    try:
        return Decimal(str(step)).normalize()
    except (InvalidOperation, ValueError):
        return None


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
