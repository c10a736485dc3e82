"""Grammar-constrained decoding through the engine: response_format, forced tool calls, tool_choice.

The factory models have random weights, so their free text is noise: every assertion here is
about structure (the output parses and validates against the schema), about finishing within
the budget, or about equality with a reference run, never about particular words.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import re
from typing import Literal, Optional

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from mlx_tandem import Engine, SamplingParams
from mlx_tandem.chat_format import ChatFormat
from mlx_tandem.closing import closing_path
from mlx_tandem.constraints import Constraint, open_call_constraint, tool_call_constraint
from mlx_tandem.default_model import is_packaged
from mlx_tandem.errors import ConstraintError, InvalidRequestError

from .forcing import forcing_processor
from .prompts import chat_prompts

try:  # a second, independent validator where it is installed
    import jsonschema
except ImportError:  # pragma: no cover - pydantic validates either way
    jsonschema = None

USER = [{"role": "user", "content": "Answer in JSON please."}]


# ---------------------------------------------------------------------------- schemas
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class User(_Strict):
    name: str
    age: int


class Nested(_Strict):
    user: User
    tags: list[str]


class Scalars(_Strict):
    color: Literal["red", "green", "blue"]
    ok: bool
    x: float
    n: int = Field(ge=1, le=5)
    code: str = Field(max_length=6)


class Optionals(_Strict):
    a: str
    b: Optional[int] = None
    c: Optional[list[str]] = None


class Address(_Strict):
    street: str
    zip_code: int


class Person(_Strict):
    """A pydantic model whose generated schema (titles, $defs/$ref, anyOf null) is used as is."""

    name: str
    address: Address
    nickname: Optional[str] = None
    scores: list[float] = []


SCHEMAS = {  # name -> (JSON schema, pydantic type that validates the same documents)
    "nested_object": ({
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["user", "tags"],
    }, Nested),
    "array_of_strings": ({"type": "array", "items": {"type": "string"}}, list[str]),
    "enum_and_scalars": ({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}, "x": {"type": "number"},
            "n": {"type": "integer", "minimum": 1, "maximum": 5}, "code": {"type": "string", "maxLength": 6},
        },
        "required": ["color", "ok", "x", "n", "code"],
    }, Scalars),
    "optional_fields": ({
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"},
                       "c": {"type": "array", "items": {"type": "string"}}},
        "required": ["a"],
    }, Optionals),
    "pydantic_model": (Person.model_json_schema(), Person),
}


def validate(text: str, schema: dict, pytype) -> object:
    """Parse ``text`` as JSON and validate it against ``schema`` (pydantic, and jsonschema if present)."""
    value = json.loads(text)
    TypeAdapter(pytype).validate_json(text, strict=True)
    if jsonschema is not None:
        jsonschema.validate(value, schema)
    return value


def rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def assert_valid_structured(out, schema, pytype, max_tokens):
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    assert len(out.token_ids) <= max_tokens
    assert out.content == out.text  # only the JSON document: no reasoning, no extra text
    assert out.reasoning == "" and out.tool_calls == [] and out.invalid_tool_calls == []
    return validate(out.content, schema, pytype)


SAMPLINGS = [dict(), dict(temperature=1.0, seed=11), dict(temperature=1.0, seed=12, top_p=0.9)]


async def test_json_schema_outputs_validate(qwen3_5_engine):
    """Every schema, greedy and sampled, all in one batch: each answer is a valid document."""
    max_tokens = 50
    engine = qwen3_5_engine
    runs = [(name, s) for name in SCHEMAS for s in SAMPLINGS]
    outs = await asyncio.gather(*[
        engine.chat(USER, SamplingParams(max_tokens=max_tokens, **s), response_format=rf(SCHEMAS[name][0]))
        for name, s in runs])
    for (name, s), out in zip(runs, outs):
        schema, pytype = SCHEMAS[name]
        try:
            assert_valid_structured(out, schema, pytype, max_tokens)
        except Exception as exc:
            raise AssertionError(f"schema {name!r}, sampling {s}: {exc!r}\n{out.text!r}") from exc


async def test_schema_keywords_llguidance_cannot_hold_no_longer_fail_the_request(qwen3_5_engine):
    """pydantic's sets (``uniqueItems``), bytes, Path and SecretStr (formats llguidance does
    not know: binary, path, password) failed every request with a ConstraintError. Unknown
    formats are annotations, as JSON Schema allows, and uniqueness is not held: pydantic's
    sets take duplicates and drop them, so the answers validate."""
    from pathlib import Path

    from pydantic import BaseModel, SecretStr

    class Kinds(BaseModel):
        tags: set[str]
        ids: frozenset[int]
        blob: bytes
        where: Path
        secret: SecretStr

    schema = Kinds.model_json_schema()
    assert '"uniqueItems": true' in json.dumps(schema) and '"format": "binary"' in json.dumps(schema)
    outs = await asyncio.gather(*[qwen3_5_engine.chat(USER, SamplingParams(max_tokens=120, **s),
                                                      response_format=rf(schema)) for s in SAMPLINGS])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        Kinds.model_validate_json(out.content)


async def test_dicts_keyed_by_a_literal_or_an_enum_are_held_to_their_keys(qwen3_5_engine):
    """llguidance holds no ``propertyNames``, and every request with a ``dict[Literal[...], X]``
    or ``dict[AnEnum, X]`` failed (a fuzz): the names it lists are the object's optional
    properties, and no others, which takes the same objects."""
    import enum

    from pydantic import BaseModel

    from mlx_tandem.constraints import Constraint

    class Color(str, enum.Enum):
        red = "red"
        green = "green"

    class Tally(BaseModel):
        by_color: dict[Color, int]
        by_axis: dict[Literal["x", "y"], str]

    schema = Tally.model_json_schema()
    assert "propertyNames" in json.dumps(schema)
    from mlx_tandem.schema_prep import prepared_schema

    # A listed property keeps its schema, the other names take additionalProperties'; a
    # required key the names refuse is left for llguidance to refuse (no object fits).
    assert prepared_schema({"type": "object", "propertyNames": {"enum": ["a", "b"]},
                             "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}) == {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "additionalProperties": False}
    assert "propertyNames" in prepared_schema({"type": "object", "propertyNames": {"const": "a"}, "required": ["b"]})
    # Names restricted further (maxLength, a pattern, a $ref beside other keywords) are left
    # as written: listed as properties, "bb" was taken (review h96).
    defs = {"K": {"enum": ["a", "bb"]}}
    for names in ({"enum": ["a", "bb"], "type": "string", "maxLength": 1}, {"enum": ["a", "bb"], "pattern": "^a$"},
                  {"$ref": "#/$defs/K", "maxLength": 1}):
        assert "propertyNames" in prepared_schema({"type": "object", "$defs": defs, "propertyNames": names})
    grammar = qwen3_5_engine._front.grammar
    compiled = Constraint.json_schema(schema)

    def takes(text: str) -> bool:
        m = grammar.compile(compiled)
        return all(m.consume_token(t) for t in grammar.tokenizer.tokenize_str(text)) and m.is_accepting()

    texts = {'{"by_color": {"red": 1, "green": 2}, "by_axis": {"y": "up"}}': True,
             '{"by_color": {}, "by_axis": {}}': True,
             '{"by_color": {"blue": 1}, "by_axis": {}}': False,
             '{"by_color": {}, "by_axis": {"z": "no"}}': False,
             '{"by_color": {"red": "one"}, "by_axis": {}}': False}
    for text, taken in texts.items():
        assert takes(text) == taken, text
        try:
            Tally.model_validate_json(text)
            valid = True
        except ValueError:
            valid = False
        assert valid == taken, text
    outs = await asyncio.gather(*[qwen3_5_engine.chat(USER, SamplingParams(max_tokens=80, **s),
                                                      response_format=rf(schema)) for s in SAMPLINGS])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        Tally.model_validate_json(out.content)


def test_numeric_bounds_are_held_as_written_or_refused(qwen3_5_engine):
    """llguidance 1.9 took the bare ``0`` for ``exclusiveMinimum: 0`` under a maximum below 1
    (Pydantic's ``gt=0, lt=1e-3`` answered 0), read integer bounds past 2**53 as doubles and
    past int64 as int64 (``minimum: 2**70`` answered 9223372036854775807): such bounds are
    rewritten to ones it holds, or refused with a ConstraintError (a fuzz, 2026-11-30)."""
    from mlx_tandem.constraints import Constraint

    grammar = qwen3_5_engine._front.grammar

    def takes(schema: dict, text: str) -> bool:
        m = grammar.compile(Constraint.json_schema(schema))
        return all(m.consume_token(t) for t in grammar.tokenizer.tokenize_str(text)) and m.is_accepting()

    cases = [({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.5}, {"0": False, "0.25": True}),
             ({"type": "number", "exclusiveMinimum": 0, "maximum": 0.001}, {"0": False, "0.001": True}),
             ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-10},
              {"0": False, "0.00000000005": True}),
             ({"type": "number", "exclusiveMinimum": 1e6, "exclusiveMaximum": 1e6 + 0.5},
              {"1000000": False, "1000000.25": True}),
             ({"exclusiveMinimum": 1, "maximum": 1.5}, {"1": False, "1.5": True, "1.25": True}),
             ({"type": "number", "exclusiveMinimum": -0.5, "exclusiveMaximum": 0}, {"-0": False, "-0.25": True}),
             ({"type": "integer", "minimum": 2 ** 53 + 1, "maximum": 2 ** 53 + 3},
              {str(2 ** 53): False, str(2 ** 53 + 2): True, str(2 ** 53 + 4): False}),
             ({"type": "integer", "minimum": 0, "maximum": 2 ** 70}, {"5": True}),
             ({"type": "string", "minimum": 1e300}, {'"a"': True}),  # bounds say nothing of a string
             # draft 4's flag beside minimum: left as written (it was dropped with the bounds)
             ({"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 2 ** 60}, {"0": False, "1": True})]
    for schema, texts in cases:
        for text, taken in texts.items():
            assert takes(schema, text) == taken, (schema, text)
    for schema in ({"type": "integer", "minimum": 2 ** 70, "maximum": 2 ** 70 + 3},
                   {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0},  # empty: llguidance says so
                   {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-250},  # past 200 places
                   {"type": "number", "maximum": 1e300}, {"type": "integer", "minimum": 2 ** 1100}):
        with pytest.raises(ConstraintError):
            grammar.compile(Constraint.json_schema(schema))
    # Both integer bounds below -2**63 crashed the process (SIGSEGV) in llguidance's matcher.
    import subprocess
    import sys

    code = ("from mlx_tandem.schema_prep import prepared_schema; from mlx_tandem.errors import ConstraintError\n"
            "try:\n    prepared_schema({'type': 'integer', 'minimum': -2**70, 'maximum': -2**70 + 5})\n"
            "except ConstraintError:\n    print('refused')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "refused", (run.returncode, run.stderr[-400:])


# Schemas that closing objects by default (additionalProperties: false) must leave as they are.
UNCLOSABLE = {
    # const/enum/default values are data: a value with a "properties" key is no object schema.
    "data_with_a_properties_key": {
        "type": "object",
        "properties": {"o": {"const": {"properties": 1}}, "e": {"enum": [{"properties": {}}, 3]},
                       "d": {"type": "object", "default": {"properties": {"x": 1}}, "properties": {}}},
        "required": ["o", "e"]},
    # Each allOf branch names only its own keys; closed, the branches refuse each other's.
    "all_of_branches": {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                                  {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    # Requires a key it does not list: closed, nothing could satisfy it.
    "required_key_not_listed": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
    # allOf branches given as refs: the $defs entries share one object.
    "all_of_refs": {"$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                              "B": {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}},
                    "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
    # A lone allOf branch is a wrapper (a description beside a $ref): nothing is left open.
    "single_all_of_wrapper": {"type": "object", "required": ["sub", "other"], "properties": {
        "sub": {"allOf": [{"$ref": "#/$defs/Sub"}], "description": "d"}, "other": {"$ref": "#/$defs/Sub"}},
        "$defs": {"Sub": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    # A branch beside its parent's properties names keys of the same object.
    "any_of_beside_properties": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                 "anyOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
}


@pytest.mark.parametrize("name", UNCLOSABLE)
async def test_objects_are_closed_only_where_the_schema_still_allows_its_documents(qwen3_5_engine, name):
    import jsonschema as js

    schema = UNCLOSABLE[name]
    source = json.loads(Constraint.json_schema(schema).source)
    if name == "single_all_of_wrapper":  # the wrapped object is still closed, wherever it is used
        assert source["$defs"]["Sub"]["additionalProperties"] is False
    if name == "data_with_a_properties_key":
        props = source["properties"]
        assert (props["o"], props["e"], props["d"]["default"]) == (
            schema["properties"]["o"], schema["properties"]["e"], schema["properties"]["d"]["default"])
        assert props["d"]["additionalProperties"] is False and source["additionalProperties"] is False
    outs = await asyncio.gather(*[
        qwen3_5_engine.chat(USER, SamplingParams(max_tokens=60, **sampling), response_format=rf(schema))
        for sampling in SAMPLINGS])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        js.validate(json.loads(out.text), schema)


def test_schemas_that_are_not_json_data_or_too_deep_are_constraint_errors():
    fmt = ChatFormat(tool_call_start="<tool_call>", tool_call_end="</tool_call>", tool_format="json_tools")
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    cyclic: dict = {"type": "array"}
    cyclic["items"] = cyclic  # a dict that holds itself: refused, never walked for ever
    # A $defs entry that only refers back to itself describes no value: llguidance compiled it
    # into a grammar that rejected tokens mid-answer or ended a "stop" answer at '{"a": '.
    loop = {"type": "object", "properties": {"a": {"$ref": "#/$defs/D0"}}, "required": ["a"],
            "$defs": {"D0": {"$ref": "#/$defs/D1"}, "D1": {"$ref": "#/$defs/D0", "description": "x"}}}
    for bad in (deep, cyclic, {"type": "object", "properties": {"a": {"const": float("nan")}}},
                {"type": "object", "properties": {"a": {"const": object()}}}, loop):
        with pytest.raises(ConstraintError):
            Constraint.json_schema(bad)
        tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
        with pytest.raises(ConstraintError):  # a tool's parameters too, forced or opened lazily
            tool_call_constraint(fmt, [tool], ["f"], parallel=False, marker=json.dumps)
        with pytest.raises(ConstraintError):
            open_call_constraint(fmt, [tool], marker=json.dumps)
    # A recursive schema with content is fine.
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}, "$defs": {
        "Node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}}}
    assert Constraint.json_schema(node).kind == "json_schema"


async def test_schema_given_as_json_text_and_bare_form(llama_engine):
    schema, pytype = SCHEMAS["nested_object"]
    outs = await asyncio.gather(*[
        llama_engine.chat(USER, SamplingParams(max_tokens=50), response_format=fmt)
        for fmt in ({"type": "json_schema", "json_schema": {"schema": json.dumps(schema)}},
                    {"type": "json_schema", "schema": schema})])
    for out in outs:
        assert_valid_structured(out, schema, pytype, 50)


async def test_json_object(qwen3_5_engine):
    engine = qwen3_5_engine
    outs = await asyncio.gather(
        *[engine.chat(USER, SamplingParams(max_tokens=40, **s), response_format={"type": "json_object"})
          for s in SAMPLINGS],
        # Raw prompts take a response_format too.
        engine.complete("Some JSON:", SamplingParams(max_tokens=40), response_format={"type": "json_object"}))
    for out in outs:
        assert out.finish_reason == "stop" and len(out.token_ids) <= 40, out.text
        assert isinstance(json.loads(out.content), dict)


async def test_regex_and_lark_response_formats(qwen3_5_engine):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    grammar = 'start: answer ", " answer\nanswer: "yes" | "no" | "maybe"'
    outs = await asyncio.gather(*[
        qwen3_5_engine.chat(USER, SamplingParams(max_tokens=30, **s), response_format=f)
        for f in ({"type": "regex", "pattern": pattern}, {"type": "lark", "grammar": grammar})
        for s in SAMPLINGS])
    for out in outs[:3]:
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.content), out.content
    for out in outs[3:]:
        assert out.finish_reason == "stop" and re.fullmatch(r"(yes|no|maybe), (yes|no|maybe)", out.content)



@pytest.mark.parametrize("literal", ["cafe\u0301", "n\u0303o \u212b", "caf\u00e9"])
async def test_a_grammar_writes_its_text_exactly_past_the_tokenizers_normalizer(qwen3_5_engine, literal):
    """The tokenizer normalizes text to NFC; llguidance tokenized the text it forces through
    it, so a Lark literal with a combining mark ("e" + U+0301) was forced as the tokens of
    "\u00e9", which the grammar refused: the request failed (an audit). The grammar's bytes
    now come out as written, normalized or not."""
    fmt = {"type": "lark", "grammar": "start: " + json.dumps(literal, ensure_ascii=False)}
    for params in (SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=1.0, seed=3)):
        out = await qwen3_5_engine.chat(USER, params, response_format=fmt)
        assert out.content == literal and out.finish_reason == "stop", ascii(out.content)


# Text that spells an added token (``<think>`` is one token to the tokenizer): llguidance
# 1.9.1 forced the special token, then refused it ("grammar rejected token"), mid-answer.
SPELLED_MARKERS = [
    ({"type": "regex", "pattern": "<think>[a-z]{3}"}, r"<think>[a-z]{3}"),
    ({"type": "regex", "pattern": "(<think>|<tool_call>)[a-z]{3}"}, r"(<think>|<tool_call>)[a-z]{3}"),
    ({"type": "lark", "grammar": 'start: "a<think>b" | "<tool_call>"'}, r"a<think>b|<tool_call>"),
    (rf({"type": "object", "properties": {"a": {"const": "</think>"}}, "required": ["a"]}),
     r'\{"a": "</think>"\}'),
    (rf({"type": "object", "properties": {"a": {"type": "string", "pattern": "^<think>[0-9]$"}},
         "required": ["a"]}), r'\{"a": "<think>[0-9]"\}'),
]


async def _assert_spelled(engine, spellings, tokens: set, max_tokens: int) -> None:
    """Each format, greedy and sampled: the answer matches its pattern, ``tokens`` spelled
    in ordinary ones."""
    outs = await asyncio.gather(*[
        engine.chat(USER, SamplingParams(max_tokens=max_tokens, **s), response_format=f)
        for f, _ in spellings for s in SAMPLINGS])
    expected = [pattern for _, pattern in spellings for _ in SAMPLINGS]
    for out, pattern in zip(outs, expected):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.content), out.content
        assert not tokens & set(out.token_ids[:-1]), out.token_ids


async def test_formats_that_spell_an_added_token(qwen3_5_engine):
    special = set(qwen3_5_engine.tokenizer.get_added_vocab().values())
    await _assert_spelled(qwen3_5_engine, SPELLED_MARKERS, special, max_tokens=30)


# Text that spells an end token: llguidance forced the EOS id, which the matcher refuses
# there. MTP off, the request failed ("grammar rejected token"); MTP on, the walk ended the
# row at the allowed EOS and returned '{"tag": "' as a clean "stop" (an audit).
END_SPELLINGS = [
    (rf({"type": "object", "properties": {"tag": {"const": "<|im_end|>"}}, "required": ["tag"]}),
     r'\{"tag": "<\|im_end\|>"\}'),
    (rf({"type": "object", "properties": {"tag": {"type": "string", "pattern": "^a<\\|endoftext\\|>$"}},
         "required": ["tag"]}), r'\{"tag": "a<\|endoftext\|>"\}'),
    ({"type": "regex", "pattern": "Answer: <\\|im_end\\|>[a-z]{2}"}, r"Answer: <\|im_end\|>[a-z]{2}"),
    ({"type": "lark", "grammar": 'start: "X <|endoftext|>"'}, r"X <\|endoftext\|>"),
]


def test_a_finished_document_allows_its_end_tokens(qwen3_5_engine):
    """A stopped matcher refuses even the EOS its mask allows: repaired as forced text,
    the end of a document ending on a number had an empty mask, and the request failed
    (the first version of the end-token repair; README's ``value: int`` example)."""
    from mlx_tandem.token_classes import allowed_tokens

    grammar = qwen3_5_engine._front.grammar  # white-box: the engine's own compiler and token classes
    matcher = grammar.compile(Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                                      "required": ["n"]}))
    for tok in qwen3_5_engine.tokenizer.encode('{"n": 25}'):
        assert matcher.consume_token(tok), matcher.get_error()
    vocab = qwen3_5_engine.loaded.vocab_size
    allowed = allowed_tokens(matcher, vocab, grammar.tiers().respelled)
    assert set(np.flatnonzero(allowed)) == set(grammar.eos_token_ids)


