"""ChatOutputParser: streamed text -> reasoning, content and tool calls, for any split into deltas.

Pure Python (no model): a ChatFormat with Qwen-style ``<think>`` and ``<tool_call>`` markers
and mlx-lm's ``json_tools`` parser. The central property is that the result never depends
on how the generated text was cut into stream deltas, so every case is fed whole, one
character at a time, cut at every position, and cut at random places.
"""

from __future__ import annotations

import json
import math
import random

import pytest
from mlx_lm.tool_parsers import qwen3_coder
from mlx_lm.tool_parsers.json_tools import parse_tool_call

from mlx_tandem.chat_format import ChatFormat
from mlx_tandem.chat_output import ChatOutputParser
from mlx_tandem.outputs import InvalidToolCall, ToolCall

FMT = ChatFormat(
    think_start="<think>", think_end="</think>",
    tool_call_start="<tool_call>", tool_call_end="</tool_call>",
    tool_format="json_tools", tool_parser=parse_tool_call, template_has_tools=True,
)
NO_THINK = ChatFormat(tool_call_start="<tool_call>", tool_call_end="</tool_call>",
                      tool_format="json_tools", tool_parser=parse_tool_call)
# Same markers, but the format's own parser reads Qwen3-Coder's XML-like bodies, not JSON.
XML_CALLS = ChatFormat(think_start="<think>", think_end="</think>",
                       tool_call_start="<tool_call>", tool_call_end="</tool_call>",
                       tool_format="qwen3_coder", tool_parser=qwen3_coder.parse_tool_call)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]


