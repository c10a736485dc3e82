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
                                   {"max_digits": 2, "decimal_places": 2}, {"max_digits": 2, "decimal_places": 3},
                                   {"multiple_of": Decimal("0.01")}, {"multiple_of": 1, "max_digits": 3},
                                   {"multiple_of": 0.1, "decimal_places": 3}])
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
    """With bounds, or a step other than a power of ten, the number alone: the grammar holds
    them (and writes no exponent, so no infinity), where a pattern cannot. A power-of-ten
    step is a limit on the places: the pattern. With bounds or such a step and digit limits,
    neither branch holds everything: Pydantic's two, the string one held to the pattern."""

    class Price(BaseModel):
        amount: Decimal
        tip: Optional[Decimal] = None
        rate: Decimal = Field(gt=0, le=100)
        step: Decimal = Field(multiple_of=0.5)
        cents: Decimal = Field(multiple_of=Decimal("0.01"))
        fee: Decimal = Field(multiple_of=Decimal("0.01"), ge=0)
        coarse: Decimal = Field(multiple_of=0.5, max_digits=4)
        odd: Decimal = Field(multiple_of=Decimal("0.07"))  # a step llguidance cannot hold
        bounded_digits: Decimal = Field(ge=0, max_digits=5, decimal_places=2)
        name: str

    props = json_schema(Price)["properties"]
    assert props["amount"] == {"type": "string", "pattern": DECIMAL_PATTERN, "title": "Amount"}
    assert {"type": "string", "pattern": DECIMAL_PATTERN} in props["tip"]["anyOf"]
    assert props["rate"] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 100.0, "title": "Rate"}
    # Within 15 significant digits, which a float keeps (Pydantic reads the number as one).
    assert props["step"] == {"type": "number", "multipleOf": 0.5, "title": "Step",
                             "exclusiveMaximum": 10 ** 14, "exclusiveMinimum": -10 ** 14}
    assert props["cents"] == {"type": "string", "pattern": decimal_pattern(None, 2), "title": "Cents"}
    assert props["fee"] == {"type": "number", "multipleOf": 0.01, "minimum": 0.0, "title": "Fee",
                            "exclusiveMaximum": 10 ** 13}
    assert props["coarse"]["anyOf"] == [{"type": "number", "multipleOf": 0.5},
                                        {"type": "string", "pattern": decimal_pattern(4)}]
    assert props["odd"] == {"type": "string", "pattern": DECIMAL_PATTERN, "title": "Odd"}
    assert props["bounded_digits"]["anyOf"][0] == {"type": "number", "minimum": 0.0}
    assert props["bounded_digits"]["anyOf"][1]["pattern"] == decimal_pattern(5, 2)
    assert props["name"] == Price.model_json_schema()["properties"]["name"]
    assert narrowed_schema(Price) == json_schema(Price)
    assert narrowed_schema(type("N", (BaseModel,), {"__annotations__": {"n": float}})) is None
    assert narrowed_schema({"type": "object"}) is None and narrowed_schema(int) is None


def test_the_grammar_holds_a_decimals_step_and_bounds(qwen3_5_engine):
    """What the schemas above rely on from llguidance: a fractional ``multipleOf`` held
    exactly, with bounds, and no exponent; each text it takes validates, each it refuses
    fails the model."""
    from mlx_tandem.constraints import Constraint

    class Price(BaseModel):
        step: Decimal = Field(multiple_of=Decimal("0.05"))
        cents: Decimal = Field(multiple_of=Decimal("0.01"))
        fee: Decimal = Field(multiple_of=Decimal("0.25"), ge=0, le=10)
        odd: float = Field(multiple_of=0.07, ge=0)  # llguidance cannot hold it: dropped

    grammar = qwen3_5_engine._front.grammar

    def takes(name: str, text: str) -> bool:
        matcher = grammar.compile(Constraint.json_schema(json_schema(Price)["properties"][name]))
        return all(matcher.consume_token(t) for t in grammar.tokenizer.tokenize_str(text)) and matcher.is_accepting()

    def validates(name: str, text: str) -> bool:
        values = {"step": "0.05", "cents": '"0.01"', "fee": "0.25", "odd": "0.07", name: text}
        try:
            Price.model_validate_json("{%s}" % ", ".join(f'"{k}": {v}' for k, v in values.items()))
            return True
        except ValidationError:
            return False

    # (text, taken): every text taken validates; each text refused that validates is
    # written otherwise (an exponent, trailing zeros past the step: a grammar may allow
    # less, never more).
    cases = {"step": [("0.15", True), ("0.35", True), ("-1.05", True), ("3", True), ("0.07", False),
                      ("9999999999999.95", True), ("99999999999999.95", False),  # 16 digits: a float's rounding
                      ("1.234", False), ("1e1", False), ("2.5e-1", False), ("0.050", False)],
             "cents": [('"19.99"', True), ('"-0.5"', True), ('"7"', True), ('"1.234"', False),
                       ('"1e2"', False), ('"0.1 "', False), ("19.99", False)],
             "fee": [("9.75", True), ("10", True), ("0", True), ("10.25", False), ("-0.25", False),
                     ("0.3", False), ("2.5e0", False)],
             # Every request failed ("too many digits"); now the bound is held, the step not.
             "odd": [("0.14", True), ("7", True), ("-0.07", False)]}
    for name, texts in cases.items():
        for text, taken in texts:
            assert takes(name, text) == taken, (name, text)
            assert not taken or validates(name, text), (name, text)
        assert any(not taken and not validates(name, text) for text, taken in texts)  # real refusals too
    assert takes("odd", "0.1") and not validates("odd", "0.1")  # the step is Pydantic's to check