MARKER_TOOL = {"type": "function", "function": {"name": "mark", "description": "Mark a turn.", "parameters": {
    "type": "object", "properties": {"marker": {"enum": ["<|im_end|>"]}}, "required": ["marker"]}}}


@pytest.mark.parametrize("mtp", ["off", "on"])
async def test_formats_that_spell_an_end_token(qwen3_5_mtp_path, mtp):
    engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp=mtp)
    await engine.start()
    try:
        await _assert_spelled(engine, END_SPELLINGS, set(engine.tokenizer.eos_token_ids), max_tokens=40)
        call = await engine.chat(USER, SamplingParams(max_tokens=40), tools=[MARKER_TOOL], tool_choice="required")
        assert [c.arguments for c in call.tool_calls] == [{"marker": "<|im_end|>"}], call.text
    finally:
        await engine.close()


async def test_closing_spells_an_added_token(qwen3_5_engine):
    """At the smallest budget that holds the document, closing mode spells the marker too."""
    schema = {"type": "object", "properties": {"a": {"const": "<tool_call>"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    n = _closing_length(qwen3_5_engine, schema)
    outs = await asyncio.gather(*[
        qwen3_5_engine.chat(USER, SamplingParams(max_tokens=n, **s), response_format=rf(schema))
        for s in SAMPLINGS])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert json.loads(out.content)["a"] == "<tool_call>"


# ---------------------------------------------------------------------------- budget
def _closing_length(engine, schema, long_words: bool = False) -> int:
    """Tokens the closing mode needs to finish ``schema`` from scratch (EOS included)."""
    grammar = engine._front.grammar  # white-box: the engine's own compiler and closing preferences
    constraint = Constraint.json_schema(schema)
    path = closing_path(grammar.compile(constraint), grammar.tiers(), frozenset(grammar.eos_token_ids),
                        limit=10_000, hints=grammar.hint_ids(constraint), long_words=long_words)
    assert path is not None
    return len(path)


class Joke(_Strict):
    setup: str
    punchline: str


def _demo_grammar():
    """The embedded demo model's compiler: its tokenizer, like real ones, has ``}}``, ``]}``
    and ``"]}}`` tokens, which the factory tokenizer lacks."""
    from transformers import AutoTokenizer

    from mlx_tandem.constraints import GrammarCompiler
    from mlx_tandem.default_model import packaged_model_path

    config = json.loads((packaged_model_path() / "config.json").read_text())
    text = config.get("text_config", config)
    eos = config.get("eos_token_id", text.get("eos_token_id"))
    return GrammarCompiler(AutoTokenizer.from_pretrained(packaged_model_path()), text["vocab_size"],
                           eos if isinstance(eos, list) else [eos])


def _close_from(grammar, schema, prefix: str) -> str:
    """The document closing mode writes after ``prefix`` (``schema``: a JSON schema or a Constraint)."""
    constraint = schema if isinstance(schema, Constraint) else Constraint.json_schema(schema)
    matcher = grammar.compile(constraint)
    ids = grammar.tokenizer.tokenize_str(prefix)
    for t in ids:
        assert matcher.consume_token(t), prefix
    path = closing_path(matcher, grammar.tiers(), frozenset(grammar.eos_token_ids), limit=200,
                        hints=grammar.hint_ids(constraint))
    assert path is not None, prefix
    body = [t for t in path if t not in grammar.eos_token_ids]
    return grammar.tokenizer.decode_str(ids + body)


@pytest.mark.skipif(not is_packaged(), reason="a source tree without the packaged weights")
@pytest.mark.parametrize("vocabulary", ["factory", "demo"])
def test_closing_mode_ends_strings_with_a_quote(qwen3_5_engine, vocabulary):
    """Inside a string, closer characters are content: "}}" there closes nothing. Closing
    mode picked it forever on the demo tokenizer, found no completion, and so never steered
    the answer closed; and a closer that opens a string ('"]}}') is content too."""
    grammar = qwen3_5_engine._front.grammar if vocabulary == "factory" else _demo_grammar()
    joke = Joke.model_json_schema()
    nested, _ = SCHEMAS["nested_object"]
    cases = [  # (schema, pytype, what the model wrote, what closing mode must make of it)
        (joke, Joke, "", lambda d: d == {"setup": "", "punchline": ""}),
        (joke, Joke, '{"setup": "Why did the', lambda d: d == {"setup": "Why did the", "punchline": ""}),
        (joke, Joke, '{"setup": "a}', lambda d: d == {"setup": "a}", "punchline": ""}),
        (nested, Nested, '{"user": {"name": "Bo', lambda d: d["user"]["name"] == "Bo" and d["tags"] == []),
        (nested, Nested, '{"user": {"name": "Bo", "age": 7}, "tags": ["x',
         lambda d: d == {"user": {"name": "Bo", "age": 7}, "tags": ["x"]}),
    ]
    for schema, pytype, prefix, expected in cases:
        doc = _close_from(grammar, schema, prefix)
        assert expected(validate(doc, schema, pytype)), (prefix, doc)


class Priced(_Strict):
    name: str
    price: float = Field(gt=0)


@pytest.mark.skipif(not is_packaged(), reason="a source tree without the packaged weights")
@pytest.mark.parametrize("vocabulary", ["factory", "demo"])
def test_closing_mode_gets_past_content_it_could_repeat(qwen3_5_engine, vocabulary):
    """Where the best closing token is content the grammar takes again and again, plain
    greedy found no completion (a fuzzer over schemas, formats, patterns and grammars found
    these): "]" in a string held to a pattern, "0" where a number must not be zero, "(" in
    nested parentheses, "." and "}" in turn in an email address; and "}" closing nested
    objects leaves the same choices on a vocabulary without "}}"."""
    grammar = qwen3_5_engine._front.grammar if vocabulary == "factory" else _demo_grammar()
    code = {"type": "object", "properties": {"code": {"type": "string", "pattern": r"^[A-Z0-9_\-\[\]]+$"}},
            "required": ["code"]}
    email = {"type": "object", "properties": {"email": {"type": "string", "format": "email"}}, "required": ["email"]}
    parens = {"type": "array", "items": {"type": "string", "pattern": r"^\(.*\)$"}, "minItems": 3}
    low = {"type": "object", "properties": {"v": {"type": "number", "minimum": -10}}, "required": ["v"]}
    sexpr = 'start: list\nlist: "(" (item (" " item)*)? ")"\nitem: ATOM | list\nATOM: /[a-z]+/'
    arith = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/'
    json_cases = [  # (schema, pytype, what the model wrote, what closing mode must make of it)
        (code, dict, '{"code": "AB', lambda d: d["code"].startswith("AB")),
        (Priced.model_json_schema(), Priced, "", lambda d: d["price"] > 0),
        (low, dict, '{"v": -', lambda d: -10 <= d["v"] <= 0),
        (email, dict, '{"email": "bob', lambda d: d["email"].startswith("bob") and "@" in d["email"]),
        (parens, list[str], "", lambda d: len(d) == 3),
        ({"type": "object"}, dict, '{"a": {"b": {"c": [{"d": 1', lambda d: d == {"a": {"b": {"c": [{"d": 1}]}}}),
    ]
    for schema, pytype, prefix, expected in json_cases:
        doc = _close_from(grammar, schema, prefix)
        assert expected(validate(doc, schema, pytype)), (prefix, doc)
    assert _close_from(grammar, Constraint.lark(sexpr), "(a (b") == "(a (b))"
    assert _close_from(grammar, Constraint.lark(arith), "(1+(2") == "(1+(2))"
    assert _close_from(grammar, Constraint.regex(r"\(\d+(,\d+)*\)"), "(07") == "(07)"


@pytest.mark.skipif(not is_packaged(), reason="a source tree without the packaged weights")
@pytest.mark.parametrize("vocabulary", ["factory", "demo"])
def test_closing_mode_spells_out_what_a_pattern_needs(qwen3_5_engine, vocabulary):
    """In a string held to an unanchored literal ("foo"), to one ending in a quote or a
    backslash, every single token leaves the allowed set as it was: the search found no
    completion and the answer ended with "length". It writes out a witness of the pattern
    (pattern_witness.py), escaped as the JSON string needs, from wherever the string is."""
    grammar = qwen3_5_engine._front.grammar if vocabulary == "factory" else _demo_grammar()
    email = r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$"
    for pattern in ["foo", "bar[0-9]", "hello world", r'a"$', r"\\$", r"x\d{2}y", email]:
        schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
        for prefix in ["", '{"s": "', '{"s": "some text ']:
            if pattern == email and prefix.endswith(" "):
                continue  # the pattern refuses the prefix
            doc = _close_from(grammar, schema, prefix)
            value = validate(doc, schema, dict)["s"]
            assert re.search(pattern, value) and value.startswith(prefix[7:]), (pattern, prefix, doc)
    # Several patterns in one schema, and a top-level regex.
    two = {"type": "object", "properties": {"a": {"type": "string", "pattern": "foo"},
                                            "b": {"type": "string", "pattern": "bar"}}, "required": ["a", "b"]}
    assert validate(_close_from(grammar, two, '{"a": "x'), two, dict)["a"].startswith("x")
    # Witnesses are tried shortest first: "b"'s twenty digits fit "a" too, and crowded out "0".
    digits = {"type": "object", "properties": {"b": {"type": "string", "pattern": "^[0-9]{20}$"},
                                               "a": {"type": "string", "pattern": "[0-9]"}}, "required": ["b", "a"]}
    assert validate(_close_from(grammar, digits, '{"b": "' + "0" * 20 + '", "a": "'), digits, dict)["a"] == "0"
    assert re.fullmatch(r"(ab)+c", _close_from(grammar, Constraint.regex(r"(ab)+c"), "abab"))


async def test_answers_with_formats_and_patterns_close_within_their_budget(qwen3_5_engine):
    """End to end on the random model, which fills strings with noise: an email field and a
    pattern-held code ended with "length" and broken JSON while closing mode found no path."""
    class Contact(_Strict):
        email: str = Field(json_schema_extra={"format": "email"})
        code: str = Field(pattern=r"^[A-Z0-9_\-\[\]]+$")
        price: float = Field(gt=0)

    schema = Contact.model_json_schema()
    assert schema["properties"]["email"]["format"] == "email"
    runs = [(n, sampling) for n in (40, 60, 120) for sampling in SAMPLINGS[:2]]
    outs = await asyncio.gather(*[
        qwen3_5_engine.chat(USER, SamplingParams(max_tokens=n, **sampling), response_format=rf(schema))
        for n, sampling in runs])
    for (n, _), out in zip(runs, outs):
        doc = assert_valid_structured(out, schema, Contact, n)
        assert "@" in doc["email"]


@pytest.mark.skipif(not is_packaged(), reason="a source tree without the packaged weights")
def test_demo_model_structured_answer_closes_within_its_budget():
    """with_structured_output(Joke) as users call it: the demo model writes on inside the
    setup string, and the answer must still close, valid, within max_tokens."""
    from mlx_tandem import Engine

    schema = Joke.model_json_schema()
    with Engine(show_progress=False) as engine:
        outs = [engine.chat_sync([{"role": "user", "content": "Tell me a joke about cats"}],
                                 SamplingParams(max_tokens=n), response_format=rf(schema)) for n in (20, 40, 60)]
    for n, out in zip((20, 40, 60), outs):
        assert_valid_structured(out, schema, Joke, n)


def test_a_forced_call_that_fits_its_budget_is_the_models_own():
    """The demo model's forced ``add(4, 5)`` is 24 tokens. At max_tokens=25 closing mode
    took ``"b": 0``: the search after "5" closed with "}}" and "\\n" (4 tokens), not "}}\\n"
    (3, but not counted a closer), so "5" was judged not to fit; at 24 the same call ended
    with "length", the EOS after it unwritten (a fuzz, 2026-11-30). A forced call now ends
    at its end marker, and a closer with a template's whitespace is a closer."""
    from mlx_tandem import Engine

    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    with Engine(show_progress=False) as engine:
        outs = {n: engine.chat_sync([{"role": "user", "content": "Add 4 and 5 using the tool."}],
                                    SamplingParams(max_tokens=n), tools=tools, tool_choice="add", reasoning=False)
                for n in (24, 25, 40)}
    calls = {n: [(c.name, c.arguments) for c in out.tool_calls] for n, out in outs.items()}
    assert len(outs[40].token_ids) == 24 and calls[40] == [("add", {"a": 4, "b": 5})]
    assert calls[24] == calls[25] == calls[40]
    assert all(out.finish_reason == "tool_calls" and out.usage.completion_tokens == 24 for out in outs.values())


async def test_budget_just_large_enough_still_gives_valid_output(qwen3_5_engine):
    """max_tokens equal to (or just above) what closing mode needs: still a valid document.
    What it needs is its shorter spelling: content in long tokens closes enum_and_scalars
    in 37 tokens where bytes first take 42 (until 2026-11-28 a budget of 37 or 38 ended
    with "length")."""
    engine = qwen3_5_engine
    runs = []
    for name in ("nested_object", "enum_and_scalars", "pydantic_model", "array_of_strings"):
        n0 = min(_closing_length(engine, SCHEMAS[name][0]), _closing_length(engine, SCHEMAS[name][0], True))
        runs += [(name, n, s) for n in (n0, n0 + 1, n0 + 3) for s in SAMPLINGS[:2]]
    outs = await asyncio.gather(*[
        engine.chat(USER, SamplingParams(max_tokens=n, **s), response_format=rf(SCHEMAS[name][0]))
        for name, n, s in runs])
    for (name, n, s), out in zip(runs, outs):
        assert_valid_structured(out, *SCHEMAS[name], n)


def test_a_completion_found_within_a_limit_fits_it(qwen3_5_engine):
    """closing_path's completion, EOS included, is never longer than its limit. It was once
    one token longer: a row forced onto it wrote the document's last closer as its last
    token and ended with "length" (seen on a GPU, where the model wrote a long number)."""
    grammar = qwen3_5_engine._front.grammar
    for name in ("enum_and_scalars", "nested_object", "pydantic_model"):
        constraint = Constraint.json_schema(SCHEMAS[name][0])
        n0 = _closing_length(qwen3_5_engine, SCHEMAS[name][0])
        for limit in range(n0 - 2, n0 + 12):
            path = closing_path(grammar.compile(constraint), grammar.tiers(), frozenset(grammar.eos_token_ids),
                                limit=limit, hints=grammar.hint_ids(constraint))
            assert path is None or len(path) <= limit, (name, limit, len(path))


def _scripted_preferences(grammar) -> dict[str, np.ndarray]:
    """Logit preferences of scripted "models" that push closing mode: digits for ever, long
    tokens, opening brackets, never EOS, and random ones."""
    tiers = grammar.tiers()
    vocab = grammar.vocab_size
    opening = np.array([grammar.tokenizer.decode_str([i]).strip()[:1] in ("[", "{") for i in range(vocab)])
    rng = np.random.default_rng(0)
    return {
        "digits": np.where(tiers.tier == 3, 5.0, 0.0),
        "long": tiers.length / 4.0,
        "opening": np.where(opening, 1.0, 0.0),
        "no_eos": np.where(np.isin(np.arange(vocab), list(grammar.eos_token_ids)), -50.0, 0.0),
        "random": rng.normal(size=vocab) * 3,
    }


@pytest.mark.parametrize("name", ["enum_and_scalars", "nested_object", "pydantic_model"])
def test_scripted_models_close_at_every_budget_from_the_shortest_completion(qwen3_5_engine, name):
    """The processor, driven by models that push it (``_scripted_preferences``, with noise
    seeded by the budget), ends with EOS and a valid document at every budget from the
    shortest completion up. Two gaps found this way (2026-11-28): a completion one token
    longer than its limit was forced and ended with "length" (digits for ever, budget 41 of
    enum_and_scalars), and the budgets between the completion spelled byte-first (42) and
    in long tokens (37) ended with "length"."""
    import mlx.core as mx

    from mlx_tandem.closing import GrammarProcessor

    grammar = qwen3_5_engine._front.grammar
    schema, pytype = SCHEMAS[name]
    constraint = Constraint.json_schema(schema)
    eos = set(grammar.eos_token_ids)
    n0 = min(_closing_length(qwen3_5_engine, schema), _closing_length(qwen3_5_engine, schema, True))
    for strategy, prefer in _scripted_preferences(grammar).items():
        for budget in range(n0, n0 + 16):
            proc = GrammarProcessor(grammar.compile(constraint), tiers=grammar.tiers(),
                                    eos_token_ids=grammar.eos_token_ids, max_tokens=budget,
                                    vocab_size=grammar.vocab_size, hints=grammar.hint_ids(constraint))
            noise = np.random.default_rng(budget)
            out: list[int] = []
            while len(out) < budget and not (out and out[-1] in eos):
                logits = (prefer + noise.normal(size=grammar.vocab_size) * 0.5).astype(np.float32)
                out.append(int(np.argmax(np.array(proc(mx.array(out or [0]), mx.array(logits))))))
            text = grammar.tokenizer.decode_str([t for t in out if t not in eos])
            assert out[-1] in eos, (strategy, budget, text)
            validate(text, schema, pytype)


async def test_budget_too_small_ends_with_length(qwen3_5_engine):
    engine = qwen3_5_engine
    key = "a_rather_long_required_key_name"
    schema = {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]}
    # Every valid answer starts with this exact text (no free whitespace). A token covers at
    # most `widest` of its characters, and EOS needs a token of its own.
    prefix = '{"' + key + '": "'
    widest = max(max((j for j in range(len(t) + 1) if t[:j] in prefix), default=0)
                 for t in (engine.tokenizer.decode([i]) for i in range(engine.loaded.vocab_size)))
    too_small = -(-len(prefix) // widest)  # budgets up to this cannot hold prefix + EOS
    assert too_small >= 2
    runs = [(n, s) for n in range(1, too_small + 1) for s in SAMPLINGS[:2]]
    outs = await asyncio.gather(
        *[engine.chat(USER, SamplingParams(max_tokens=n, **s), response_format=rf(schema)) for n, s in runs],
        # A forced tool call that cannot fit either.
        engine.chat(USER, SamplingParams(max_tokens=3), tools=TOOLS, tool_choice="required"))
    for (n, _), out in zip(runs, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == n
    assert outs[-1].finish_reason == "length" and outs[-1].tool_calls == []
    # The engine is fine afterwards.
    out = await engine.chat(USER, SamplingParams(max_tokens=_closing_length(engine, schema) + 5), response_format=rf(schema))
    assert out.finish_reason == "stop" and set(json.loads(out.content)) == {key}


def _opener_lover(engine):
    """A user logits processor for a worst-case model: it always opens or extends structure.

    It boosts "[", "{" and "," tokens; the grammar (which runs after user processors) keeps
    only the legal ones, so the answer nests and grows for as long as it is allowed to.
    """
    import mlx.core as mx
    import numpy as np

    texts = [engine.tokenizer.decode([i]) for i in range(engine.loaded.vocab_size)]
    boost = mx.array(np.array([50.0 if t.strip() and set(t.strip()) <= set("[{,") else 0.0 for t in texts],
                              dtype=np.float32))
    return lambda tokens, logits: logits + boost


async def test_every_budget_from_the_closing_length_up_ends_validly(llama_engine):
    """Sweep max_tokens from what closing mode needs upwards: always "stop" and valid.

    Catches a closing mode that steers too late, with the random model and with one that
    keeps nesting: one token can lengthen the shortest completion by several ("," in an
    array of arrays, " {" in an object), and a deep nest must be noticed long before the end.
    """
    engine = llama_engine
    adversary = _opener_lover(engine)
    grid = {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}
    cases = [  # (name, schema, pytype, budgets, logits processors)
        ("nested_object", *SCHEMAS["nested_object"], range(0, 9), ()),
        ("grid", grid, list[list[int]], range(0, 12), (adversary,)),
        ("json_object", {"type": "object"}, dict, (0, 1, 2, 60, 120), (adversary,)),
    ]
    runs = []
    for name, schema, pytype, budgets, procs in cases:
        n0 = _closing_length(engine, schema)
        runs += [(name, schema, pytype, n0 + b, procs) for b in budgets]
    outs = await asyncio.gather(*[
        engine.chat(USER, SamplingParams(max_tokens=n, logits_processors=list(procs)), response_format=rf(schema))
        for _, schema, _, n, procs in runs])
    for (name, schema, pytype, n, _), out in zip(runs, outs):
        assert out.finish_reason == "stop", (name, n, out.text)
        validate(out.content, schema, pytype)
        assert len(out.token_ids) <= n


async def test_long_optional_key_near_the_end_of_the_budget(qwen3_5_engine):
    """Every budget from a few tokens above the closing length ends with a valid document.

    An optional key whose name is longer than the fixed slack, started right before the end,
    left no completion that fits ("length", unfinished JSON): near the end a choice of
    structure now takes the completion's closer or separator.
    """
    engine = qwen3_5_engine
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string"}, "a_long_optional_description": {"type": "string"},
        "another_optional_list_of_things": {"type": "array", "items": {"type": "integer"}}}}
    pytype = dict
    n0 = _closing_length(engine, schema)
    runs = [(n, dict(temperature=1.0, seed=seed)) for n in range(n0 + 5, n0 + 17) for seed in (n, 1000 + n)]
    outs = await asyncio.gather(*[
        engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=n, **s), response_format=rf(schema))
        for n, s in runs])
    for (n, s), out in zip(runs, outs):
        assert out.finish_reason == "stop" and len(out.token_ids) <= n, (n, s, out.text)
        validate(out.content, schema, pytype)