def call(name, arguments, raw_args=None):
    args = raw_args if raw_args is not None else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def splits(text: str, n_random: int = 12, seed: int = 0):
    """Ways to cut ``text`` into deltas: whole, per character, at each position, at random."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])] + [""]  # an empty delta too


class Result:
    def __init__(self):
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []
        self.invalid_tool_calls: list[InvalidToolCall] = []
        self.after_feed = None  # what was emitted before finish()

    def add(self, d):
        self.content += d.content
        self.reasoning += d.reasoning
        self.tool_calls += d.tool_calls
        self.invalid_tool_calls += d.invalid_tool_calls

    def key(self):
        """Everything but the random call ids."""
        return (self.content, self.reasoning,
                [(c.name, c.arguments, c.index, c.content_offset) for c in self.tool_calls],
                [(c.name, c.arguments, c.index, c.content_offset) for c in self.invalid_tool_calls])


def parse(pieces, fmt=FMT, **kw) -> Result:
    kw.setdefault("tools", TOOLS)
    p = ChatOutputParser(fmt, **kw)
    r = Result()
    for piece in pieces:
        r.add(p.feed(piece))
    r.after_feed = (r.content, r.reasoning)
    r.add(p.finish())
    assert p.num_tool_calls == len(r.tool_calls)
    return r


def parse_every_split(text, fmt=FMT, **kw) -> Result:
    """Parse ``text`` cut every way; assert all agree; return the whole-text result."""
    whole = parse([text], fmt, **kw)
    for pieces in splits(text):
        got = parse(pieces, fmt, **kw)
        assert got.key() == whole.key(), f"split {pieces!r} parsed differently"
    return whole


# ---------------------------------------------------------------------------- plain text
PLAIN = [
    "Hello world.",
    "  leading and trailing whitespace \n\n",
    "\n",
    "a < b and c > d, x<y",
    "compare </think> and </tool_call> closers, which open nothing",
    "ends with a marker prefix <thi",
    "ends with a tool marker prefix <tool_ca",
    "<",
    "emoji 🙂🚀👍🏽 and 東京, naïve café, e\u0301, 👨\u200d👩\u200d👧",
    "tab\there\r\nwindows line\u2028sep ",
]


@pytest.mark.parametrize("parse_tool_calls", [True, False])
@pytest.mark.parametrize("text", PLAIN)
def test_plain_text_is_content_exactly(text, parse_tool_calls):
    r = parse_every_split(text, parse_tool_calls=parse_tool_calls)
    assert r.content == text
    assert r.reasoning == "" and r.tool_calls == [] and r.invalid_tool_calls == []


@pytest.mark.parametrize("text", ["Hello world, this is plain.", "x  y \n", "no marker at all 🙂 "])
def test_plain_text_is_not_held_back_longer_than_needed(text):
    # Before finish() everything but trailing whitespace has been released: only text that
    # may start a marker is held back.
    for pieces in splits(text):
        r = parse(pieces, parse_tool_calls=True)
        assert r.after_feed == (text.rstrip(), "")


def test_starts_in_reasoning_is_ignored_without_thinking_markers():
    text = "abc</think>answer"
    r = parse_every_split(text, NO_THINK, starts_in_reasoning=True, parse_tool_calls=True)
    assert (r.content, r.reasoning) == (text, "")


# ---------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize("text,reasoning,content", [
    ("<think>\nabc\n</think>\n\nanswer", "abc", "answer"),
    ("<think>abc</think>answer", "abc", "answer"),
    ("<think>\nline one\n\n  line two  \n</think>\n\nThe answer is 42.\n", "line one\n\n  line two",
     "The answer is 42.\n"),
    ("<think>\n\n</think>\n\nanswer", "", "answer"),
    ("<think>a<b </thi nk> still thinking</think>done", "a<b </thi nk> still thinking", "done"),
    ("<think>🙂 東京</think>🚀 ok", "🙂 東京", "🚀 ok"),
    ("\n<think>abc</think>answer", "abc", "answer"),  # whitespace before <think> is not content
    ("<think>\nabc", "abc", ""),  # the budget ran out while thinking
])
def test_reasoning_is_split_from_content(text, reasoning, content):
    r = parse_every_split(text)
    assert (r.reasoning, r.content) == (reasoning, content)
    assert "<think>" not in r.content and "</think>" not in r.content


def test_think_marker_after_content_is_content():
    # <think> opens reasoning only at the start of the answer; later it is ordinary text.
    text = "abc<think>x</think>y"
    r = parse_every_split(text)
    assert (r.content, r.reasoning) == (text, "")


@pytest.mark.parametrize("text,reasoning,content", [
    ("abc</think>answer", "abc", "answer"),
    ("\nabc\n</think>\n\nanswer", "abc", "answer"),
    ("still thinking when the budget ran out", "still thinking when the budget ran out", ""),
])
def test_starts_in_reasoning(text, reasoning, content):
    r = parse_every_split(text, starts_in_reasoning=True)
    assert (r.reasoning, r.content) == (reasoning, content)


def test_tool_call_inside_reasoning_stays_reasoning():
    text = "<think>maybe " + call("get_weather", {"city": "Paris"}) + "</think>no call"
    r = parse_every_split(text, parse_tool_calls=True)
    assert r.tool_calls == [] and r.invalid_tool_calls == []
    assert r.reasoning == "maybe " + call("get_weather", {"city": "Paris"})
    assert r.content == "no call"


# ---------------------------------------------------------------------------- tool calls
def _calls(r):
    return [(c.name, c.arguments) for c in r.tool_calls]


def test_one_tool_call():
    r = parse_every_split(call("get_weather", {"city": "Paris"}), parse_tool_calls=True)
    assert _calls(r) == [("get_weather", {"city": "Paris"})]
    assert r.content == "" and r.reasoning == "" and r.invalid_tool_calls == []


def test_two_tool_calls():
    text = call("get_weather", {"city": "Paris"}) + "\n" + call("add", {"a": 1, "b": 2})
    r = parse_every_split(text, parse_tool_calls=True)
    assert _calls(r) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert r.content == "" and r.invalid_tool_calls == []


def test_one_call_allowed_ends_the_answer_at_its_first_valid_call():
    """parallel_tool_calls=False: what follows the first valid call is dropped, for any
    split of the stream; an invalid call does not use up the allowance."""
    text = ("Let me check." + call("get_weather", {"city": "Paris"}) + "\nand more text"
            + call("add", {"a": 1, "b": 2}) + "trailing")
    r = parse_every_split(text, parse_tool_calls=True, max_tool_calls=1)
    assert _calls(r) == [("get_weather", {"city": "Paris"})] and r.content == "Let me check."
    text = "<tool_call>\nnot json\n</tool_call>" + call("add", {"a": 1, "b": 2}) + "then"
    r = parse_every_split(text, parse_tool_calls=True, max_tool_calls=1)
    assert _calls(r) == [("add", {"a": 1, "b": 2})] and len(r.invalid_tool_calls) == 1
    assert _calls(parse_every_split(text, parse_tool_calls=True)) == [("add", {"a": 1, "b": 2})]


def test_a_block_of_several_calls_keeps_its_valid_calls_beside_an_invalid_one():
    """Kimi K2 writes its calls in one section; mlx-lm's parser returns each. One call cut
    short made the whole section a single invalid call, so the valid one was lost (and
    under parallel_tool_calls=False the answer had no call at all)."""
    from mlx_lm.tool_parsers import kimi_k2

    fmt = ChatFormat(tool_call_start=kimi_k2.tool_call_start, tool_call_end=kimi_k2.tool_call_end,
                     tool_format="kimi_k2", tool_parser=kimi_k2.parse_tool_call)
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>'
            '{"a": 1<|tool_call_end|><|tool_calls_section_end|>')
    for limit in (None, 1):
        r = parse_every_split(text, fmt, parse_tool_calls=True, max_tool_calls=limit)
        assert _calls(r) == [("get_weather", {"city": "Paris"})] and r.tool_calls[0].index == 0
        if limit is None:
            [bad] = r.invalid_tool_calls
            assert (bad.name, bad.arguments, bad.index) == ("add", '{"a": 1', 1)


def test_an_end_marker_inside_a_json_argument_is_argument_text():
    """A JSON call may spell its own end marker in a string (a file's text): read by text,
    the call ended there, was invalid, and its rest leaked into the content (vLLM's and
    mlx-lm's parsers read it so). A string that never closes (malformed JSON) holds the rest
    of the answer: one invalid call, read as the stop matcher reads it."""
    args = {"path": "t.txt", "text": 'a</tool_call>b "q" \\ </tool_call>'}
    r = parse_every_split("Saving." + call("write", args) + "Done.", parse_tool_calls=True)
    assert _calls(r) == [("write", args)] and r.content == "Saving.Done." and r.invalid_tool_calls == []
    r = parse_every_split(call("write", args) + call("add", {"a": 1}), parse_tool_calls=True, max_tool_calls=1)
    assert _calls(r) == [("write", args)]
    malformed = '<tool_call>\n{"name": "add", "arguments": {"a": "x</tool_call>then text'
    r = parse_every_split(malformed, parse_tool_calls=True)
    assert r.tool_calls == [] and len(r.invalid_tool_calls) == 1 and r.content == ""
    assert r.invalid_tool_calls[0].text == malformed.removeprefix("<tool_call>\n")


def test_calls_are_numbered_in_the_order_written():
    """ToolCall.index and InvalidToolCall.index count the answer's calls together, as written
    (the adapters order calls by it: LangChain's chunk index, LlamaIndex's selections)."""
    text = (call("add", {"a": 1, "b": 2}) + "<tool_call>\nnot json\n</tool_call>" + "and"
            + call("get_weather", {"city": "Paris"}))
    r = parse_every_split(text, parse_tool_calls=True)
    assert [(c.index, c.name) for c in r.tool_calls] == [(0, "add"), (2, "get_weather")]
    assert [c.index for c in r.invalid_tool_calls] == [1]


def test_content_reasoning_and_calls_together():
    text = ("<think>\nThe user wants weather.\n</think>\n\nLet me check.\n"
            + call("get_weather", {"city": "東京 🙂"}) + "\n\nDone.")
    r = parse_every_split(text, parse_tool_calls=True)
    assert r.reasoning == "The user wants weather."
    assert _calls(r) == [("get_weather", {"city": "東京 🙂"})]
    # The white space before the call joins the text either side of it (the text after it
    # loses its own leading white space): they ran together, "Let me check.Done.".
    assert r.content == "Let me check.\nDone."
    assert "<tool_call>" not in r.content and "</tool_call>" not in r.content


def test_arguments_given_as_a_json_string_are_decoded():
    r = parse_every_split(call("add", None, raw_args=json.dumps(json.dumps({"a": 1, "b": 2}))),
                          parse_tool_calls=True)
    assert _calls(r) == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("body,name,arguments", [
    ('{"name": "add", "arguments": {"a": }', None, None),  # not JSON: the whole body
    ('{"name": "add", "arguments": [1, 2]}', "add", "[1, 2]"),  # JSON, but arguments not an object
    ('{"name": "add", "arguments": "[1, 2]"}', "add", "[1, 2]"),  # the same, as a string
    ('{"arguments": {"a": 1}}', None, '{"a": 1}'),  # no name
    ('{"name": 7}', None, None),
    ('[1, 2]', None, None),
    # Cut off (max_tokens): the name and the arguments written so far, as OpenAI reports it.
    ('{"name": "add", "arguments": {"a": 1, ', "add", '{"a": 1,'),
    ('{"name": "add", "arguments": {"a": 1}', "add", '{"a": 1}'),
    ('{"name": "add", ', "add", ""),
    ('{"arguments": {"a": [1, ', None, '{"a": [1,'),  # no name written yet
    # Broken, not cut: the arguments cannot be told apart; the whole body, no name.
    ('{"name": "add", "arguments": {"a": }, "b": [', None, None),
    ('{"name": "add" "arguments": {"a": 1}}', None, None),
    ('{"name": "add", "arguments": {"a": 1}} junk', None, None),
    # Arguments under a key no template writes: not a call of no arguments (they were lost).
    ('{"name": "add", "args": {"a": 1}}', "add", '{"name": "add", "args": {"a": 1}}'),
])
def test_unparsable_call_is_kept_as_invalid_with_its_raw_text(body, name, arguments):
    """An invalid call keeps its whole body, and its arguments' text where the body is a
    JSON object or one cut off after its name (what OpenAI and LangChain call an invalid
    call's arguments; a cut call's arguments were the whole body, name and all)."""
    text = "before " + f"<tool_call>\n{body}\n</tool_call>"
    r = parse_every_split(text, parse_tool_calls=True)
    assert r.tool_calls == []
    assert len(r.invalid_tool_calls) == 1
    bad = r.invalid_tool_calls[0]
    assert bad.text == body.strip() and bad.arguments == (body if arguments is None else arguments)
    assert bad.name == name and bad.error
    assert bad.id.startswith("call_")
    assert r.content == "before"


@pytest.mark.parametrize("forced_json", [False, True])
@pytest.mark.parametrize("body", [
    '{"name": "add", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}",  # valid, too deep
    '{"name": "add", "arguments": {"a": ' + "[" * 5000,  # a looping model, cut at the budget
])
def test_a_call_nested_past_the_recursion_limit_is_an_invalid_call(body, forced_json):
    """A RecursionError from the JSON parser escaped the fallback and lost the answer."""
    r = parse(["ok " + f"<tool_call>\n{body}\n</tool_call>"], parse_tool_calls=True, forced_json_calls=forced_json)
    assert r.tool_calls == [] and r.content == "ok"
    assert [c.text for c in r.invalid_tool_calls] == [body]
    # Too deep to read: its name, and the rest of the text as its arguments.
    assert (r.invalid_tool_calls[0].name, r.invalid_tool_calls[0].arguments) == ("add", body[body.index('{"a"'):])


def test_arguments_are_read_where_the_json_formats_write_them():
    """Hermes-style templates write "arguments", Llama 3's JSON calls "parameters" (vLLM's
    parser reads both); a call with neither is one of no arguments only where it wrote no
    other key (its "args" came back as a valid call of ``{}``)."""
    text = ('<tool_call>\n{"name": "add", "parameters": {"a": 1}}\n</tool_call>'
            '<tool_call>\n{"name": "get_weather", "type": "function"}\n</tool_call>')
    r = parse_every_split(text, parse_tool_calls=True)
    assert _calls(r) == [("add", {"a": 1}), ("get_weather", {})] and r.invalid_tool_calls == []


@pytest.mark.parametrize("fmt", [FMT, XML_CALLS], ids=["json", "xml"])
def test_text_either_side_of_a_call_is_joined_by_the_white_space_around_it(fmt):
    """The white space written before the call, else the one written after it (review
    h162: "Let me check.<call>\n\nDone." still ran together); none where none was written."""
    block = (call("get_weather", {"city": "Paris"}) if fmt is FMT
             else "<tool_call>\n" + _xml("get_weather", city="Paris") + "\n</tool_call>")
    for before, after, joined in (("\n", "\n\n", "\n"), ("", "\n\n", "\n\n"), (" ", "", " "), ("", "", "")):
        r = parse_every_split(f"Let me check.{before}{block}{after}Done.", fmt, parse_tool_calls=True)
        assert r.content == f"Let me check.{joined}Done." and _calls(r) == [("get_weather", {"city": "Paris"})]
        assert r.tool_calls[0].content_offset == len("Let me check.")


def test_a_call_knows_where_it_sat_in_the_content():
    """``content_offset``: the content written before each call, whatever the deltas (the
    content joins the text either side of a call, with the white space written before it;
    LangChain's v1 blocks put it back)."""
    text = ("Let me look. " + call("get_weather", {"city": "Oslo"}) + "\nThen add.\n"
            + "<tool_call>\n{oops}\n</tool_call>" + call("add", {"a": 3}) + " Done.")
    r = parse_every_split(text, parse_tool_calls=True)
    assert r.content == "Let me look. Then add.\nDone."
    calls = sorted([*r.tool_calls, *r.invalid_tool_calls], key=lambda c: c.index)
    assert [(c.index, r.content[:c.content_offset]) for c in calls] == [
        (0, "Let me look."), (1, "Let me look. Then add."), (2, "Let me look. Then add.")]


def test_valid_and_invalid_calls_in_one_answer():
    text = call("get_weather", {"city": "Oslo"}) + "\n<tool_call>\n{oops}\n</tool_call>\n" + call("add", {"a": 3})
    r = parse_every_split(text, parse_tool_calls=True)
    assert _calls(r) == [("get_weather", {"city": "Oslo"}), ("add", {"a": 3})]
    assert [c.arguments for c in r.invalid_tool_calls] == ["{oops}"]


def test_unterminated_call_at_finish():
    complete = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    r = parse_every_split(complete, parse_tool_calls=True)
    assert _calls(r) == [("get_weather", {"city": "Rome"})] and r.invalid_tool_calls == []

    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'
    r = parse_every_split(cut, parse_tool_calls=True)
    assert r.tool_calls == []
    # The tool's name and the arguments written so far, as OpenAI reports a cut call.
    assert [(c.name, c.arguments) for c in r.invalid_tool_calls] == [("get_weather", '{"city": "Ro')]
    assert r.invalid_tool_calls[0].text == cut[len("<tool_call>"):].strip()
    assert r.content == ""


@pytest.mark.parametrize("arguments", [
    '{"flag": tru', '{"x": nul', '{"x": -', '{"x": 1.', '{"x": 2e+', '{"x": "\\u00', '{"x": [1, {"y": fals',
])
def test_a_call_cut_inside_a_literal_a_number_or_an_escape_keeps_its_name(arguments):
    """A cut inside ``true``, a number or a ``\\u`` escape read as broken JSON (the decoder
    fails before the end of the text), so the call lost its name."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments
    r = parse_every_split(cut, parse_tool_calls=True)
    assert [(c.name, c.arguments) for c in r.invalid_tool_calls] == [("get_weather", arguments)]


@pytest.mark.parametrize("body", [
    '{"name": "add", "arguments": {"n": ' + "1" * 5000 + "}}",  # past Python's int digits: a ValueError
    '{"name": "add", "arguments": {"n": ' + "1" * 5000,
])
def test_an_integer_python_cannot_read_is_an_invalid_call(body):
    """json refuses integers past 4300 digits with a plain ValueError, which the reading of
    a cut call did not catch: it escaped the parser and the whole answer was lost."""
    r = parse(["ok <tool_call>\n" + body], parse_tool_calls=True)
    assert r.tool_calls == [] and [c.name for c in r.invalid_tool_calls] == [None] and r.content == "ok"


@pytest.mark.parametrize("fmt", [FMT, XML_CALLS], ids=["json", "xml"])
def test_a_number_past_a_floats_range_reads_as_python_reads_it(fmt):
    """``1e400`` is a JSON number a schema's unbounded ``number`` allows (a constrained model
    on random weights wrote one): the call is kept, its value ``inf`` as Python's json and
    Pydantic read it, so a forced call still comes back as the grammar guaranteed."""
    tools = TOOLS + [{"type": "function", "function": {"name": "scale", "parameters": {
        "type": "object", "properties": {"by": {"type": "number"}}}}}]
    if fmt is XML_CALLS:
        body = "<tool_call>\n<function=scale>\n<parameter=by>\n-1e400\n</parameter>\n</function>\n</tool_call>"
    else:
        body = call("scale", None, raw_args='{"by": -1e400}')
    r = parse_every_split(body, fmt, tools=tools, parse_tool_calls=True)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("scale", {"by": -math.inf})]


@pytest.mark.parametrize("value,valid", [("{1, 2}", False), ("b'x'", False), ("1j", False), ("(1, 2)", True)])
def test_a_python_literal_json_cannot_hold_is_an_invalid_call(value, valid):
    """Qwen3-Coder's object values are read as Python literals where they are no JSON (as
    its older template wrote dicts): a set, bytes or a complex number reached the tool, and
    ``arguments_json`` raised on the history. A tuple of numbers is an array, as JSON
    writes it."""
    tools = [{"type": "function", "function": {"name": "configure", "parameters": {
        "type": "object", "properties": {"cfg": {"type": "object"}}}}}]
    body = f"<tool_call>\n<function=configure>\n<parameter=cfg>\n{{'a': {value}}}\n</parameter>\n</function>\n</tool_call>"
    r = parse([body], XML_CALLS, tools=tools, parse_tool_calls=True)
    if valid:
        assert [c.name for c in r.tool_calls] == ["configure"] and r.invalid_tool_calls == []
        assert json.loads(r.tool_calls[0].arguments_json) == {"cfg": {"a": [1, 2]}}
    else:
        assert r.tool_calls == [] and [c.name for c in r.invalid_tool_calls] == ["configure"]
        assert "JSON has no form for" in r.invalid_tool_calls[0].error


def test_with_call_start_by_token_a_marker_its_token_did_not_write_is_content():
    """``call_start_by_token``: a call opens only at the offsets ``feed`` is given (where
    the marker's special token wrote it); the same marker spelled otherwise is content,
    for any split of the text."""
    text = "Use the <tool_call> tag. " + call("add", {"a": 1, "b": 2}) + " done"
    real = text.rindex("<tool_call>")
    for pieces in splits(text):
        p = ChatOutputParser(FMT, tools=TOOLS, parse_tool_calls=True, call_start_by_token=True)
        r = Result()
        for k, piece in enumerate(pieces):
            r.add(p.feed(piece, call_starts=[real] if k == 0 else ()))
        r.add(p.finish())
        assert r.content == "Use the <tool_call> tag. done", pieces
        assert [(c.name, c.arguments) for c in r.tool_calls] == [("add", {"a": 1, "b": 2})] and not r.invalid_tool_calls
    # Without it, the mention opens a call, as text-based parsers read it.
    assert not parse([text], parse_tool_calls=True).content.startswith("Use the <tool_call>")


def test_only_a_call_open_at_max_tokens_is_marked_truncated():
    """``truncated``: the answer reached max_tokens inside the call, so its arguments are
    those written so far; the adapters never run such a call."""
    def finish(text, truncated):
        p = ChatOutputParser(FMT, tools=TOOLS, parse_tool_calls=True)
        r = Result()
        r.add(p.feed(text))
        r.add(p.finish(truncated=truncated))
        return r.invalid_tool_calls

    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    assert [c.truncated for c in finish(cut, True)] == [True]
    assert [c.truncated for c in finish(cut, False)] == [False]  # ended otherwise (EOS): not cut
    closed = '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>'
    assert [c.truncated for c in finish(closed + "\n" + cut, True)] == [False, True]


def test_a_call_a_lenient_parser_reads_before_its_end_is_still_cut_off():
    """GLM's parser reads an unfinished call as a call: at max_tokens it came back valid,
    with the arguments written so far (the flag being written dropped), and the adapters
    would run it. With its end marker never written it is a truncated invalid call."""
    from mlx_lm.tool_parsers import glm47

    glm = ChatFormat(tool_call_start="<tool_call>", tool_call_end="</tool_call>", tool_format="glm47",
                     tool_parser=glm47.parse_tool_call)
    tools = [{"type": "function", "function": {"name": "delete", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "dry_run": {"type": "boolean"}}, "required": ["path"]}}}]
    text = "<tool_call>delete<arg_key>path</arg_key><arg_value>/data</arg_value><arg_key>dry_run</arg_key><arg_value>tr"
    for truncated, expected in ((True, ([], [("delete", True)])), (False, ([("delete", {"path": "/data"})], []))):
        p = ChatOutputParser(glm, tools=tools, parse_tool_calls=True)
        r = Result()
        r.add(p.feed(text))
        r.add(p.finish(truncated=truncated))
        assert ([(c.name, c.arguments) for c in r.tool_calls], [(c.name, c.truncated) for c in r.invalid_tool_calls]) \
            == expected


def test_call_ids_are_unique_and_prefixed():
    text = "\n".join(call("add", {"a": i, "b": i}) for i in range(20))
    ids = []
    for _ in range(5):
        r = parse([text], parse_tool_calls=True)
        assert len(r.tool_calls) == 20
        ids += [c.id for c in r.tool_calls]
    bad = parse(["<tool_call>x</tool_call><tool_call>y</tool_call>"], parse_tool_calls=True)
    ids += [c.id for c in bad.invalid_tool_calls]
    assert all(i.startswith("call_") and len(i) > len("call_") for i in ids)
    assert len(set(ids)) == len(ids) == 102


def test_an_id_the_model_writes_is_kept_once():
    """Mistral-style calls carry the model's own id, which its template wants back in the
    history (9 characters, no "call_"); a missing, blank or repeated one gets a fresh id."""
    from mlx_lm.tool_parsers import mistral

    fmt = ChatFormat(tool_call_start="[TOOL_CALLS]", tool_call_end="\n", tool_parser=mistral.parse_tool_call)
    body = [{"name": "add", "arguments": {"a": 1}, "id": "a1B2c3D4e"}, {"name": "add", "arguments": {"a": 2}},
            {"name": "add", "arguments": {"a": 3}, "id": "a1B2c3D4e"}, {"name": "add", "arguments": {}, "id": " "}]
    r = parse([f"[TOOL_CALLS]{json.dumps(body)}\n"], fmt, parse_tool_calls=True)
    ids = [c.id for c in r.tool_calls]
    assert [c.arguments for c in r.tool_calls] == [b["arguments"] for b in body]
    assert ids[0] == "a1B2c3D4e" and all(i.startswith("call_") for i in ids[1:]) and len(set(ids)) == 4


def test_a_format_without_an_end_marker_runs_its_call_to_the_end():
    """Mistral's format (mlx-lm's parser: tool_call_end "") ends a call with the answer:
    "" matched at once, so every call closed empty and its body went to the content."""
    from mlx_lm.tool_parsers import mistral

    fmt = ChatFormat(tool_call_start=mistral.tool_call_start, tool_call_end=mistral.tool_call_end,
                     tool_parser=mistral.parse_tool_call)
    assert fmt.tool_call_end == ""
    for text in ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
                 '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'):
        r = parse_every_split(text, fmt, parse_tool_calls=True)
        assert _calls(r) == [("get_weather", {"city": "Paris"})] and r.content == "" and r.invalid_tool_calls == []


@pytest.mark.parametrize("text,kept,cut", [
    ('[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2', [{"a": 1}], ("add", '{"a": 2')),
    ('[{"name": "add", "arguments": {"a": 1}}, {"na', [{"a": 1}], (None, "")),
    ('[{"name": "add", "arguments": {"a": 1}}, ', [{"a": 1}], None),
    ('[{"name": "add", "arguments": {"a": 1', [], ("add", '{"a": 1')),
    ('add[ARGS]{"a": 1}add[ARGS]{"a": 2', [{"a": 1}], ("add", '{"a": 2')),
    ('add[ARGS]{"a": 1', [], ("add", '{"a": 1')),
])
def test_a_mistral_block_cut_off_keeps_its_whole_calls_and_the_cut_ones_name(text, kept, cut):
    """mlx-lm's Mistral parser refuses a block cut off (by max_tokens) inside a later call,
    and the whole calls before it were lost with it; the cut call kept no name."""
    from mlx_lm.tool_parsers import mistral

    fmt = ChatFormat(tool_call_start=mistral.tool_call_start, tool_call_end=mistral.tool_call_end,
                     tool_parser=mistral.parse_tool_call)
    r = parse_every_split("[TOOL_CALLS]" + text, fmt, parse_tool_calls=True)
    assert _calls(r) == [("add", args) for args in kept]
    assert [(c.name, c.arguments) for c in r.invalid_tool_calls] == ([cut] if cut else [])
    p = ChatOutputParser(fmt, tools=TOOLS, parse_tool_calls=True)
    p.feed("[TOOL_CALLS]" + text)
    end = p.finish(truncated=True)
    assert [c.truncated for c in end.invalid_tool_calls] == ([True] if cut else [])


def test_a_mistral_list_keeps_its_calls_beside_one_that_is_none():
    """mlx-lm's parser refuses a whole list for one item that is no call: each is judged alone."""
    from mlx_lm.tool_parsers import mistral

    fmt = ChatFormat(tool_call_start=mistral.tool_call_start, tool_call_end=mistral.tool_call_end,
                     tool_parser=mistral.parse_tool_call)
    r = parse_every_split('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": 5}]', fmt,
                          parse_tool_calls=True)
    assert _calls(r) == [("add", {"a": 1})] and [c.text for c in r.invalid_tool_calls] == ['{"name": 5}']
    broken = parse(['[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, x]'], fmt, parse_tool_calls=True)
    assert broken.tool_calls == [] and len(broken.invalid_tool_calls) == 1  # broken JSON: one invalid block
    # Its items are read as written: mlx-lm's parser keeps only "name" and "arguments", so
    # "parameters" were dropped and "args" read as a valid call of none (review h93).
    r = parse_every_split('[TOOL_CALLS][{"name": "add", "parameters": {"a": 1}}, {"name": "add", "args": {"a": 2}},'
                          ' {"name": "add", "arguments": "{\\"a\\": 3}", "id": "a1B2c3D4e"}]', fmt, parse_tool_calls=True)
    assert _calls(r) == [("add", {"a": 1}), ("add", {"a": 3})] and r.tool_calls[1].id == "a1B2c3D4e"
    assert [c.text for c in r.invalid_tool_calls] == ['{"name": "add", "args": {"a": 2}}']
    for one, read in (('{"name": "add", "parameters": {"a": 1}}', [("add", {"a": 1})]),
                      ('{"name": "add", "args": {"a": 1}}', [])):  # a list of one comes back alone
        assert _calls(parse_every_split(f"[TOOL_CALLS][{one}]", fmt, parse_tool_calls=True)) == read


