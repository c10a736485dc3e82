"""Qwen3.5's native XML tool calls (``qwen3_coder``; src/mlx_tandem/xml_calls.py).

Forced calls, and calls the model opens under tool_choice="auto", are written in the
model's own syntax and held to the tools' schemas; mlx-lm's parser reads every one back as
arguments the tool's pydantic model accepts strictly. The grammar takes exactly the calls
Qwen3.5's template writes for valid arguments, and refuses what the parser would misread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import datetime
import uuid
from typing import Annotated, Any, Literal, Optional, Union

import pytest
from pydantic import BaseModel, Field

from mlx_tandem import Engine, SamplingParams
from mlx_tandem.chat_format import ChatFormat
from mlx_tandem.constraints import GrammarCompiler, open_call_constraint, tool_call_constraint
from mlx_tandem.xml_call_reading import read_arguments
from mlx_tandem.xml_calls import xml_expressible

from .test_constraints import TOOL_MODELS, TOOLS, USER, _Strict
from .test_tool_call_grammar import _opens_a_call, _plan

mlx_lm_coder = pytest.importorskip("mlx_lm.tool_parsers.qwen3_coder")

CODER = dict(tool_call_start="<tool_call>", tool_call_end="</tool_call>", tool_format="qwen3_coder",
             tool_parser=mlx_lm_coder.parse_tool_call)


class Booking(_Strict):
    guests: list[str]
    note: Optional[str] = None
    code: str = Field(pattern=r"^[A-Z]{2}-[0-9]{3}$")
    room: Literal["single", "double"] = "single"
    nights: int = Field(ge=1, le=30)
    breakfast: bool = False
    price: Optional[float] = None
    extras: Optional[dict[str, int]] = None


class Lookup(_Strict):
    """What mlx-lm's own conversion misread (it converts by ``type`` alone)."""

    flag: Optional[bool] = None
    text: Optional[str] = None
    either: Union[str, int] = 0
    level: Literal[1, "one"] = 1
    big: int = Field(default=0, ge=0)
    step: int = Field(default=0, multiple_of=5)
    when: Optional[datetime.datetime] = None
    key: Optional[uuid.UUID] = None
    short: str = Field(default="", max_length=8)