async def test_optional_keys_before_the_required_one_close_from_the_shortest_budget(qwen3_5_engine):
    """Optional keys listed before the only required one: a model that opens one near the
    end (the key choice is ordinary text, no special token) ran a budget eight tokens over
    the closing length into "length" on every seed. Near the end such small choices are
    now judged branch by branch: only keys a completion still fits after stay open."""
    engine = qwen3_5_engine
    schema = {"type": "object", "required": ["last"], "properties": {
        **{f"opt_{i:02d}": {"type": "string"} for i in range(6)}, "last": {"type": "string"}}}
    n0 = _closing_length(engine, schema)
    runs = [(n, s) for n in (n0 + 2, n0 + 8) for s in range(4)]
    outs = await asyncio.gather(*[
        engine.chat([{"role": "user", "content": "go"}], SamplingParams(max_tokens=n, temperature=1.0, seed=s),
                    response_format=rf(schema)) for n, s in runs])
    for (n, s), out in zip(runs, outs):
        assert out.finish_reason == "stop" and len(out.token_ids) <= n, (n, s, out.text)
        validate(out.content, schema, dict)


class Cat(_Strict):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Shelter(_Strict):
    """A dict of objects: opening one more entry adds about 20 tokens to the completion."""

    xs: list[int] = Field(min_length=2, max_length=3)
    cats: dict[str, Cat]