def _tool(name, *params):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in params}}}}


def _module_format(module: str) -> ChatFormat:
    import importlib

    m = importlib.import_module(f"mlx_lm.tool_parsers.{module}")
    return ChatFormat(tool_call_start=m.tool_call_start, tool_call_end=m.tool_call_end, tool_format=module,
                      tool_parser=m.parse_tool_call, template_has_tools=True)


# mlx-lm's (0.32) parsers read a name up to a character they do not expect (h149): each
# misread, then a call whose name or argument is written on its own beside the longer one.
@pytest.mark.parametrize("module, tools, misread, whole, read", [
    ("mistral", [_tool("get.weather", "city"), _tool("weather", "city")],  # read: weather
     '[TOOL_CALLS]get.weather[ARGS]{"city": "Paris"}',
     '[TOOL_CALLS]weather[ARGS]{"city": "get.weather fans"}', ("weather", {"city": "get.weather fans"})),
    ("glm47", [_tool("get", "city"), _tool("get weather")],  # read: get, {"raw": "weather"}
     "<tool_call>get weather</tool_call>",
     "<tool_call>get<arg_key>city</arg_key><arg_value>get weather</arg_value></tool_call>",
     ("get", {"city": "get weather"})),
    ("gemma4", [_tool("get", "city"), _tool("recall:get", "city")],  # read: get
     '<|tool_call>call:recall:get{city:<|"|>Paris<|"|>}<tool_call|>',
     '<|tool_call>call:get{city:<|"|>recall:get<|"|>}<tool_call|>', ("get", {"city": "recall:get"})),
    ("pythonic", [_tool("greet", "name", "first-name")],  # read: {"name": "Ann"}
     "<|tool_call_start|>[greet(first-name='Ann')]<|tool_call_end|>",
     "<|tool_call_start|>[greet(name='first-name')]<|tool_call_end|>", ("greet", {"name": "first-name"})),
    ("function_gemma", [_tool("f", "ns", "ns:key")],  # read: {"ns": "key:<escape>v<escape>"}
     "<start_function_call>call:f{ns:key:<escape>v<escape>}<end_function_call>",
     "<start_function_call>call:f{ns:<escape>ns:key<escape>}<end_function_call>", ("f", {"ns": "ns:key"})),
])
def test_a_name_the_parser_cuts_short_is_an_invalid_call_never_another_tools(module, tools, misread, whole, read):
    """A call whose name (or argument) the text writes only inside a longer listed one is
    invalid: the wrong tool ran, or the value went to another parameter. A name written on
    its own is not doubted, though the longer one appears in a value."""
    fmt = _module_format(module)
    r = parse([misread], fmt, tools=tools, parse_tool_calls=True)
    assert r.tool_calls == [] and len(r.invalid_tool_calls) == 1, _calls(r)
    assert "cut the name short" in r.invalid_tool_calls[0].error
    r = parse([whole], fmt, tools=tools, parse_tool_calls=True)
    assert _calls(r) == [read] and r.invalid_tool_calls == []


