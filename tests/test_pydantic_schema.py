"""The engine's JSON schemas of Pydantic models allow nothing the model refuses."""

from __future__ import annotations

import random
import re
from decimal import Decimal
from typing import Optional

import pytest
from pydantic import BaseModel, Field, ValidationError

from mlx_tandem.pydantic_schema import DECIMAL_PATTERN, decimal_pattern, json_schema, narrowed_schema


def _model(**field) -> type[BaseModel]:
    return type("M", (BaseModel,), {"__annotations__": {"x": Decimal}, "x": Field(**field)})


@pytest.mark.parametrize("field", [{}, {"max_digits": 5, "decimal_places": 2}, {"max_digits": 3},
                                   {"decimal_places": 1}, {"max_digits": 4, "decimal_places": 0},
                                   {"max_digits": 2, "decimal_places": 2}, {"max_digits": 2, "decimal_places": 3}])
def test_every_text_a_decimal_pattern_allows_validates(field):
    """Random texts of digits, signs, points, exponents and spaces: each one the pattern
    allows is a Decimal the field takes (a grammar may allow less, never more)."""
    model = _model(**field)
    pattern = json_schema(model)["properties"]["x"]["pattern"]
    rng = random.Random(0)
    texts = ["".join(rng.choice("0123456789.+-e ") for _ in range(rng.randint(1, 8))) for _ in range(20000)]
    allowed = [t for t in texts if re.search(pattern, t)]
    assert len(allowed) > 200  # not an empty language
    for text in allowed:
        try:
            model.model_validate_json('{"x": "%s"}' % text)
        except ValidationError as exc:
            pytest.fail(f"{pattern} allows {text!r}, which {field} refuses: {exc}")


def test_a_bounded_decimal_is_its_bounded_number_and_what_neither_branch_holds_keeps_both():
    """With bounds the number alone: the grammar holds them (and writes no exponent, so no
    infinity), where a pattern cannot. With multiple_of, or bounds and digit limits, neither
    branch holds everything: Pydantic's two, the string one held to the pattern."""

    class Price(BaseModel):
        amount: Decimal
        tip: Optional[Decimal] = None
        rate: Decimal = Field(gt=0, le=100)
        step: Decimal = Field(multiple_of=0.5)
        cents: Decimal = Field(ge=0, max_digits=5, decimal_places=2)
        name: str

    props = json_schema(Price)["properties"]
    assert props["amount"] == {"type": "string", "pattern": DECIMAL_PATTERN, "title": "Amount"}
    assert {"type": "string", "pattern": DECIMAL_PATTERN} in props["tip"]["anyOf"]
    assert props["rate"] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 100.0, "title": "Rate"}
    assert props["step"]["anyOf"] == [{"type": "number", "multipleOf": 0.5},
                                      {"type": "string", "pattern": DECIMAL_PATTERN}]
    assert props["cents"]["anyOf"][0] == {"type": "number", "minimum": 0.0}
    assert props["cents"]["anyOf"][1]["pattern"] == decimal_pattern(5, 2)
    assert props["name"] == Price.model_json_schema()["properties"]["name"]
    assert narrowed_schema(Price) == json_schema(Price)
    assert narrowed_schema(type("N", (BaseModel,), {"__annotations__": {"n": float}})) is None
    assert narrowed_schema({"type": "object"}) is None and narrowed_schema(int) is None


def test_digit_limits_no_text_fits_keep_pydantics_schema():
    assert decimal_pattern(0) is None
    model = _model(max_digits=0)
    assert json_schema(model) == model.model_json_schema()