async def test_a_dict_of_objects_closes_at_every_budget(qwen3_5_engine):
    engine = qwen3_5_engine
    schema = Shelter.model_json_schema()
    n0 = _closing_length(engine, schema)
    runs = [(n, sampling) for n in range(n0, n0 + 48, 3) for sampling in (dict(), dict(temperature=1.0, seed=n))]
    outs = await asyncio.gather(*[
        engine.chat(USER, SamplingParams(max_tokens=n, **sampling), response_format=rf(schema)) for n, sampling in runs])
    for (n, sampling), out in zip(runs, outs):
        assert_valid_structured(out, schema, Shelter, n)


def _allowed_near_the_end(grammar, constraint, prefix: str, remaining: int, width: int = 0) -> set[str]:
    """What a row's grammar processor lets through after ``prefix``, ``remaining`` tokens
    before the end of its budget (as text of the allowed tokens)."""
    import mlx.core as mx

    from mlx_tandem.closing import GrammarProcessor

    matcher = grammar.compile(constraint)
    for t in grammar.tokenizer.tokenize_str(prefix):
        assert matcher.consume_token(t), prefix
    proc = GrammarProcessor(matcher, tiers=grammar.tiers(), eos_token_ids=grammar.eos_token_ids,
                            max_tokens=remaining, vocab_size=grammar.vocab_size)
    masked = np.array(proc.mask(mx.zeros((1, width or grammar.vocab_size))))[0]
    return {grammar.tokenizer.decode_str([i]) for i in np.flatnonzero(masked == 0)}