MODELS = {**TOOL_MODELS, "book": Booking, "lookup": Lookup}
XML_TOOLS = TOOLS + [{"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                                       "parameters": MODELS[name].model_json_schema()}}
                     for name in ("book", "lookup")]


def render_call(name: str, arguments: dict, python: bool = True) -> str:
    """A call as Qwen3.5's template writes one: strings raw, objects and arrays as JSON,
    other values as their Python text (True, None); ``python=False``: as JSON, as
    Qwen3.6's template writes them (true, null)."""
    def text(v: Any) -> str:
        if isinstance(v, str):
            return v
        if isinstance(v, (bool, type(None))) and python:
            return str(v)
        return json.dumps(v)
    params = "".join(f"<parameter={k}>\n{text(v)}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


@pytest.fixture(scope="module")
def grammar(llama_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(llama_path))
    return GrammarCompiler(hf, len(hf), [hf.eos_token_id])


def _takes(grammar: GrammarCompiler, constraint, text: str) -> bool:
    m = grammar.compile(constraint)
    ids = grammar.tokenizer.tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


GOOD = [
    ("book", {"guests": ["Ann", "Bo"], "code": "AB-123", "nights": 2}),
    ("book", {"guests": [], "note": "late arrival\n<b>keep</b> the </param room", "code": "ZZ-000",
              "room": "double", "nights": 30, "breakfast": True, "price": 99.5, "extras": {"cot": 1}}),
    ("book", {"guests": ["x"], "note": None, "code": "AA-001", "nights": 1, "breakfast": False, "price": -1.25e3}),
    ("get_weather", {"city": "São Paulo", "unit": "fahrenheit", "days": 7}),
    ("get_weather", {"city": "\nnull city\n"}),
    ("move", {"to": {"x": -3, "y": 4}, "speed": 2.0}),
    ("add", {"a": 0, "b": -12}),
    ("lookup", {"flag": True, "text": '{"k": 1}', "either": "12", "level": 1, "big": 12345678901234567890,
                "step": 12345678901234567895, "when": "2024-02-29T23:59:59Z",
                "key": "123e4567-e89b-12d3-a456-426614174000", "short": "8 chars!"}),
    ("lookup", {"flag": None, "text": "[1, 2]", "either": "seven", "level": "one"}),  # (7 would read as "7")
]


@pytest.mark.parametrize("python", [True, False])
@pytest.mark.parametrize("name,arguments", GOOD)
def test_the_grammar_takes_what_the_template_writes_and_the_parser_reads_it_back(grammar, name, arguments, python):
    """Round trip: a valid call as Qwen3.5's template renders it is taken by the forced and
    the opened-call grammar, and mlx-lm's parser and ``read_arguments`` read back the same
    arguments, which the tool's model accepts (strictly, but for the JSON-mode types)."""
    fmt = ChatFormat(**CODER)
    text = render_call(name, arguments, python)
    assert _takes(grammar, tool_call_constraint(fmt, XML_TOOLS, [name], parallel=False, marker=grammar.marker), text)
    opened = open_call_constraint(fmt, XML_TOOLS, marker=grammar.marker)
    m = grammar.compile(opened)
    rest = grammar.tokenizer.tokenize_str(text[len("<tool_call>"):])
    assert m.try_consume_tokens(rest) == len(rest) and m.is_stopped()
    body = text[len("<tool_call>"):-len("</tool_call>")]
    parsed = mlx_lm_coder.parse_tool_call(body, None)
    params = next(t["function"]["parameters"] for t in XML_TOOLS if t["function"]["name"] == name)
    args = read_arguments(parsed["arguments"], params)
    assert args == arguments and [type(v) for v in args.values()] == [type(v) for v in arguments.values()]
    _validate(name, args)


BAD = [
    # the parser would cut the value at </parameter>, or read None for a string
    ("get_weather", '<parameter=city>\na</parameter>b\n</parameter>\n'),
    ("get_weather", "<parameter=city>\nNull\n</parameter>\n"),
    # not an enum value; an unknown parameter; a required one left out
    ("get_weather", "<parameter=city>\nx\n</parameter>\n<parameter=unit>\nkelvin\n</parameter>\n"),
    ("get_weather", "<parameter=city>\nx\n</parameter>\n<parameter=when>\nnow\n</parameter>\n"),
    ("add", "<parameter=a>\n1\n</parameter>\n"),
    # out of range; not an integer; a number a float reads as infinity (the parser failed)
    ("get_weather", "<parameter=city>\nx\n</parameter>\n<parameter=days>\n8\n</parameter>\n"),
    ("add", "<parameter=a>\n1.5\n</parameter>\n<parameter=b>\n2\n</parameter>\n"),
    ("move", '<parameter=to>\n{"x": 1, "y": 2}\n</parameter>\n<parameter=speed>\n2E888888888\n</parameter>\n'),
    # a date-time, a uuid out of form; a string past its (small) maxLength
    ("lookup", "<parameter=when>\n2024-01-01T99:99:59 junk\n</parameter>\n"),
    ("lookup", "<parameter=key>\nnot a uuid\n</parameter>\n"),
    ("lookup", "<parameter=short>\nnine char\n</parameter>\n"),
    # the pattern; a value without the newline the parser strips
    ("book", "<parameter=guests>\n[]\n</parameter>\n<parameter=code>\nab-123\n</parameter>\n"
             "<parameter=nights>\n1\n</parameter>\n"),
    ("add", "<parameter=a>1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"),
]


@pytest.mark.parametrize("name,params", BAD)
def test_the_grammar_refuses_what_the_parser_would_misread_or_the_schema_refuses(grammar, name, params):
    fmt = ChatFormat(**CODER)
    text = f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    assert not _takes(grammar, tool_call_constraint(fmt, XML_TOOLS, [name], parallel=False, marker=grammar.marker),
                      text)


def test_a_value_may_not_spell_the_end_marker(grammar):
    """The output parser ends a call at the text of its end marker: a raw value spelling
    ``</tool_call>`` in ordinary tokens would have cut the call in two."""
    fmt = ChatFormat(**CODER)
    tok = grammar.tokenizer.tokenize_str
    head = tok("<tool_call>") + tok("\n<function=get_weather>\n<parameter=city>\nsee ")
    tail = tok(" here\n</parameter>\n</function>\n") + tok("</tool_call>")
    spelled = tok("</tool") + tok("_call>")
    assert grammar.tokenizer.decode_str(spelled) == "</tool_call>" and len(spelled) > 1

    def takes(ids):
        m = grammar.compile(tool_call_constraint(fmt, XML_TOOLS, ["get_weather"], parallel=False,
                                                 marker=grammar.marker))
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    assert takes(head + tok("x") + tail)
    assert not takes(head + spelled + tail)


class Inner(_Strict):
    text: str


class Notes(_Strict):
    """JSON-valued parameters whose strings could spell the call's markup."""

    tags: list[str]
    codes: list[Annotated[str, Field(pattern=r"^[a-z</>_]+$")]] = []
    inner: Optional[Inner] = None
    meta: dict[str, Any] = {}
    anything: Any = None


NOTES = [{"type": "function", "function": {"name": "notes", "parameters": Notes.model_json_schema()}}]


@pytest.mark.parametrize("marker", ["</parameter>", "</tool_call>"])
@pytest.mark.parametrize("arguments", [
    {"tags": ["a", "x{m}y"]},
    {"tags": [], "codes": ["ab{m}"]},
    {"tags": [], "inner": {"text": "{m}"}},
    {"tags": [], "meta": {"k": ["deep", {"deeper": "{m} and on"}]}},
    {"tags": [], "anything": "{m}"},
    {"tags": [], "anything": [1, {"a": "b{m}"}]},
])
def test_a_string_inside_a_json_value_may_not_spell_the_markup(grammar, marker, arguments):
    """A string inside a JSON-valued parameter (a list item, a nested model's field, any
    value) that spelled ``</parameter>`` was cut there by mlx-lm's parser, and one that
    spelled ``</tool_call>`` ended the call (in ordinary tokens): the call came back
    invalid. Such strings are refused now; the same strings without the marker are taken
    and read back whole, and so is near-miss markup (``</param``, ``<b>``)."""
    fmt = ChatFormat(**CODER)
    tok = grammar.tokenizer.tokenize_str
    cut = len(marker) // 2
    spelled = tok(marker[:cut]) + tok(marker[cut:])  # ordinary tokens, as a model may write it
    assert grammar.tokenizer.decode_str(spelled) == marker

    def ids(args: dict) -> list[int]:
        text = render_call("notes", args)
        head, _, tail = text.partition("@MARK@")
        if not _:
            return tok("<tool_call>") + tok(text[len("<tool_call>"):-len("</tool_call>")]) + tok("</tool_call>")
        return tok("<tool_call>") + tok(head[len("<tool_call>"):]) + spelled + tok(tail[:-len("</tool_call>")]) \
            + tok("</tool_call>")

    def takes(args: dict) -> bool:
        m = grammar.compile(tool_call_constraint(fmt, NOTES, ["notes"], parallel=False, marker=grammar.marker))
        got = ids(args)
        return m.try_consume_tokens(got) == len(got) and m.is_accepting()

    def spelling(text: str, value: Any = arguments) -> Any:
        if isinstance(value, str):
            return value.replace("{m}", text)
        if isinstance(value, list):
            return [spelling(text, v) for v in value]
        return {k: spelling(text, v) for k, v in value.items()} if isinstance(value, dict) else value

    assert not takes(spelling("@MARK@"))
    for harmless in ("", "</param", "<b>x</b>", marker[:-1]):
        args = spelling(harmless)
        assert takes(args), args
        body = render_call("notes", args)[len("<tool_call>"):-len("</tool_call>")]
        parsed = mlx_lm_coder.parse_tool_call(body, None)
        assert read_arguments(parsed["arguments"], NOTES[0]["function"]["parameters"]) == args
        Notes.model_validate(args)


def test_a_long_min_length_inside_a_json_value_still_compiles(grammar):
    """llguidance refused a string with a minLength over 42 beside the marker pattern
    ("Unable to determine if regex is empty"): every call of such a tool failed, forced or
    not. Such a string keeps its minLength and goes without the pattern."""
    fmt = ChatFormat(**CODER)
    tools = [{"type": "function", "function": {"name": "review", "parameters": {
        "type": "object", "required": ["notes", "short"], "properties": {
            "notes": {"type": "array", "items": {"type": "string", "minLength": 64}},
            "short": {"type": "array", "items": {"type": "string", "minLength": 2}}}}}}]
    ok = {"notes": ["x" * 64], "short": ["ab"]}
    text = render_call("review", ok)
    assert _takes(grammar, tool_call_constraint(fmt, tools, ["review"], parallel=False, marker=grammar.marker), text)
    m = grammar.compile(open_call_constraint(fmt, tools, marker=grammar.marker))
    rest = grammar.tokenizer.tokenize_str(text[len("<tool_call>"):])
    assert m.try_consume_tokens(rest) == len(rest) and m.is_stopped()
    for bad in ({"notes": ["x" * 63], "short": ["ab"]}, {"notes": ["x" * 64], "short": ["a"]},
                {"notes": ["x" * 64], "short": ["a</parameter>"]}):
        assert not _takes(grammar, tool_call_constraint(fmt, tools, ["review"], parallel=False,
                                                        marker=grammar.marker), render_call("review", bad)), bad


@pytest.mark.parametrize("pattern,takes,refuses", [
    ("^a|b$", ["a", "ab", "xb", "b"], ["x", "ba", "bx"]),  # starts with a, or ends with b
    ("^x$|^y$", ["x", "y"], ["xy", "yx"]),
    ("[|]x|^z$", ["|x", "a|xb", "z"], ["zz", "x"]),  # a "|" in a class does not split
    (r"^a\|b$", ["a|b"], ["a", "b", "xa|b"]),  # nor an escaped one
])
def test_a_pattern_anchors_each_top_level_alternative(grammar, pattern, takes, refuses):
    """JSON Schema reads ``^a|b$`` as "starts with a, or ends with b" (ECMA-262), as the
    JSON body's grammar does; the XML body read it as ``^(a|b)$`` and refused "xb"."""
    fmt = ChatFormat(**CODER)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}}}]
    for value in takes + refuses:
        assert bool(re.search(pattern, value)) == (value in takes)  # the cases are ECMA-262's too
        text = f"<tool_call>\n<function=f>\n<parameter=s>\n{value}\n</parameter>\n</function>\n</tool_call>"
        assert _takes(grammar, tool_call_constraint(fmt, tools, ["f"], parallel=False, marker=grammar.marker),
                      text) == (value in takes), value