def test_digit_limits_no_text_fits_keep_pydantics_schema():
    assert decimal_pattern(0) is None
    model = _model(max_digits=0)
    assert json_schema(model) == model.model_json_schema()


def test_naive_datetimes_and_durations_are_held_to_what_the_type_takes():
    """``format: date-time`` always writes an offset, which NaiveDatetime refuses (every
    answer failed), and ``format: duration`` any number of digits, past what a timedelta
    holds: patterns instead, each text of which validates (a fuzz, 2026-11-30)."""
    import datetime

    from pydantic import AwareDatetime, NaiveDatetime

    class When(BaseModel):
        naive: NaiveDatetime
        aware: AwareDatetime
        any: datetime.datetime
        span: datetime.timedelta

    props = json_schema(When)["properties"]
    assert "format" not in props["naive"] and "format" not in props["span"]
    assert props["aware"]["format"] == props["any"]["format"] == "date-time"  # RFC 3339: an offset, as they take
    rng = random.Random(0)

    def stamp():
        tz = rng.choice(["", "", "Z", "+05:30"])
        frac = rng.choice(["", "." + "7" * rng.randint(1, 8)])
        return (f"{rng.randint(0, 9999):04d}-{rng.randint(0, 13):02d}-{rng.randint(0, 32):02d}{rng.choice('Tt _')}"
                f"{rng.randint(0, 25):02d}:{rng.randint(0, 61):02d}" + rng.choice(["", f":{rng.randint(0, 61):02d}{frac}"]) + tz)

    def span():
        parts = [f"{rng.randint(0, 10 ** rng.randint(1, 9))}{u}" for u in "YMWD" if rng.random() < 0.4]
        clock = [f"{rng.randint(0, 10 ** rng.randint(1, 9))}{u}" for u in "HMS" if rng.random() < 0.4]
        rng.shuffle(parts) if rng.random() < 0.2 else None
        return "P" + "".join(parts) + ("T" + "".join(clock) if clock or rng.random() < 0.1 else "")

    for field, make in (("naive", stamp), ("span", span)):
        texts = {make() for _ in range(20000)}
        allowed = [t for t in texts if re.search(props[field]["pattern"], t)]
        assert len(allowed) > 300, field
        for text in allowed:
            values = {"naive": "2020-01-01T00:00:00", "aware": "2020-01-01T00:00:00Z", "any": "2020-01-01T00:00:00",
                      "span": "P1D", field: text}
            try:
                When.model_validate(values)
            except ValidationError as exc:
                pytest.fail(f"{field}: {text!r} is allowed but refused: {exc}")


def test_the_grammar_keeps_floats_where_pydantic_checks_them(qwen3_5_engine):
    """A float's ``multiple_of`` is checked in binary floating point, which fails a multiple
    of 0.1 past about 10**7 steps (a sampled -35870854620523.3 failed), and a finite float
    read infinity from a long exponent: the number is kept where the check holds. Every
    text the grammar takes validates."""
    from pydantic import FiniteFloat

    from mlx_tandem.constraints import Constraint

    class Amounts(BaseModel):
        tenth: float = Field(multiple_of=0.1)
        twentieth: float = Field(multiple_of=0.05, ge=0)
        halves: float = Field(multiple_of=2.5)
        wide: float = Field(multiple_of=0.1, ge=0, le=1e12)  # its own bound past where the check holds
        coarse: float = Field(multiple_of=123.4)  # fails just past 2**23, as 0.1 does
        finite: FiniteFloat
        plain: float  # infinity is a float: left as it was

    props = json_schema(Amounts)["properties"]
    assert "exclusiveMaximum" not in props["plain"]
    grammar = qwen3_5_engine._front.grammar
    matchers = {}

    def takes(name: str, text: str) -> bool:
        if name not in matchers:
            matchers[name] = Constraint.json_schema(props[name])
        m = grammar.compile(matchers[name])
        return all(m.consume_token(t) for t in grammar.tokenizer.tokenize_str(text)) and m.is_accepting()

    rng = random.Random(0)
    base = {"tenth": "0.1", "twentieth": "0.05", "halves": "2.5", "wide": "0.1", "coarse": "123.4", "finite": "1.5",
            "plain": "1"}
    steps = {"tenth": Decimal("0.1"), "twentieth": Decimal("0.05"), "halves": Decimal("2.5"), "wide": Decimal("0.1"),
             "coarse": Decimal("123.4")}
    for name in ("tenth", "twentieth", "halves", "wide", "coarse", "finite"):
        texts = ["56E63524760826950", "1e400", "-35870854620523.3", "52176088.9", "8392804.2"]
        for _ in range(300):
            k = rng.randint(0, 10 ** rng.randint(1, 16)) * rng.choice([1, -1])
            texts.append(format(k * steps[name], "f") if name in steps else f"{k}.{rng.randint(0, 99)}")
        taken = [t for t in texts if takes(name, t)]
        assert len(taken) > 50, name
        for text in taken:
            try:
                Amounts.model_validate_json("{%s}" % ", ".join(f'"{k}": {v}' for k, v in {**base, name: text}.items()))
            except ValidationError as exc:
                pytest.fail(f"{name}: the grammar takes {text}, which the model refuses: {exc}")
    assert takes("plain", "1e400")  # reads as inf, which a float takes