def test_json_bodies_are_not_doubted_and_a_cut_mistral_block_is_checked_too():
    """A JSON parser reads names whole, and a name written with an escape (``g\\u0065t``) is
    not found as written, so JSON calls are not checked (review h150: such a call came back
    invalid). The calls of a Mistral block whose last call was cut off are checked too."""
    tools = [_tool("get", "city"), _tool("get_weather", "city"), _tool("f", "año", "año_fiscal")]
    for text, read in (('<tool_call>\n{"name": "g\\u0065t", "arguments": {"city": "get_weather"}}\n</tool_call>',
                        ("get", {"city": "get_weather"})),
                       ('<tool_call>\n{"name": "f", "arguments": {"a\\u00f1o": "año_fiscal"}}\n</tool_call>',
                        ("f", {"año": "año_fiscal"}))):
        r = parse_every_split(text, tools=tools, parse_tool_calls=True)
        assert _calls(r) == [read] and r.invalid_tool_calls == []
    mistral = _module_format("mistral")
    tools = [_tool("get.weather", "city"), _tool("weather", "city"), {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    r = parse(['[TOOL_CALLS]get.weather[ARGS]{"city": "Paris"}add[ARGS]{"a":'], mistral, tools=tools,
              parse_tool_calls=True)
    assert r.tool_calls == [] and "cut the name short" in r.invalid_tool_calls[0].error


def test_think_after_any_call_is_content():
    """<think> opens reasoning only before any content or call, an invalid call included
    (the stop matcher reads it so, and a stop string in such "reasoning" was emitted)."""
    for first in ("<tool_call>\nnot json\n</tool_call>", call("get_weather", {"city": "Oslo"})):
        r = parse_every_split(first + "<think>r</think>answer", parse_tool_calls=True)
        assert r.reasoning == "" and r.content == "<think>r</think>answer"


def test_tool_calls_not_parsed_when_disabled():
    text = "Sure.\n" + call("get_weather", {"city": "Paris"}) + "\n"
    r = parse_every_split(text, parse_tool_calls=False)
    assert r.content == text and r.tool_calls == [] and r.invalid_tool_calls == []
    # A format without a tool parser cannot parse calls either.
    no_parser = ChatFormat(think_start="<think>", think_end="</think>", tool_call_start="<tool_call>",
                           tool_call_end="</tool_call>")
    r = parse_every_split(text, no_parser, parse_tool_calls=True)
    assert r.content == text and r.tool_calls == []


def test_forced_json_calls_parse_json_bodies_whatever_the_format_parser():
    text = call("get_weather", {"city": "Lima"})
    # The format's own (XML) parser cannot read a JSON body...
    r = parse_every_split(text, XML_CALLS, parse_tool_calls=True)
    assert r.tool_calls == [] and len(r.invalid_tool_calls) == 1
    # ...but a grammar-forced call is JSON, and is read as JSON.
    r = parse_every_split(text, XML_CALLS, parse_tool_calls=True, forced_json_calls=True)
    assert _calls(r) == [("get_weather", {"city": "Lima"})] and r.invalid_tool_calls == []


def test_an_xml_call_written_with_crlf_line_breaks_reads_as_with_lf():
    """A model trained on Windows text writes CRLF between the tags: mlx-lm's (0.32) parser
    found no ``</function>`` at the end and the call came back invalid. The framing CRs are
    read as the template's LFs; CRs inside a value stay."""
    tools = TOOLS + [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}}}}]

    def xml(nl, text):
        return (f"ok<tool_call>{nl}<function=note>{nl}<parameter=text>{nl}{text}{nl}</parameter>{nl}"
                f"<parameter=n>{nl}2{nl}</parameter>{nl}</function>{nl}</tool_call>")

    for text in ("a -> b", "one\r\ntwo", "ends in a CR\r"):
        lf = parse_every_split(xml("\n", text), XML_CALLS, tools=tools, parse_tool_calls=True)
        crlf = parse_every_split(xml("\r\n", text), XML_CALLS, tools=tools, parse_tool_calls=True)
        assert _calls(crlf) == _calls(lf) == [("note", {"text": text, "n": 2})]
        assert crlf.invalid_tool_calls == [] and crlf.content == "ok"