@pytest.mark.parametrize("vocabulary", ["factory", pytest.param("demo", marks=pytest.mark.skipif(
    not is_packaged(), reason="a source tree without the packaged weights"))])
def test_near_the_end_only_choices_of_structure_are_steered(qwen3_5_engine, vocabulary):
    """Within the structure slack of the end, closing takes a new key, entry or item away
    where it would overrun (a long optional key, a dict entry), but never what goes on with
    a value: the next digit of a number, a longer enum value, a regex match that may go on.
    A new entry is the model's to add where every choice was judged to leave a completion
    that fits (2026-11-30: steering took away items and keys that fitted, an audit)."""
    grammar = qwen3_5_engine._front.grammar if vocabulary == "factory" else _demo_grammar()
    integer = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    enum = Constraint.json_schema({"type": "object", "properties": {"a": {"enum": ["x", "xy"]}}, "required": ["a"]})
    digits = Constraint.regex("[0-9]+")
    for remaining in (12, 20, 30):
        assert "2" in _allowed_near_the_end(grammar, integer, '{"a": 1', remaining)
        assert "y" in _allowed_near_the_end(grammar, enum, '{"a": "x', remaining)
        assert "2" in _allowed_near_the_end(grammar, digits, "4", remaining)
        # A choice of structure alone: it may close; a new entry only where one fits.
        steered = _allowed_near_the_end(grammar, Constraint.json_schema(Shelter.model_json_schema()),
                                        '{"xs": [1, 2], "cats": {', remaining)
        assert "}" in steered
    for remaining in (4, 8, 12):  # no room for an entry: it closes
        steered = _allowed_near_the_end(grammar, Constraint.json_schema(Shelter.model_json_schema()),
                                        '{"xs": [1, 2], "cats": {', remaining)
        assert steered and all(t.startswith("}") for t in steered), steered
    far = _allowed_near_the_end(grammar, Constraint.json_schema(Shelter.model_json_schema()),
                                '{"xs": [1, 2], "cats": {', 400)
    assert "}" in far and '"' in far  # far from the end the model may add an entry
    # Logits wider than the tokenizer's vocabulary (padded embeddings) steer the same.
    steered = _allowed_near_the_end(grammar, Constraint.json_schema(Shelter.model_json_schema()),
                                    '{"xs": [1, 2], "cats": {', 12, width=grammar.vocab_size + 64)
    assert steered and all(t.startswith("}") for t in steered), steered


PATTERNS = [r"^[A-Z][a-z]+ [A-Z][a-z]+$", r"[0-9]{3}", r"^.*x$", r"[a-z]+$", r"^\d{3}-\d{4}$",
            r"^[a-f0-9]{8}-[a-f0-9]{4}$", "@", "foo", r'a"$', r"\\$",
            # Narrow (under half the vocabulary), so no "free text": the witness was never
            # tried, and the search went round letters after "@c" to the budget (a fuzz).
            r"^[a-z]+(\.[a-z]+)*@[a-z]+\.(com|org)$"]


async def test_strings_held_to_a_pattern_close(qwen3_5_engine):
    """Unanchored patterns (JSON Schema's default) and ones whose way out passes the state
    the string began in ("First Last") never closed: every candidate left the allowed set
    as it was, and the search repeated the best one for ever. So did a narrow pattern whose
    way out its witness knows (an e-mail address)."""
    import jsonschema as js

    runs = [(p, n, sampling) for p in PATTERNS for n in (40, 120) for sampling in SAMPLINGS[:2]]
    outs = await asyncio.gather(*[
        qwen3_5_engine.chat(USER, SamplingParams(max_tokens=n, **sampling), response_format=rf(
            {"type": "object", "properties": {"s": {"type": "string", "pattern": p}}, "required": ["s"]}))
        for p, n, sampling in runs])
    for (p, n, sampling), out in zip(runs, outs):
        assert out.finish_reason == "stop", (p, n, sampling, out.text)
        doc = json.loads(out.text)
        assert re.search(p, doc["s"]), (p, doc)
        js.validate(doc, {"type": "object", "properties": {"s": {"type": "string", "pattern": p}}})


class Event(_Strict):
    note: str
    when: datetime.date
    at: datetime.datetime
    alarm: datetime.time


def test_date_formats_take_exactly_the_dates_python_reads(qwen3_5_engine):
    """Year 0000, second 60 and February 29 outside leap years pass RFC 3339 (and
    llguidance's own format) but not Python's datetime, so not Pydantic."""
    grammar = qwen3_5_engine._front.grammar

    def takes(fmt: str, text: str) -> bool:
        matcher = grammar.compile(Constraint.json_schema({"type": "string", "format": fmt}))
        return all(matcher.consume_token(t) for t in grammar.tokenizer.tokenize_str(json.dumps(text))) \
            and matcher.is_accepting()

    def python_reads(text: str) -> bool:
        try:
            datetime.date.fromisoformat(text)
            return True
        except ValueError:
            return False

    days = [f"{y:04d}-{m:02d}-{d:02d}" for y in (1900, 2000, 2023, 2024) for m in (2, 4, 12) for d in range(27, 32)]
    assert [takes("date", d) for d in days] == [python_reads(d) for d in days]
    assert not takes("date", "0000-01-01") and takes("date", "0001-01-01")
    assert takes("date-time", "2024-02-29T23:59:59.5+05:30") and not takes("date-time", "2023-02-29T00:00:00Z")
    assert not takes("date-time", "2024-01-01T23:59:60Z") and not takes("time", "23:59:60Z")
    assert takes("time", "23:59:59Z")


async def test_dates_and_times_are_ones_python_can_read(qwen3_5_engine):
    """RFC 3339 allows year 0000 and second 60, which Python's datetime (so Pydantic) refuses;
    closing mode wrote both ("0000-01-01", "...:60Z")."""
    schema = Event.model_json_schema()
    n0 = _closing_length(qwen3_5_engine, schema)
    runs = [(n, sampling) for n in (n0, n0 + 4, n0 + 12, 120) for sampling in SAMPLINGS[:2]]
    outs = await asyncio.gather(*[
        qwen3_5_engine.chat(USER, SamplingParams(max_tokens=n, **sampling), response_format=rf(schema))
        for n, sampling in runs])
    for (n, _), out in zip(runs, outs):
        assert out.finish_reason == "stop", out.text
        Event.model_validate_json(out.text)


# ---------------------------------------------------------------------------- tool calls
class WeatherArgs(_Strict):
    city: str
    unit: Literal["celsius", "fahrenheit"] = "celsius"
    days: Optional[int] = Field(default=None, ge=1, le=7)


class AddArgs(_Strict):
    a: int
    b: int


class Point(_Strict):
    x: int
    y: int


class MoveArgs(_Strict):
    """Nested pydantic model: its schema refers to Point through $defs/$ref."""

    to: Point
    speed: Optional[float] = None


TOOL_MODELS = {"get_weather": WeatherArgs, "add": AddArgs, "move": MoveArgs}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                      "parameters": model.model_json_schema()}}
    for name, model in TOOL_MODELS.items()
]


def assert_valid_calls(out, allowed_names):
    assert out.finish_reason == "tool_calls", (out.finish_reason, out.text)
    assert out.tool_calls and out.invalid_tool_calls == []
    assert out.content.strip() == ""
    for c in out.tool_calls:
        assert c.name in allowed_names
        assert c.id.startswith("call_")
        TOOL_MODELS[c.name].model_validate_json(c.arguments_json, strict=True)
        if jsonschema is not None:
            jsonschema.validate(c.arguments, TOOL_MODELS[c.name].model_json_schema())
    assert len({c.id for c in out.tool_calls}) == len(out.tool_calls)


TOOL_CHOICES = [  # (tool_choice, the names a forced call may use)
    ("required", set(TOOL_MODELS)),
    ("any", set(TOOL_MODELS)),
    (True, set(TOOL_MODELS)),
    ({"type": "any"}, set(TOOL_MODELS)),
    ("get_weather", {"get_weather"}),
    ("move", {"move"}),
    ({"type": "function", "function": {"name": "add"}}, {"add"}),
    ({"type": "function", "name": "add"}, {"add"}),
    ({"type": "tool", "name": "get_weather"}, {"get_weather"}),
]


@pytest.mark.parametrize("template_kwargs,banned", [(None, [7]), ({"tools": [{"name": "mine"}]}, [])])
@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_without_tools_the_call_marker_is_banned(tool_choice, template_kwargs, banned):
    """No tools, no call (as OpenAI's API): the marker is banned, unless the caller renders
    tools through the template itself."""
    from mlx_tandem.chat_format import ChatFormat
    from mlx_tandem.chat_plan import plan_chat

    fmt = ChatFormat(think_start="<think>", think_end="</think>", tool_call_start="<tool_call>",
                     tool_call_end="</tool_call>", tool_format="json_tools", tool_parser=lambda t, tools: json.loads(t))
    plan = plan_chat(fmt, tools=None, tool_choice=tool_choice, response_format=None, reasoning=None,
                     parallel_tool_calls=None, template_kwargs=template_kwargs, marker=json.dumps, encode=lambda s: [7])
    assert plan.tools is None and not plan.parse_tool_calls and plan.constraint is None
    assert plan.banned_token_ids == ([7] if tool_choice == "none" else banned)


