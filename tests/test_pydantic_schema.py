"""The engine's JSON schemas of Pydantic models allow nothing the model refuses."""

from __future__ import annotations

import random
import re
from decimal import Decimal
from typing import Optional

import pytest
from pydantic import BaseModel, Field, ValidationError

from mlx_tandem.pydantic_schema import DECIMAL_PATTERN, json_schema, narrows


def _model(**field) -> type[BaseModel]:
    return type("M", (BaseModel,), {"__annotations__": {"x": Decimal}, "x": Field(**field)})


@pytest.mark.parametrize("field", [{}, {"max_digits": 5, "decimal_places": 2}, {"max_digits": 3},
                                   {"decimal_places": 1}, {"max_digits": 4, "decimal_places": 0},
                                   {"max_digits": 2, "decimal_places": 2}])
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


def test_an_unbounded_decimal_is_a_decimal_string_and_a_bounded_one_keeps_its_number():
    """The number branch takes 1e999, which a JSON parser reads as inf (no Decimal); with
    bounds it cannot, and the bounds are held there."""

    class Price(BaseModel):
        amount: Decimal
        tip: Optional[Decimal] = None
        rate: Decimal = Field(gt=0, le=100)
        name: str

    props = json_schema(Price)["properties"]
    assert props["amount"] == {"type": "string", "pattern": DECIMAL_PATTERN, "title": "Amount"}
    assert {"type": "string", "pattern": DECIMAL_PATTERN} in props["tip"]["anyOf"]
    assert {"type": "number", "exclusiveMinimum": 0.0, "maximum": 100.0} in props["rate"]["anyOf"]
    assert props["name"] == Price.model_json_schema()["properties"]["name"]
    assert narrows(Price) and not narrows(type("N", (BaseModel,), {"__annotations__": {"n": float}}))
    assert not narrows({"type": "object"}) and not narrows(int)