WRITE_FILE = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                     "n": {"type": "integer"}, "opts": {"type": "object"}}, "required": ["path"]}}}]


def _xml(name, **values):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<function={name}>\n{params}</function>"


@pytest.mark.parametrize("written,read", [
    # Two calls in one block: two calls (it read as one call of the first tool, both calls' values).
    ("<tool_call>\n" + _xml("get_weather", city="Paris") + "\n" + _xml("add", a=1, b=2) + "\n</tool_call>",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    # A blank line, a space or a tab after </function> (it was invalid: "No function provided").
    *[("<tool_call>\n" + _xml("get_weather", city="Paris") + tail + "</tool_call>", [("get_weather", {"city": "Paris"})])
      for tail in ("\n\n", " \n", "\r\n", "\t", "\n  ")],
    # No </function>, and a last parameter without </parameter> (dropped: {} came back valid).
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
     [("get_weather", {"city": "Paris"})]),
    ("<tool_call>\n<function=write_file>\n<parameter=path>\n/a.txt\n</function>\n</tool_call>",
     [("write_file", {"path": "/a.txt"})]),
    ("<tool_call>\n<function=write_file>\n<parameter=path>\n/a.txt\n</tool_call>", [("write_file", {"path": "/a.txt"})]),
    # White space before a header's ">" (it went into the value: " >\nParis").
    ("<tool_call>\n<function=add>\n<parameter=a >\n1\n</parameter>\n<parameter=b\t>\n2\n</parameter>\n</function>\n"
     "</tool_call>", [("add", {"a": 1, "b": 2})]),
    # A raw line break inside a JSON string of an object value (it came back as the text).
    ("<tool_call>\n" + _xml("write_file", path="/a", opts='{"k": "l1\nl2"}') + "\n</tool_call>",
     [("write_file", {"path": "/a", "opts": {"k": "l1\nl2"}})]),
    # Read as before: a value may hold </function> (but before a next <function=), or a line
    # that spells a parameter's tag (the grammar allows both); a value running into the next
    # tag is not split there.
    ("<tool_call>\n" + _xml("write_file", path="/a", content="x</function>\ny") + "\n</tool_call>",
     [("write_file", {"path": "/a", "content": "x</function>\ny"})]),
    ("<tool_call>\n" + _xml("write_file", path="/a", content="<parameter=n>\n3") + "\n</tool_call>",
     [("write_file", {"path": "/a", "content": "<parameter=n>\n3"})]),
    # A value holding a call's end and another call's start (the grammar allows it): it fired
    # a call of the other tool (review h162). And header-shaped text inside a value is kept.
    ("<tool_call>\n" + _xml("write_file", path="/a", content="x\n</function>\n<function=add>\n<parameter=a>\n1")
     + "\n</tool_call>", [("write_file", {"path": "/a", "content": "x\n</function>\n<function=add>\n<parameter=a>\n1"})]),
    ("<tool_call>\n" + _xml("write_file", path="/a", content="<parameter=city > and <function=add\t>") + "\n</tool_call>",
     [("write_file", {"path": "/a", "content": "<parameter=city > and <function=add\t>"})]),
    ("<tool_call>\n<function=write_file>\n<parameter=path>\n/a\n<parameter=n>\n3\n</parameter>\n</function>\n"
     "</tool_call>", [("write_file", {"path": "/a\n<parameter=n>\n3"})]),
])
def test_free_written_xml_calls_read_as_vllms_parser_reads_them(written, read):
    """Variants of Qwen3.5's XML call a model writes without the grammar, which mlx-lm's
    (0.32) parser misread (xml_call_reading.split_calls), read as vLLM's qwen3_coder parser reads
    them (review h161)."""
    tools = TOOLS + WRITE_FILE
    r = parse_every_split("ok" + written, XML_CALLS, tools=tools, parse_tool_calls=True)
    assert _calls(r) == read and r.invalid_tool_calls == [] and r.content == "ok"