@pytest.mark.parametrize("tool_choice,names", TOOL_CHOICES + [
    ("auto", None), (None, None), ({"type": "auto"}, None), ("none", None), ({"type": "none"}, None),
    ({"type": "required"}, set(TOOL_MODELS)),
    ({"name": "add"}, {"add"}), ({"function": {"name": "move"}}, {"move"}),  # a name without a type: forced
])
def test_tool_choice_forms_plan_the_same_constraints(tool_choice, names):
    """Every spelling of tool_choice plans the grammar of exactly its tools (no model needed)."""
    from mlx_tandem.chat_format import ChatFormat
    from mlx_tandem.chat_plan import plan_chat

    fmt = ChatFormat(think_start="<think>", think_end="</think>", tool_call_start="<tool_call>",
                     tool_call_end="</tool_call>", tool_format="json_tools", tool_parser=lambda t, tools: json.loads(t))
    plan = plan_chat(fmt, tools=TOOLS, tool_choice=tool_choice, response_format=None, reasoning=None,
                     parallel_tool_calls=False, template_kwargs=None, marker=json.dumps, encode=lambda s: [7])
    if names is None:
        assert plan.constraint is None
        none = tool_choice in ("none", {"type": "none"})
        assert plan.tools == (None if none else TOOLS) and plan.parse_tool_calls == (not none)
        assert plan.banned_token_ids == ([7] if none else [])
        assert "enable_thinking" not in plan.template_kwargs
    else:
        ordered = [n for n in TOOL_MODELS if n in names]
        assert plan.constraint.description == f"tool_call({', '.join(ordered)})"
        assert plan.tools == TOOLS and plan.parse_tool_calls and not plan.forced_json_calls
        assert plan.template_kwargs == {"enable_thinking": False}  # constrained: no reasoning


async def _forced_calls(engine, choices, samplings, max_tokens=64, parallel=False):
    """One request per choice, in one batch; the samplings take turns."""
    runs = [(tc, names, samplings[i % len(samplings)]) for i, (tc, names) in enumerate(choices)]
    outs = await asyncio.gather(*[
        engine.chat(USER, SamplingParams(max_tokens=max_tokens, **s), tools=TOOLS, tool_choice=tc,
                    parallel_tool_calls=parallel)
        for tc, _, s in runs])
    for (tc, names, s), out in zip(runs, outs):
        try:
            assert_valid_calls(out, names)
        except Exception as exc:
            raise AssertionError(f"tool_choice={tc!r}, sampling {s}: {exc!r}\n{out.text!r}") from exc
    return [(tc, names, out) for (tc, names, _), out in zip(runs, outs)]


async def test_forced_tool_call(llama_engine):
    choices = [TOOL_CHOICES[i] for i in (0, 5, 6, 8)]
    for tc, names, out in await _forced_calls(llama_engine, choices, SAMPLINGS[:2]):
        assert len(out.tool_calls) == 1, tc  # parallel_tool_calls=False: exactly one
        if len(names) == 1:
            assert out.tool_calls[0].name == next(iter(names))


async def test_forced_tool_call_qwen3_5(qwen3_5_engine):
    choices = [TOOL_CHOICES[i] for i in (1, 4, 7)]
    for tc, names, out in await _forced_calls(qwen3_5_engine, choices, SAMPLINGS[:2]):
        assert len(out.tool_calls) == 1
        if len(names) == 1:
            assert out.tool_calls[0].name == next(iter(names))


async def test_forced_parallel_tool_calls(llama_engine):
    choices = [("required", set(TOOL_MODELS)), ("add", {"add"})]
    results = await _forced_calls(llama_engine, choices, SAMPLINGS[1:], max_tokens=90, parallel=True)
    assert all(len(out.tool_calls) >= 1 for _, _, out in results)


async def test_forced_tool_call_streamed(llama_engine):
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5)
    kw = dict(tools=TOOLS, tool_choice="get_weather", parallel_tool_calls=False)
    out = await llama_engine.chat(USER, params, **kw)
    assert_valid_calls(out, {"get_weather"})
    deltas = [d async for d in llama_engine.stream_chat(USER, params, **kw)]
    assert [t for d in deltas for t in d.token_ids] == out.token_ids  # same seed, same answer
    streamed = [c for d in deltas for c in d.tool_calls]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in out.tool_calls]
    assert deltas[-1].finish_reason == "tool_calls"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert "".join(d.content or "" for d in deltas) == out.content


def _tool_call_token(engine) -> int:
    ids = engine.tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_a_dict_naming_a_tool_forces_it_even_when_named_like_a_keyword():
    """A name is a name: tools called "none", "auto" or "any" were read as the keywords
    (no tools, no call, or any tool). The bare strings stay keywords, as in OpenAI's API."""
    from mlx_tandem.chat_plan import _forced_names

    names = ["f", "none", "auto", "any"]
    for name in ("none", "auto", "any"):
        assert _forced_names({"type": "function", "function": {"name": name}}, names) == [name]
        assert _forced_names({"type": "tool", "name": name}, names) == [name]
        assert _forced_names({"name": name}, names) == [name]
    assert _forced_names("none", names) == [] and _forced_names("auto", names) is None
    assert _forced_names("any", names) == names


async def test_tool_choice_none_never_emits_a_call(qwen3_5_engine):
    engine = qwen3_5_engine
    tc = _tool_call_token(engine)
    eos = engine.loaded.eos_token_ids[0]

    def push():  # a user processor that tries to force <tool_call> at every step
        return SamplingParams(max_tokens=12, logits_processors=[forcing_processor([tc] * 12, eos)])

    # Under "auto" the processor does get the marker out (so the check below means something)...
    auto = await engine.chat(USER, push(), tools=TOOLS)
    assert tc in auto.token_ids
    # ...under "none" it never appears, and the prompt carries no tools.
    outs = await asyncio.gather(*[
        engine.chat(USER, params, tools=TOOLS, tool_choice=choice)
        for params in (push(), SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=1.0, seed=3))
        for choice in ("none", {"type": "none"})])
    for out in outs:
        assert tc not in out.token_ids
        assert out.tool_calls == [] and out.invalid_tool_calls == []
        assert "<tools>" not in engine.tokenizer.decode(out.prompt_token_ids)
        assert out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("opened", [False, True])
async def test_asked_to_reason_the_model_reasons_then_the_constraint_holds_the_answer(qwen3_5_engine, opened):
    """``reasoning=True`` with a response_format or a forced call: reasoning first, then the
    grammar holds what follows ``</think>``. The request was rendered with reasoning off
    whatever it asked. ``opened``: the prompt opens the reasoning (Qwen3.5's template); else
    the model may open it. Closing mode still ends every answer with a valid document:
    ``</think>`` is the way out of the free text."""
    engine = qwen3_5_engine
    schema, pytype = SCHEMAS["optional_fields"]
    eos = engine.loaded.eos_token_ids[0]
    chat, options = USER, {"reasoning": True}
    if opened:
        chat = USER + [{"role": "assistant", "content": "<think>\n"}]
        options["template_kwargs"] = {"continue_final_message": True}
    head = "" if opened else "<think>"

    async def forced(text, **kw):
        ids = engine.tokenizer.encode(head + text, add_special_tokens=False)
        return await engine.chat(chat, SamplingParams(max_tokens=len(ids) + 40,
                                                      logits_processors=[forcing_processor(ids, eos)]), **options, **kw)

    out = await forced('I will say 3.</think>\n\n{"a": "x", "b": 3}', response_format=rf(schema))
    assert (out.reasoning, out.content, out.finish_reason) == ("I will say 3.", '{"a": "x", "b": 3}', "stop")
    assert 0 < out.usage.reasoning_tokens < out.usage.completion_tokens
    call = await forced('Add them.</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
                        tools=TOOLS, tool_choice="add")
    assert call.reasoning == "Add them." and [(c.name, c.arguments) for c in call.tool_calls] == [("add", {"a": 2, "b": 3})]

    budgets = (40, 90)
    runs = [(n, seed) for n in budgets for seed in range(4)]
    outs = await asyncio.gather(*[engine.chat(chat, SamplingParams(max_tokens=n, temperature=1.0, seed=seed),
                                              response_format=rf(schema), **options) for n, seed in runs])
    for (n, _), out in zip(runs, outs):
        assert out.finish_reason == "stop" and len(out.token_ids) <= n, (out.finish_reason, out.text)
        validate(out.content, schema, pytype)
    if opened:  # the random model never closes its reasoning by itself: closing mode did
        assert all(out.reasoning for out in outs)
    # The content is exactly the constraint's, whether or not the model reasoned (the blank
    # line after </think> was allowed before an answer with no reasoning, and kept in it).
    pattern = {"type": "regex", "pattern": "A[0-9]+"}
    outs = await asyncio.gather(*[engine.chat(chat, SamplingParams(max_tokens=40, temperature=1.0, seed=seed),
                                              response_format=pattern, **options) for seed in range(6)])
    assert all(re.fullmatch("A[0-9]+", out.content) for out in outs), [out.content for out in outs]
    # A regex with an escaped slash: nested in the reasoning grammar its slash was escaped
    # again and the request refused (a lexer error), though it ran without reasoning.
    slashed = {"type": "regex", "pattern": r"[0-9]+\/[0-9]+"}
    outs = await asyncio.gather(*[engine.chat(chat, SamplingParams(max_tokens=40, temperature=1.0, seed=seed),
                                              response_format=slashed, **options) for seed in range(3)])
    assert all(re.fullmatch("[0-9]+/[0-9]+", out.content) for out in outs), [out.content for out in outs]
    # A grammar of no string is refused here too: nested after the reasoning it compiled and
    # ended the answer empty, with "stop".
    with pytest.raises(ConstraintError, match="matches no string"):
        await engine.chat(chat, SamplingParams(max_tokens=20), response_format={"type": "regex", "pattern": r"[^\s\S]"},
                          **options)


async def test_tool_choice_none_keeps_the_response_format(qwen3_5_engine):
    schema, pytype = SCHEMAS["nested_object"]
    out = await qwen3_5_engine.chat(USER, SamplingParams(max_tokens=45), tools=TOOLS, tool_choice="none",
                                    response_format=rf(schema))
    assert_valid_structured(out, schema, pytype, 45)


async def test_response_format_with_auto_tools_gives_calls_or_json(qwen3_5_engine):
    """Under tool_choice="auto" a JSON response_format holds the text answer, not the tools
    (OpenAI's API; LangChain's create_agent binds both): an answer is valid calls or a valid
    document. Before, the format's grammar held the whole answer and no tool could be called."""
    engine = qwen3_5_engine
    schema, pytype = SCHEMAS["optional_fields"]
    samplings = [dict(), *(dict(temperature=1.0, seed=s) for s in range(6))]
    outs = await asyncio.gather(*[engine.chat(USER, SamplingParams(max_tokens=90, **s), tools=TOOLS,
                                              response_format=rf(schema)) for s in samplings])
    for out in outs:
        if out.tool_calls or out.invalid_tool_calls:
            assert_valid_calls(out, set(TOOL_MODELS))
        else:
            assert_valid_structured(out, schema, pytype, 90)

    # A model that calls (forced here token by token) gets its call; one that answers, its
    # document; parallel_tool_calls=False allows one call only.
    eos = engine.loaded.eos_token_ids[0]
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    answers = {"call": call, "two calls": call + "\n" + call, "document": '{"a": "Ann", "b": 3}'}

    async def run(text, **options):
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        return await engine.chat(USER, SamplingParams(max_tokens=len(ids) + 40,
                                                      logits_processors=[forcing_processor(ids, eos)]),
                                 tools=TOOLS, response_format=rf(schema), **options)

    got = {k: await run(v) for k, v in answers.items()}
    assert [(c.name, c.arguments) for c in got["call"].tool_calls] == [("add", {"a": 2, "b": 3})]
    assert [(c.name, c.arguments) for c in got["two calls"].tool_calls] == [("add", {"a": 2, "b": 3})] * 2
    assert_valid_calls(got["call"], {"add"})
    assert assert_valid_structured(got["document"], schema, pytype, 90) == {"a": "Ann", "b": 3}
    one = await run(answers["two calls"], parallel_tool_calls=False)
    assert [(c.name, c.arguments) for c in one.tool_calls] == [("add", {"a": 2, "b": 3})]