def test_tools_the_syntax_cannot_write_keep_a_json_body():
    """Parameters that are not an object with properties, or names the parser cannot read
    back, are forced as a JSON body (read as JSON) and get no lazy grammar, as before."""
    fmt = ChatFormat(**CODER, think_start="<think>", think_end="</think>")
    union = {"type": "function", "function": {"name": "u", "parameters": {
        "anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]}}}
    spaced = {"type": "function", "function": {"name": "s", "parameters": {
        "type": "object", "properties": {"a b": {"type": "string"}}}}}
    free = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    extra = {"type": "function", "function": {"name": "e", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}}}
    for tool in (union, spaced, free, extra):
        assert not xml_expressible([tool], [tool["function"]["name"]])
        assert _plan(fmt, tools=[tool], tool_choice="required").forced_json_calls
        assert _plan(fmt, tools=[tool]).open_call is None
    assert xml_expressible(XML_TOOLS, [t["function"]["name"] for t in XML_TOOLS])
    native = _plan(fmt, tools=XML_TOOLS, tool_choice="required")
    assert not native.forced_json_calls and "<function=book>" in native.constraint.source
    assert _plan(fmt, tools=XML_TOOLS).open_call is not None


def test_values_are_read_by_their_schema():
    """Given no tools, mlx-lm's parser hands back each value's text (None for null);
    ``read_arguments`` reads it by the schema. mlx-lm's own conversion, by ``type`` alone,
    read ``Optional[int]`` "3" as a string, an ``Optional[str]`` that looks like JSON as
    a dict, ``True`` for an ``Optional[bool]`` as a string, and integers through a float."""
    weather = MODELS["get_weather"].model_json_schema()
    assert read_arguments({"days": "3", "city": "7"}, weather) == {"days": 3, "city": "7"}
    # Python's None, as Qwen3.5's template writes a null: None where the schema admits null
    assert read_arguments({"days": "None", "city": "None"}, weather) == {"days": None, "city": "None"}
    lookup = MODELS["lookup"].model_json_schema()
    read = read_arguments({"flag": "False", "text": '{"k": 1}', "either": "3", "level": "1", "big": "9" * 20,
                           "step": "3.0", "short": None}, lookup)
    # (the parser reads "null" as None; a string that admits no null keeps the text)
    assert read == {"flag": False, "text": '{"k": 1}', "either": "3", "level": 1, "big": int("9" * 20), "step": 3,
                    "short": "null"}
    book = MODELS["book"].model_json_schema()
    assert read_arguments({"price": "cheap", "extras": "{'a': 1}"}, book) == {"price": "cheap", "extras": {"a": 1}}
    assert read_arguments({"unknown": "1"}, book) == {"unknown": "1"}  # left for the tool to refuse
    # The parser lowers "Null" to None; given the call's text, a string keeps its case (a
    # field that takes null reads None).
    body = "<function=lookup>\n<parameter=short>\nNuLL\n</parameter>\n<parameter=text>\nnull\n</parameter>\n"
    assert read_arguments({"short": None, "text": None}, lookup, body) == {"short": "NuLL", "text": None}


def _spaced_tools() -> list[dict]:
    def tool(name, **props):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {k: {"type": v} for k, v in props.items()}}}}
    return [tool("get", city="string"), tool("get weather", city="string", days="integer"),
            tool("a", x="string"), tool("a>b", x="integer"),
            tool("search", **{"max results": "integer", "query": "string", "sort order": "string"})]