def test_a_union_with_a_string_branch_keeps_text_only_that_branch_could_write():
    """A JSON string with a raw line break reads as an object where only an object fits (as
    mlx-lm's typed reading does), but as the text where a string branch reads it as written."""
    tools = [{"type": "function", "function": {"name": "put", "parameters": {"type": "object", "properties": {
        "obj": {"type": "object"}, "either": {"anyOf": [{"type": "object"}, {"type": "string"}]}}}}}]
    doc = '{"k": "l1\nl2"}'
    r = parse_every_split("<tool_call>\n" + _xml("put", obj=doc, either=doc) + "\n</tool_call>", XML_CALLS,
                          tools=tools, parse_tool_calls=True)
    assert _calls(r) == [("put", {"obj": {"k": "l1\nl2"}, "either": doc})]


def test_a_call_cut_off_by_max_tokens_stays_invalid_beside_a_whole_one():
    """A block's calls are judged alone: the whole first call is kept, the cut one (no
    </function>, no </tool_call>) is reported cut off, never completed."""
    text = "<tool_call>\n" + _xml("get_weather", city="Paris") + "\n<function=add>\n<parameter=a>\n1"
    for pieces in splits(text, n_random=4):
        p = ChatOutputParser(XML_CALLS, tools=TOOLS, parse_tool_calls=True)
        r = Result()
        for piece in pieces:
            r.add(p.feed(piece))
        r.add(p.finish(truncated=True))
        assert _calls(r) == [("get_weather", {"city": "Paris"})]
        assert [(c.name, c.truncated) for c in r.invalid_tool_calls] == [("add", True)]
        # Reported with its own text as written (it was the whole block's, review h162).
        assert r.invalid_tool_calls[0].text == "<function=add>\n<parameter=a>\n1"