async def test_calls_or_a_document_close_at_every_budget_the_document_fits(qwen3_5_engine):
    """A call is about twice as long as a small document: near the end of the budget,
    closing keeps only the branches that still fit. A budget that fitted the document ended
    with "length" in a call the model opened (or the search took) and could not finish."""
    engine = qwen3_5_engine
    schema, pytype = SCHEMAS["optional_fields"]
    budgets = range(8, 40)
    plain = await asyncio.gather(*[engine.chat(USER, SamplingParams(max_tokens=n), response_format=rf(schema))
                                   for n in budgets])
    smallest = next(n for n, out in zip(budgets, plain) if out.finish_reason == "stop")
    runs = [(n, seed) for n in range(smallest, smallest + 20) for seed in (None, 0, 1, 2)]
    outs = await asyncio.gather(*[
        engine.chat(USER, SamplingParams(max_tokens=n, **({} if seed is None else {"temperature": 1.0, "seed": seed})),
                    tools=TOOLS, response_format=rf(schema)) for n, seed in runs])
    for (n, seed), out in zip(runs, outs):
        assert out.finish_reason in ("stop", "tool_calls"), (n, seed, out.text)
        if out.tool_calls:
            assert_valid_calls(out, set(TOOL_MODELS))
        else:
            assert_valid_structured(out, schema, pytype, n)


async def test_a_call_longer_than_a_search_walks_is_not_opened_where_it_cannot_fit(qwen3_5_engine, monkeypatch):
    """A tool whose smallest call is longer than the budget, beside a one-key document: the
    call's branch is judged by a search, and that search was capped at ``_SEARCH_CAP``
    tokens, which cannot tell a call that does not fit from a long one: the branch was
    kept, a model fond of calling opened it, and the answer ended with "length" (review
    h160). The branch is taken away where the call cannot fit, and kept where it can."""
    import mlx.core as mx

    from mlx_tandem import closing

    engine = qwen3_5_engine
    grammar = engine._front.grammar  # white-box: the smallest call, as closing finds it
    params = {f"p{i}": {"type": "integer"} for i in range(40)}
    tools = [{"type": "function", "function": {"name": "wide", "description": "Takes many numbers.",
                                               "parameters": {"type": "object", "properties": params,
                                                              "required": list(params)}}}]
    forced = tool_call_constraint(engine.chat_format, tools, ["wide"], parallel=False, marker=grammar.marker)
    smallest = closing_path(grammar.compile(forced), grammar.tiers(), frozenset(grammar.eos_token_ids),
                            limit=10_000, hints=grammar.hint_ids(forced))
    # A search cap below the call's length: the cap holds the row's own search, never the
    # judging of a branch. (With the real cap the call is short enough to be closed.)
    assert smallest is not None and 200 < len(smallest) < closing._SEARCH_CAP - 60
    cap = len(smallest) - 100
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (opener,) = engine.tokenizer.encode("<tool_call>", add_special_tokens=False)

    def fond_of_calling(tokens, logits):
        return logits + mx.where(mx.arange(logits.shape[-1]) == opener, 50.0, 0.0).astype(logits.dtype)

    def run(n):
        return engine.chat(USER, SamplingParams(max_tokens=n, logits_processors=[fond_of_calling]),
                           tools=tools, response_format=rf(schema))

    budgets = (cap + 24, len(smallest) - 10)
    monkeypatch.setattr(closing, "_SEARCH_CAP", cap)
    outs = await asyncio.gather(*[run(n) for n in budgets])
    for n, out in zip(budgets, outs):
        assert_valid_structured(out, schema, dict, n)
    monkeypatch.undo()
    roomy = await run(len(smallest) + 60)
    assert roomy.finish_reason == "tool_calls" and [c.name for c in roomy.tool_calls] == ["wide"]
    assert set(roomy.tool_calls[0].arguments) == set(params)


# ---------------------------------------------------------------------------- errors
BAD_REQUESTS = [
    (dict(tools=TOOLS, tool_choice="no_such_tool"), ConstraintError),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), ConstraintError),
    (dict(tool_choice="required"), ConstraintError),
    (dict(tool_choice="get_weather"), ConstraintError),
    (dict(tools=TOOLS, tool_choice=42), ConstraintError),
    (dict(tools=TOOLS, tool_choice={}), ConstraintError),  # names no tool: not "auto"
    (dict(tools=TOOLS, tool_choice={"type": "sometimes"}), ConstraintError),
    (dict(tools=TOOLS, tool_choice={"function": {"name": "nope"}}), ConstraintError),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), ConstraintError),
    (dict(tools=TOOLS, tool_choice="add", response_format=rf({"type": "object"})), ConstraintError),
    (dict(response_format=rf({"type": "nonsense"})), ConstraintError),
    (dict(response_format=rf({"type": "integer", "minimum": "zero"})), ConstraintError),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": "{not json"}}), ConstraintError),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "no schema"}}), ConstraintError),
    (dict(response_format={"type": "json_schema", "json_schema": "not a dict"}), ConstraintError),
    (dict(response_format={"type": "regex", "pattern": "(("}), ConstraintError),
    (dict(response_format={"type": "lark", "grammar": "start: undefined_rule"}), ConstraintError),
    (dict(response_format={"type": "xml"}), ConstraintError),
    (dict(response_format="json"), ConstraintError),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          tool_choice="f"), ConstraintError),
    (dict(tools=[{"foo": 1}]), InvalidRequestError),
    (dict(tools=["get_weather"]), InvalidRequestError),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), InvalidRequestError),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]), InvalidRequestError),
    (dict(tools=TOOLS + TOOLS[:1]), InvalidRequestError),
]


def _bad_id(case):
    return "-".join(sorted(case[0]))


@pytest.mark.parametrize("options,error", BAD_REQUESTS, ids=[_bad_id(c) for c in BAD_REQUESTS])
async def test_bad_constraints_fail_at_call_time(qwen3_5_engine, options, error):
    engine = qwen3_5_engine
    submitted = engine.stats()["requests"]
    with pytest.raises(error):
        await engine.chat(USER, SamplingParams(max_tokens=8), **options)
    with pytest.raises(error):
        engine.chat_sync(USER, SamplingParams(max_tokens=8), **options)
    with pytest.raises(error):
        async for _ in engine.stream_chat(USER, SamplingParams(max_tokens=8), **options):
            pass
    with pytest.raises(error):
        next(iter(engine.stream_chat_sync(USER, SamplingParams(max_tokens=8), **options)))
    assert engine.stats()["requests"] == submitted  # refused before anything reached the engine


async def test_one_call_allowed_ends_the_row_as_finished(qwen3_5_engine):
    """parallel_tool_calls=False: the answer ends at its first valid call and its row is
    freed there; the request counts as finished, not aborted."""
    engine = qwen3_5_engine
    marker = engine._front.grammar.marker
    body = json.dumps('\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n')
    grammar = f'start: {marker("<tool_call>")} {body} {marker("</tool_call>")} " and then " /[a-z ]{{40,}}/'
    before = engine.stats()
    out = await engine.chat(USER, SamplingParams(max_tokens=80), tools=TOOLS, parallel_tool_calls=False,
                            response_format={"type": "lark", "grammar": grammar})
    assert out.finish_reason == "tool_calls" and out.content == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", {"city": "Oslo"})]
    after = engine.stats()  # counted by the time chat() returns (it waits for the engine's next loop)
    assert after["finished"] == before["finished"] + 1 and after["aborted"] == before["aborted"]
    assert after["running"] == 0


@pytest.mark.parametrize("mtp", ["off", "on"])
def test_stats_count_an_answer_cut_at_its_call_when_chat_returns(qwen3_5_mtp_path, mtp):
    """The reader cuts the answer and tells the engine through its inbox; stats() read as
    chat() returned still had the row running and the tokens decoded past the call (an
    audit). Async and sync, MTP off and on: finished, and generation_tokens as usage counts."""
    engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp=mtp).start_sync()
    try:
        marker = engine._front.grammar.marker
        body = json.dumps('\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n')
        grammar = f'start: {marker("<tool_call>")} {body} {marker("</tool_call>")} " and then " /[a-z ]{{60,}}/'
        kw = dict(tools=TOOLS, parallel_tool_calls=False, response_format={"type": "lark", "grammar": grammar})
        for call in (lambda: engine.chat_sync(USER, SamplingParams(max_tokens=90), **kw),
                     lambda: asyncio.run(engine.chat(USER, SamplingParams(max_tokens=90), **kw))):
            before = engine.stats()
            out = call()
            after = engine.stats()
            assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1
            assert (after["running"], after["finished"] - before["finished"]) == (0, 1)
            assert after["generation_tokens"] - before["generation_tokens"] == out.usage.completion_tokens
    finally:
        engine.close_sync()


def test_an_answer_cut_at_its_call_as_the_engine_closes_logs_nothing(qwen3_5_path, caplog):
    """chat() waits for a no-op the engine fails once closed: its exception was never read,
    and asyncio logged "Future exception was never retrieved" (review h141)."""
    import gc
    import logging

    async def run():
        engine = Engine(qwen3_5_path, show_progress=False)
        await engine.start()
        marker = engine._front.grammar.marker
        body = json.dumps('\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n')
        grammar = f'start: {marker("<tool_call>")} {body} {marker("</tool_call>")} " and then " /[a-z ]{{60,}}/'
        core = engine._core
        cut = core.finish_early

        def cut_then_closed(req, kept):  # a close from another thread lands right after the cut
            cut(req, kept)
            core._mark_closed()

        core.finish_early = cut_then_closed
        out = await engine.chat(USER, SamplingParams(max_tokens=90), tools=TOOLS, parallel_tool_calls=False,
                                response_format={"type": "lark", "grammar": grammar})
        await engine.close()
        return out

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        out = asyncio.run(run())
        gc.collect()
    assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


async def test_engine_keeps_serving_after_bad_constraints(qwen3_5_engine):
    engine = qwen3_5_engine
    bad = [engine.chat(USER, SamplingParams(max_tokens=8), **opts) for opts, _ in BAD_REQUESTS]
    schema, pytype = SCHEMAS["optional_fields"]
    good = [engine.chat(USER, SamplingParams(max_tokens=10)),
            engine.chat(USER, SamplingParams(max_tokens=30), response_format=rf(schema)),
            engine.chat(USER, SamplingParams(max_tokens=40), tools=TOOLS, tool_choice="get_weather",
                        parallel_tool_calls=False)]
    results = await asyncio.gather(*bad, *good, return_exceptions=True)
    for (_, error), res in zip(BAD_REQUESTS, results):
        assert isinstance(res, error), res
    plain, structured, called = results[len(bad):]
    assert plain.finish_reason in ("stop", "length") and len(plain.token_ids) >= 1
    assert_valid_structured(structured, schema, pytype, 30)
    assert_valid_calls(called, {"get_weather"})
    for _ in range(100):  # a call that ends its answer frees its row on the engine's next loop
        if engine.stats()["running"] == 0:
            break
        await asyncio.sleep(0.01)
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0