@pytest.mark.parametrize("written, name, arguments", [
    # mlx-lm's parser (0.32) ends a name at whitespace, "<" or ">": these came back as calls
    # of ``get`` and ``a`` (listed too: the wrong tool ran), their values untyped.
    ("get weather", "get weather", {"city": "Paris", "days": 3}),
    ("a>b", "a>b", {"x": 3}),
    # Names the parser reads whole are read as before.
    ("get", "get", {"city": "Paris", "days": "3"}),
    ("a", "a", {"x": "3"}),
])
def test_names_the_parser_cuts_short_are_read_as_the_listed_name_written(written, name, arguments):
    """Under tool_choice="auto" the grammar cannot hold such names (``xml_expressible``), so
    the model writes them in its own syntax; each header is read as the listed name it
    spells, its values typed by that tool's schema."""
    from mlx_tandem.chat_output import ChatOutputParser

    fmt = ChatFormat(**CODER, think_start="<think>", think_end="</think>")
    args = {"city": "Paris", "days": 3} if written.startswith("get") else {"x": 3}
    parser = ChatOutputParser(fmt, tools=_spaced_tools(), parse_tool_calls=True)
    out = parser.feed(render_call(written, args))
    [call] = out.tool_calls + parser.finish().tool_calls
    assert (call.name, call.arguments) == (name, arguments)