@pytest.mark.parametrize("seed", range(5))
def test_random_documents_parse_the_same_for_every_split(seed):
    """Random mixes of reasoning, content (incl. marker-like text) and calls."""
    rng = random.Random(seed)
    words = ["a", " b", "<", "</", "<t", "<thin", "<tool", "🙂", "東京", "\n", "  ", "x>y", "</tool", "{", "\""]
    expected_calls = []
    text = ""
    if rng.random() < 0.7:
        text += "<think>" + "".join(rng.choice(words) for _ in range(6)).replace("</", "< /") + "</think>\n"
    content = "".join(rng.choice(words) for _ in range(6))
    text += content
    for i in range(rng.randint(0, 3)):
        args = {"city": "".join(rng.choice(words) for _ in range(3))}
        expected_calls.append(("get_weather", args))
        text += "\n" + call("get_weather", args)
    r = parse_every_split(text, parse_tool_calls=True)
    assert _calls(r) == expected_calls
    assert r.invalid_tool_calls == []
    assert "<tool_call>" not in r.content and "<think>" not in r.content


def test_unicode_survives_any_split():
    text = "<think>思考中 🤔</think>\n\n答え: 👍🏽 naïve 👨\u200d👩\u200d👧 " + call("get_weather", {"city": "Zürich 🏔"})
    r = parse_every_split(text, parse_tool_calls=True)
    assert r.reasoning == "思考中 🤔"
    assert r.content == "答え: 👍🏽 naïve 👨\u200d👩\u200d👧"
    assert _calls(r) == [("get_weather", {"city": "Zürich 🏔"})]