# ---------------------------------------------------------------------------- batching
def _constrained_calls(engine, n):
    """``n`` different constrained requests: schemas and forced tool calls, greedy and sampled."""
    calls, checks = [], []
    names = list(SCHEMAS)
    for i in range(n):
        s = SAMPLINGS[i % len(SAMPLINGS)]
        if i % 3 == 2:
            tool = list(TOOL_MODELS)[(i // 3) % 2]  # get_weather, add
            calls.append(engine.chat(USER, SamplingParams(max_tokens=50, **s), tools=TOOLS, tool_choice=tool,
                                     parallel_tool_calls=False))
            checks.append(lambda out, tool=tool: assert_valid_calls(out, {tool}))
        else:
            schema, pytype = SCHEMAS[names[i % len(names)]]
            calls.append(engine.chat(USER, SamplingParams(max_tokens=56, **s), response_format=rf(schema)))
            checks.append(lambda out, schema=schema, pytype=pytype: assert_valid_structured(out, schema, pytype, 56))
    return calls, checks


async def test_concurrent_constrained_requests_are_all_valid(llama_engine):
    engine = llama_engine
    before = engine.stats()["constrained_requests"]
    calls, checks = _constrained_calls(engine, 8)
    outs = await asyncio.gather(*calls)
    for check, out in zip(checks, outs):
        check(out)
    assert engine.stats()["constrained_requests"] == before + 8


async def test_constrained_rows_do_not_perturb_other_rows(engine):
    prompts = chat_prompts(3)
    params = [SamplingParams(max_tokens=20 + 6 * i) for i in range(len(prompts))]
    alone = [await engine.chat(p, sp) for p, sp in zip(prompts, params)]
    calls, checks = _constrained_calls(engine, 3)
    mixed = await asyncio.gather(*calls, *[engine.chat(p, sp) for p, sp in zip(prompts, params)])
    for check, out in zip(checks, mixed):
        check(out)
    for a, b in zip(alone, mixed[len(calls):]):
        assert b.token_ids == a.token_ids
        assert b.tool_calls == [] and b.finish_reason == a.finish_reason


async def test_constrained_requests_are_counted(qwen3_5_engine):
    engine = qwen3_5_engine
    before = engine.stats()["constrained_requests"]
    await engine.chat(USER, SamplingParams(max_tokens=5))
    await engine.chat(USER, SamplingParams(max_tokens=5), tools=TOOLS)  # "auto": not constrained
    await engine.chat(USER, SamplingParams(max_tokens=5), tools=TOOLS, tool_choice="none")
    assert engine.stats()["constrained_requests"] == before
    await asyncio.gather(
        engine.chat(USER, SamplingParams(max_tokens=20), response_format={"type": "json_object"}),
        engine.complete("x", SamplingParams(max_tokens=20), response_format={"type": "regex", "pattern": "[ab]{3}"}))
    assert engine.stats()["constrained_requests"] == before + 2


async def test_sync_and_async_constrained_answers_agree(llama_engine):
    schema, pytype = SCHEMAS["pydantic_model"]
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=99)
    a = await llama_engine.chat(USER, params, response_format=rf(schema))
    b = await asyncio.to_thread(llama_engine.chat_sync, USER, params, response_format=rf(schema))
    deltas = await asyncio.to_thread(lambda: list(llama_engine.stream_chat_sync(USER, params, response_format=rf(schema))))
    assert a.token_ids == b.token_ids == [t for d in deltas for t in d.token_ids]
    assert "".join(d.content for d in deltas) == a.content
    assert_valid_structured(a, schema, pytype, 48)


def test_a_ban_folded_into_the_sampler_draws_as_the_processor_does():
    """The text lane folds a TokenBan into the row's sampler, so banned rows share one
    sampler and mlx-lm samples the batch in one call: it must draw exactly what the
    processor form (mask the logits, then normalize and sample) draws, and never a banned id."""
    import mlx.core as mx

    from mlx_tandem import SamplingParams
    from mlx_tandem.constraints import TokenBan
    from mlx_tandem.samplers import banned_sampler, make_request_sampler

    logits = 3 * mx.random.normal((64, 50), key=mx.random.key(3))
    banned = tuple(sorted({int(mx.argmax(logits[0])), 7, 11}))  # row 0's favourite among them
    masked = TokenBan(banned)(None, logits)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9),
                   SamplingParams(temperature=1.0, top_k=5, min_p=0.05)):
        base = make_request_sampler(params)
        mx.random.seed(11)
        want = (base or (lambda lp: mx.argmax(lp, axis=-1)))(masked - mx.logsumexp(masked, axis=-1, keepdims=True))
        mx.random.seed(11)
        sampler = banned_sampler(base, banned)
        got = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        assert got.tolist() == want.tolist(), params
        assert not set(got.tolist()) & set(banned)
        assert banned_sampler(base, banned) is sampler  # shared by rows with equal settings


OPTIONS = ["no", "yes", "maybe later", "certainly yes"]
# Twenty values in many first tokens (more than closing mode's small choices).
MANY = OPTIONS + ["alpha", "bravo", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
                  "lima", "oscar", "papa", "quebec", "romeo", "tango"]


@pytest.mark.parametrize("response_format", [
    {"type": "regex", "pattern": "(" + "|".join(OPTIONS) + ")"},
    {"type": "json_schema", "json_schema": {"name": "pick", "schema": {
        "type": "object", "properties": {"answer": {"enum": OPTIONS}},
        "required": ["answer"], "additionalProperties": False}}},
    {"type": "json_schema", "json_schema": {"name": "pick", "schema": {
        "type": "object", "properties": {"answer": {"enum": MANY}},
        "required": ["answer"], "additionalProperties": False}}},
])
async def test_a_tight_budget_keeps_the_models_choice_where_it_fits(qwen3_5_engine, response_format):
    """Near the end of its budget a constrained answer was forced onto its grammar's shortest
    completion, whatever the model preferred: a regex "(yes|no)" at max_tokens=4 always
    answered "no", and an enum of twenty values its shortest one (audits). Where every
    choice still leaves a completion that fits, the model chooses: each greedy answer at a budget just large enough for it (and EOS) is the
    answer with room to spare. The model is led to each option in turn by a logit bias on
    the tokens that begin it."""
    engine = qwen3_5_engine
    tok = engine.tokenizer
    texts = {i: tok.decode([i]) for i in range(len(tok.get_vocab()))}
    prompt = chat_prompts(1)[0]

    def params(option: str, max_tokens: int) -> SamplingParams:
        starts = {i for i, t in texts.items() if t.strip('"') and option.startswith(t.strip('"'))}
        return SamplingParams(max_tokens=max_tokens, logit_bias={i: 8.0 for i in starts})

    roomy = [await engine.chat(prompt, params(o, 64), response_format=response_format) for o in OPTIONS]
    assert len({o.text for o in roomy}) >= 3  # the choices differ, not only the shortest
    tight = [await engine.chat(prompt, params(o, len(out.token_ids) + 1), response_format=response_format)
             for o, out in zip(OPTIONS, roomy)]
    assert [o.text for o in tight] == [o.text for o in roomy]
    assert all(o.finish_reason == "stop" for o in roomy + tight)


async def test_a_match_completed_at_the_last_token_leaves_room_for_its_eos(qwen3_5_engine):
    """A token that completes a regex's match needs one more token for EOS: judged to fit
    with one token left, it was drawn there and the answer ended with "length" (a review
    of the closing change, about 4% of budgets). Every budget from the shortest answer up
    closes, greedy and sampled."""
    patterns = [r"[a-c]{1,4}", r"[0-9]{1,8}(\.[0-9]{1,3})?", r"(cat|dog|bird)( (cat|dog|bird)){0,5}"]
    runs = [(p, n, sampling) for p in patterns for n in range(3, 13)
            for sampling in (dict(), dict(temperature=1.0, seed=n), dict(temperature=2.0, seed=19))]
    outs = await asyncio.gather(*[
        qwen3_5_engine.complete("pick", SamplingParams(max_tokens=n, **sampling),
                                response_format={"type": "regex", "pattern": p}) for p, n, sampling in runs])
    for (p, n, sampling), out in zip(runs, outs):
        assert out.finish_reason == "stop" and re.fullmatch(p, out.text), (p, n, sampling, out.text)


def test_a_long_smallest_answer_is_searched_within_the_cap_and_still_closes(qwen3_5_engine, monkeypatch):
    """A schema whose smallest answer is hundreds of tokens, at a budget that only just holds
    it: every closing search walked up to the whole budget on the engine thread, the other
    rows waiting (1.8 s at the first token for 400 required rows, review h157). A search now
    walks at most ``_SEARCH_CAP`` tokens (a choice judged near the end, the budget left); a longer completion is looked for again as the
    row's own tokens shorten it, and closing still forces a valid end once it is in reach:
    here the "model" writes the smallest values, then digits for ever."""
    import mlx.core as mx

    from mlx_tandem import closing

    monkeypatch.setattr(closing, "_SEARCH_CAP", 256)  # 90 fields: over twice the cap, a short test
    grammar = qwen3_5_engine._front.grammar
    fields = [f"field_{i}" for i in range(90)]
    schema = {"type": "object", "properties": {f: {"type": "integer"} for f in fields}, "required": fields}
    constraint = Constraint.json_schema(schema)
    n0 = _closing_length(qwen3_5_engine, schema)
    assert n0 > 2 * closing._SEARCH_CAP
    limits = []
    real = closing.closing_path
    monkeypatch.setattr(closing, "closing_path", lambda *a, **kw: limits.append(kw["limit"]) or real(*a, **kw))
    tiers, eos = grammar.tiers(), set(grammar.eos_token_ids)
    smallest, digits = -tiers.tier.astype(np.float32), np.where(tiers.tier == 3, 5.0, 0.0).astype(np.float32)
    budget = n0 + 16
    proc = closing.GrammarProcessor(grammar.compile(constraint), tiers=tiers, eos_token_ids=grammar.eos_token_ids,
                                    max_tokens=budget, vocab_size=grammar.vocab_size,
                                    hints=grammar.hint_ids(constraint))
    out: list[int] = []
    while len(out) < budget and not (out and out[-1] in eos):
        prefer = smallest if len(out) < n0 - closing._SEARCH_CAP // 2 else digits
        out.append(int(np.argmax(np.array(proc(mx.array(out or [0]), mx.array(prefer))))))
    # The row's own search walks the cap; a choice judged near the end (tight: its row's
    # completion is within _STRUCTURE_SLACK of the budget) walks what is left of the budget.
    assert limits and max(limits) <= closing._SEARCH_CAP + closing._STRUCTURE_SLACK
    assert out[-1] in eos  # the digit lover would write digits for ever: closing ended it, in budget
    assert set(json.loads(grammar.tokenizer.decode_str([t for t in out if t not in eos]))) == set(fields)
