"""pattern_witness: the short strings closing mode writes out to satisfy a pattern."""

from __future__ import annotations

import json
import re

import pytest

from mlx_tandem.constraints import Constraint
from mlx_tandem.pattern_witness import schema_patterns, shortest_match, witnesses


@pytest.mark.parametrize("pattern,expected", [
    ("foo", "foo"),
    ("bar[0-9]", "bar0"),
    (r"^(yes|no)$", "no"),  # the shorter branch
    (r"\d{4}-\d{2}", "0000-00"),
    (r"^(\w)x\1$", "axa"),  # a back-reference repeats its group
    (r"[^a-zA-Z0-9]", "_"),
    (r'a"$', 'a"'),  # a quote only where nothing else fits
    (r"\\$", "\\"),
    (r"^[^@\s]+@[^@\s]+\.[^@\s]+$", "a@a.a"),
])
def test_witnesses_are_short_and_match(pattern, expected):
    assert shortest_match(pattern) == expected
    assert re.search(pattern, expected)


@pytest.mark.parametrize("pattern", [
    r"(?=x)y",  # a lookahead the witness ignores: re.search refuses it
    "a{1000}",  # too long to be worth writing out
    "\\",  # not a regex
    "^$",  # only the empty string: nothing to write
    "(?:(?:(?:(?:(?:(?:a){64}){64}){64}){64}){64}){64}",  # nested counts: 64**6 characters, never built
])
def test_no_witness_where_none_helps(pattern):
    assert not witnesses([pattern])


def test_schema_patterns_and_hints():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "foo"},
        "b": {"type": "array", "items": {"type": "string", "pattern": 'q"'}},
        "c": {"type": "object", "patternProperties": {"^k[0-9]$": {"type": "string", "pattern": "foo"}}},
    }}
    assert schema_patterns(schema) == ["foo", 'q"', "^k[0-9]$"]
    # Hints are spelled as inside a JSON string: the quote escaped.
    assert Constraint.json_schema(schema).hints == ("foo", 'q\\"', "k0")
    assert Constraint.regex("(ab)+c").hints == ("abc",)
    assert Constraint.lark('start: "x"').hints == ()
    # Hints do not change what a constraint is.
    assert Constraint.json_schema(schema) == Constraint("json_schema", Constraint.json_schema(schema).source,
                                                        "json_schema")
    assert json.loads(Constraint.json_schema(schema).source)["properties"]["a"]["pattern"] == "foo"