def test_a_longcat_call_of_no_arguments_is_read():
    """mlx-lm's (0.32) LongCat parser looks for a call's name before its first argument,
    so a call of a tool without parameters came back invalid (AttributeError); prose in a
    call block stays an invalid call."""
    import importlib

    from mlx_tandem.tool_parser_fixes import fixed

    m = importlib.import_module("mlx_lm.tool_parsers.longcat")
    fmt = ChatFormat(tool_call_start=m.tool_call_start, tool_call_end=m.tool_call_end, tool_format="longcat",
                     tool_parser=fixed("longcat", m.parse_tool_call), template_has_tools=True)
    tools = [_tool("now"), _tool("get weather"), _tool("add", "a")]
    for text, read in (("<longcat_tool_call>now</longcat_tool_call>", [("now", {})]),
                       ("<longcat_tool_call>\nget weather\n</longcat_tool_call>", [("get weather", {})]),
                       ("<longcat_tool_call>add<longcat_arg_key>a</longcat_arg_key>"
                        "<longcat_arg_value>x</longcat_arg_value></longcat_tool_call>", [("add", {"a": "x"})])):
        r = parse_every_split(text, fmt, tools=tools, parse_tool_calls=True)
        assert _calls(r) == read and r.invalid_tool_calls == []
    r = parse(["<longcat_tool_call>I cannot call a tool</longcat_tool_call>"], fmt, tools=tools, parse_tool_calls=True)
    assert r.tool_calls == [] and len(r.invalid_tool_calls) == 1
    # The engine's format (read off mlx-lm's tokenizer wrapper) has the fixed parser.
    from types import SimpleNamespace

    loaded = ChatFormat.from_tokenizer(SimpleNamespace(tool_parser=m.parse_tool_call, tool_call_start=m.tool_call_start,
                                                       tool_call_end=m.tool_call_end, chat_template="{{ tools }}"))
    assert loaded.tool_format == "longcat" and loaded.tool_parser("now", None) == {"name": "now", "arguments": {}}