def test_a_parameter_the_parser_cuts_short_is_read_whole_and_a_name_no_tool_spells_is_invalid():
    from mlx_tandem.chat_output import ChatOutputParser

    fmt = ChatFormat(**CODER, think_start="<think>", think_end="</think>")

    def parse(text):
        parser = ChatOutputParser(fmt, tools=_spaced_tools(), parse_tool_calls=True)
        out = parser.feed(text)
        end = parser.finish()
        return out.tool_calls + end.tool_calls, out.invalid_tool_calls + end.invalid_tool_calls

    # The parser read {"max": " results>\n5"}: the tool ran without its limit.
    calls, _ = parse(render_call("search", {"max results": 5, "query": "null"}))
    # (a string that takes no null keeps the text "null" as written, as everywhere: h150)
    assert [(c.name, c.arguments) for c in calls] == [("search", {"max results": 5, "query": "null"})]
    calls, _ = parse("<tool_call>\n<function=search>\n<parameter=sort order>\nNull\n</parameter>\n"
                     "<parameter=query>\nNuLL\n</parameter>\n</function>\n</tool_call>")
    assert [(c.name, c.arguments) for c in calls] == [("search", {"sort order": "Null", "query": "NuLL"})]
    # A name or a parameter the tools do not have, cut short: invalid, not a call of "has" or
    # of "get" without its argument.
    for text, error in ((render_call("has space", {"city": "Paris"}), "header <function=has space> names no listed tool"),
                        (render_call("get", {"the city": "Paris"}), "header <parameter=the city> names no parameter of 'get'")):
        calls, invalid = parse(text)
        assert not calls and len(invalid) == 1 and error in invalid[0].error, invalid
    # A name the parser reads whole stays the call it was, listed or not (the agent answers
    # an unknown tool), and so does a value written on the header's line.
    calls, _ = parse("<tool_call>\n<function=elsewhere>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>")
    assert [(c.name, c.arguments) for c in calls] == [("elsewhere", {"q": "x"})]
    calls, _ = parse("<tool_call>\n<function=get><parameter=city>Paris</parameter></function>\n</tool_call>")
    assert [(c.name, c.arguments) for c in calls] == [("get", {"city": "Paris"})]


def test_raw_values_take_ascii_digits_and_a_date_time_its_offset(grammar):
    """A raw value's pattern was compiled with Rust's Unicode ``\\d``, so the model wrote
    Arabic-Indic and fullwidth digits into NaiveDatetime, timedelta and Decimal values that
    Pydantic refused, and a ``date-time`` without its offset (AwareDatetime took none): a
    JSON Schema pattern's classes are ECMA-262's, ASCII, and RFC 3339 writes an offset (a
    fuzz, 2026-11-30). Each text the grammar takes validates."""
    from decimal import Decimal as D

    from pydantic import AwareDatetime, NaiveDatetime

    from mlx_tandem.pydantic_schema import json_schema

    class Stamp(BaseModel):
        naive: Optional[NaiveDatetime] = None
        aware: Optional[AwareDatetime] = None
        span: Optional[datetime.timedelta] = None
        price: Optional[D] = None
        code: Optional[str] = Field(default=None, pattern=r"^\d{3}$")

    tools = [{"type": "function", "function": {"name": "stamp", "parameters": json_schema(Stamp)}}]
    forced = tool_call_constraint(ChatFormat(**CODER), tools, ["stamp"], parallel=False, marker=grammar.marker)
    cases = {"naive": {"2024-01-05T10:20:30": True, "\u0662024-01-05T10:20:30": False},
             "aware": {"2024-01-05T10:20:30Z": True, "2024-01-05T10:20:30": False},
             "span": {"P12DT3H": True, "P\u0661D": False, "P\uff11D": False},
             "price": {"12.50": True, "1\u0663.5": False},
             "code": {"123": True, "\u0661\u0662\u0663": False}}
    for key, texts in cases.items():
        for value, taken in texts.items():
            text = f"<tool_call>\n<function=stamp>\n<parameter={key}>\n{value}\n</parameter>\n</function>\n</tool_call>"
            assert _takes(grammar, forced, text) == taken, (key, value)
            if taken:
                Stamp.model_validate({key: value})


def _validate(name: str, args: dict) -> None:
    """Strict, but dates and UUIDs come as JSON strings (as from any JSON tool call)."""
    model = MODELS[name]
    if name == "lookup":
        model.model_validate_json(json.dumps(args))
    else:
        model.model_validate(args, strict=True)


# ---------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
async def coder_engine(qwen3_5_path):
    """The factory Qwen3.5 model, reading and writing calls in Qwen3.5's XML syntax."""
    engine = Engine(qwen3_5_path, show_progress=False)
    await engine.start()
    engine._front.format = dataclasses.replace(engine._front.format, **CODER, template_has_tools=True)
    yield engine
    await engine.close()


def _assert_native_valid(out, names, forced=True):
    """Valid XML calls (under "auto" the model writes on after them, here to its budget)."""
    assert out.finish_reason == "tool_calls" or not forced, out.text
    assert out.invalid_tool_calls == [], out.text
    assert out.tool_calls and out.text.lstrip().startswith("<tool_call>\n<function="), out.text
    for c in out.tool_calls:
        assert c.name in names
        _validate(c.name, c.arguments)


@pytest.mark.parametrize("choice,names", [("required", set(MODELS)), ("book", {"book"}), ("move", {"move"}),
                                          ("lookup", {"lookup"})])
async def test_forced_calls_are_native_and_valid_within_the_budget(coder_engine, choice, names):
    """Random weights at temperature 1: every forced call is XML, parses, and validates;
    at a budget a little over the shortest call it still closes."""
    runs = [(n, s) for n in (90, 200) for s in range(4)]
    outs = await asyncio.gather(*[
        coder_engine.chat(USER, SamplingParams(max_tokens=n, temperature=1.0, seed=s), tools=XML_TOOLS,
                          tool_choice=choice) for n, s in runs])
    for out in outs:
        _assert_native_valid(out, names)
    parallel = await coder_engine.chat(USER, SamplingParams(max_tokens=300, temperature=1.0, seed=1),
                                       tools=XML_TOOLS, tool_choice="add", parallel_tool_calls=True)
    _assert_native_valid(parallel, {"add"})


async def test_calls_the_model_opens_are_held_to_the_tools(coder_engine, qwen3_5_path):
    """Under "auto" a call the model opens (its start token pushed) is held to the listed
    tools in XML; without the grammar the same requests give broken calls."""
    seeds = range(6)

    async def opened(engine):
        return await asyncio.gather(*[
            engine.chat(USER, SamplingParams(max_tokens=160, temperature=1.0, seed=s,
                                             logits_processors=[_opens_a_call(engine)]), tools=XML_TOOLS)
            for s in seeds])

    for out in await opened(coder_engine):
        _assert_native_valid(out, set(MODELS), forced=False)
    free = Engine(qwen3_5_path, show_progress=False, constrain_tool_calls=False)
    await free.start()
    try:
        free._front.format = dataclasses.replace(free._front.format, **CODER, template_has_tools=True)
        raw = await opened(free)
    finally:
        await free.close()
    assert sum(bool(o.invalid_tool_calls) or not o.tool_calls for o in raw) >= len(seeds) // 2


async def test_mtp_stays_lossless_on_xml_calls(qwen3_5_mtp_path):
    """Greedy forced XML calls, roomy and at budgets from the shortest call up (closing
    mode, its branch judging included), are token for token the same with MTP on and off."""
    from mlx_tandem.closing import closing_path

    async def run(mode):
        engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp=mode, mtp_depth=2, max_batch_size=32)
        await engine.start()
        try:
            engine._front.format = dataclasses.replace(engine._front.format, **CODER, template_has_tools=True)
            g = engine._front.grammar
            requests = []
            for name in MODELS:
                c = tool_call_constraint(engine._front.format, XML_TOOLS, [name], parallel=False, marker=g.marker)
                shortest = len(closing_path(g.compile(c), g.tiers(), frozenset(g.eos_token_ids), 400,
                                            g.hint_ids(c), text_markup=True))
                requests += [(name, n) for n in (shortest, shortest + 8, 160)]
            outs = await asyncio.gather(*[
                engine.chat([{"role": "user", "content": f"Call {name}, please."}], SamplingParams(max_tokens=n),
                            tools=XML_TOOLS, tool_choice=name) for name, n in requests])
            return outs, engine.stats()["mtp"]
        finally:
            await engine.close()

    plain, _ = await run("off")
    spec, mtp = await run("on")
    assert mtp["spec_steps"] > 0 and mtp["accepted"] > 0, mtp
    for a, b in zip(plain, spec):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), a.text
        _assert_native_valid(a, set(MODELS))


async def test_a_long_max_length_does_not_fail_the_request(coder_engine):
    """A maxLength over what llguidance's lexer can intersect with a raw value's exclusions
    failed every such call ("too many expressions constructed"); it is left to the tool, and
    a minLength still holds."""
    search = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "minLength": 12, "maxLength": 200}},
        "required": ["query"]}}}
    outs = await asyncio.gather(*[
        coder_engine.chat(USER, SamplingParams(max_tokens=n, temperature=1.0, seed=s), tools=[search],
                          tool_choice="search") for n in (60, 120) for s in range(3)])
    for out in outs:
        assert out.finish_reason == "tool_calls" and not out.invalid_tool_calls, out.text
        assert len(out.tool_calls[0].arguments["query"]) >= 12


CLOSING_CASES = {
    # optional parameters whose names begin like the required one's: a greedy walk wrote
    # all 29 of them (a 647-token "shortest" call), so no budget near the real one closed
    "prefixed": {"type": "object", "required": ["param_29"], "properties": {
        **{f"param_{i:02d}": {"type": "string"} for i in range(29)}, "param_29": {"type": "integer"}}},
    # unbounded numbers: the walk wrote each to its sixteenth digit
    "numbers": {"type": "object", "required": list("abcde"), "properties": {k: {"type": "number"} for k in "abcde"}},
}


@pytest.mark.parametrize("name", list(CLOSING_CASES))
async def test_calls_close_from_the_shortest_budget(coder_engine, name):
    """Closing mode finds (about) the shortest call, and a random model's forced call
    closes at every budget from it up."""
    from mlx_tandem.closing import closing_path

    jsonschema = pytest.importorskip("jsonschema")
    tool = {"type": "function", "function": {"name": name, "parameters": CLOSING_CASES[name]}}
    g = coder_engine._front.grammar
    c = tool_call_constraint(coder_engine._front.format, [tool], [name], parallel=False, marker=g.marker)
    shortest = len(closing_path(g.compile(c), g.tiers(), frozenset(g.eos_token_ids), 1000, g.hint_ids(c),
                                text_markup=True))
    # the call with only its required parameters, each value one token
    spelled = render_call(name, {k: 0 for k in CLOSING_CASES[name]["required"]})
    assert shortest <= len(coder_engine.tokenizer.encode(spelled, add_special_tokens=False)) + 1
    outs = await asyncio.gather(*[
        coder_engine.chat(USER, SamplingParams(max_tokens=shortest + extra, temperature=1.0, seed=s), tools=[tool],
                          tool_choice=name) for extra in (0, 5) for s in range(3)])
    for out in outs:
        assert out.finish_reason == "tool_calls" and not out.invalid_tool_calls, out.text
        jsonschema.validate(out.tool_calls[0].arguments, CLOSING_CASES[name])


EDGE = {"type": "object", "properties": {
    "url": {"type": "string", "pattern": r"^https?:\/\/\S+$"},  # an escaped slash
    "path": {"type": "string", "pattern": r"^C:\\$"},  # ends in an escaped backslash
    "word": {"type": "string", "pattern": "(?i)^abc$"},  # inline flags before the anchor
    "mode": {"anyOf": [{"type": "integer"}, {"const": "auto"}]},
    "rows": {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"enum": ["all"]}]},
    "flag": {"enum": [False, "auto"]},
    "maybe": {"enum": ["x", None]},
    "many": {"enum": [f"v{i}" for i in range(2500)]},  # past llguidance's 2,000 items a row
    "anything": {},
    "short": {"allOf": [{"type": "string"}, {"maxLength": 3}]},
}}


@pytest.mark.parametrize("python", [True, False])
def test_edge_schemas_round_trip(grammar, python):
    """Schemas a second audit found mishandled: patterns the grammar could not compile (so
    every request listing the tool failed, "auto" too), unions of a type and an enum read
    back as text, enum booleans and nulls in Python's spelling refused, a long enum past
    llguidance's row limit, untyped values read as text, an allOf string held as JSON."""
    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"type": "function", "function": {"name": "edge", "parameters": EDGE}}]
    arguments = {"url": "https://x.org/a", "path": "C:\\", "word": "ABC", "mode": 5, "rows": [1, 2], "flag": False,
                 "maybe": None, "many": "v2499", "anything": {"a": [1, None]}, "short": "ab"}
    text = render_call("edge", arguments, python)
    fmt = ChatFormat(**CODER)
    assert _takes(grammar, tool_call_constraint(fmt, tools, ["edge"], parallel=False, marker=grammar.marker), text)
    m = grammar.compile(open_call_constraint(fmt, tools, marker=grammar.marker))  # "auto" compiles too
    rest = grammar.tokenizer.tokenize_str(text[len("<tool_call>"):])
    assert m.try_consume_tokens(rest) == len(rest) and m.is_stopped()
    parsed = mlx_lm_coder.parse_tool_call(text[len("<tool_call>"):-len("</tool_call>")], None)
    args = read_arguments(parsed["arguments"], EDGE)
    assert args == arguments and [type(v) for v in args.values()] == [type(v) for v in arguments.values()]
    jsonschema.validate(args, EDGE)
    assert read_arguments({"mode": "auto", "rows": "all", "flag": "auto", "anything": "plain"}, EDGE) == {
        "mode": "auto", "rows": "all", "flag": "auto", "anything": "plain"}


def test_a_qwen35_style_template_is_read_as_xml_and_a_call_in_history_reads_back_the_same(qwen3_5_path, tmp_path):
    """A checkpoint whose template writes Qwen3.5's XML calls is read as ``qwen3_coder`` by
    mlx-lm's own inference (nothing patched), its forced calls are XML, and a call fed back
    in the history (the agent loop's next turn) renders as Qwen3.5's template writes it and
    reads back as the same call. The other tests swap the format on a JSON template."""
    import shutil

    from mlx_tandem.chat_output import ChatOutputParser
    from mlx_tandem.testing.chat_template import XML_CALLS_TEMPLATE

    path = shutil.copytree(qwen3_5_path, tmp_path / "xml")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = XML_CALLS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(XML_CALLS_TEMPLATE)
    engine = Engine(path, show_progress=False).start_sync()
    try:
        assert engine._front.format.tool_format == "qwen3_coder"
        for choice in ("add", "book", "lookup"):
            out = engine.chat_sync(USER, SamplingParams(max_tokens=400), tools=XML_TOOLS, tool_choice=choice)
            [call] = out.tool_calls
            assert out.text.startswith(f"<tool_call>\n<function={choice}>"), out.text
            history = USER + [
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
                    "name": call.name, "arguments": json.dumps(call.arguments)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
            prompt = engine.tokenizer.decode(engine.apply_chat_template(history, tools=XML_TOOLS))
            turn = prompt[prompt.index("<|im_start|>assistant\n"):].split("<|im_end|>")[0]  # the call, not the new turn
            assert render_call(call.name, call.arguments) in turn
            parser = ChatOutputParser(engine._front.format, tools=XML_TOOLS, parse_tool_calls=True)
            again = parser.feed(turn.removeprefix("<|im_start|>assistant\n")).tool_calls + parser.finish().tool_calls
            assert [(c.name, c.arguments) for c in again] == [(call.name, call.arguments)]
        # Under "auto", a listed name the syntax cannot hold is shown as it is, and the call
        # the model writes of it runs that tool, not the one whose name it begins with.
        from .forcing import forcing_processor

        tools = _spaced_tools()
        prompt = engine.tokenizer.decode(engine.apply_chat_template(USER, tools=tools))
        assert '"name": "get weather"' in prompt
        text = render_call("get weather", {"city": "Paris", "days": 3})
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        out = engine.chat_sync(USER, SamplingParams(max_tokens=len(ids) + 4, logits_processors=[
            forcing_processor(ids, engine.loaded.eos_token_ids[0])]), tools=tools)
        assert out.text == text and not out.invalid_tool_calls
        assert [(c.name, c.arguments) for c in out.tool_calls] == [("get weather", {"city": "Paris", "days": 3})]
    finally:
        engine.close_sync()

