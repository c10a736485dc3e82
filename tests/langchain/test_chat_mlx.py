"""ChatMLX behaviour beyond the standard suites, checked against the engine as reference."""

from __future__ import annotations

import asyncio
import base64
import json
from decimal import Decimal
from typing import Optional

import jsonschema
import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from langchain_mlx_tandem import ChatMLX
from langchain_mlx_tandem._convert import to_engine_messages
from langchain_mlx_tandem._schemas import openai_tool
from mlx_tandem import Engine
from mlx_tandem.call_options import resolve_call
from mlx_tandem.default_model import DEFAULT_MODEL_NAME
from mlx_tandem.errors import (ConstraintError, ContextLengthError, InvalidRequestError, QueueFullError,
                               TandemError, UnsupportedContentError)

from ..numerics import AnswerLog
from .conftest import PATHS

OPTS = {"show_progress": False}


def make_llm(**kw) -> ChatMLX:
    kw.setdefault("max_tokens", 24)
    return ChatMLX(model=PATHS["qwen3_5"], engine_options=OPTS, **kw)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Joke(BaseModel):
    setup: str = Field(description="the question")
    punchline: str
    rating: Optional[int] = None


class JokeDict(TypedDict):
    setup: str
    funny: bool


# ---------------------------------------------------------------------- messages
def test_message_conversion_roundtrip():
    png = base64.b64encode(b"\x89PNG fake").decode()
    msgs = [
        SystemMessage("be brief"),
        HumanMessage("hi", name="ann"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1"}]),
        ToolMessage("3", tool_call_id="c1"),
        ToolMessage([{"type": "text", "text": "boom"}], tool_call_id="c2", status="error"),
        ToolMessage([{"type": "text", "text": "shot failed"}, {"type": "image", "base64": png, "mime_type": "image/png"}],
                    tool_call_id="c3", status="error"),
        ToolMessage([{"type": "image", "base64": png, "mime_type": "image/png"}], tool_call_id="c4", status="error"),
        HumanMessage(content=[{"type": "text", "text": "look"},
                              {"type": "image", "base64": png, "mime_type": "image/png"},
                              {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}},
                              {"type": "image", "url": "https://example.com/cat.png"}]),
    ]
    out = to_engine_messages(msgs)
    assert out[0] == {"role": "system", "content": "be brief"}
    assert out[1] == {"role": "user", "content": "hi", "name": "ann"}
    assert out[2]["tool_calls"] == [{"id": "c1", "type": "function",
                                     "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    assert out[3] == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    assert out[4] == {"role": "tool", "content": "Error: boom", "tool_call_id": "c2"}
    # A failed tool's list content says so too: in its text, or in a text part put first.
    assert out[5]["content"][0] == {"type": "text", "text": "Error: shot failed"}
    assert [p["type"] for p in out[6]["content"]] == ["text", "image"] and out[6]["content"][0]["text"] == "Error:"
    parts = out[7]["content"]
    assert parts[0] == {"type": "text", "text": "look"}
    assert [p["type"] for p in parts[1:]] == ["image"] * 3
    assert parts[1]["image"] == parts[2]["image"] == "data:image/png;base64," + png
    assert parts[3]["image"] == "https://example.com/cat.png"


def test_history_that_is_not_json_is_a_typed_error_and_tool_data_is_shown():
    """Call arguments that JSON cannot spell (a date) are a typed error, not a TypeError from
    deep in the conversion; a tool's non-standard output block is shown as JSON text with
    such values as strings (it is data for the model, as a str() of it would be)."""
    import datetime

    day = datetime.date(2020, 1, 2)
    with pytest.raises(InvalidRequestError, match="JSON-serializable"):
        to_engine_messages([HumanMessage("hi"), AIMessage("", tool_calls=[{"name": "f", "args": {"d": day}, "id": "c1"}]),
                            ToolMessage("ok", tool_call_id="c1")])
    out = to_engine_messages([ToolMessage([{"type": "non_standard", "value": {"d": day}}], tool_call_id="c1")])
    assert out[0]["content"] == '{"d": "2020-01-02"}'


def test_a_tool_result_reads_the_image_blocks_a_user_message_reads():
    """``input_image`` and an ``image_url`` string (non-standard to core) are images in a
    tool result as in a user message; they became their JSON text there, base64 and all,
    and the request went to the text lane."""
    uri = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()
    for block in ({"type": "input_image", "image_url": uri}, {"type": "image_url", "image_url": uri}):
        user = to_engine_messages([HumanMessage([{"type": "text", "text": "see"}, block])])[0]["content"]
        tool = to_engine_messages([ToolMessage([{"type": "text", "text": "see"}, block], tool_call_id="c1")])
        assert tool[0]["content"] == user == [{"type": "text", "text": "see"}, {"type": "image", "image": uri}]
    # Other blocks core has no type for stay a tool's data, shown as JSON text.
    out = to_engine_messages([ToolMessage([{"type": "json", "data": {"a": 1}}], tool_call_id="c1")])
    assert json.loads(out[0]["content"]) == {"type": "json", "data": {"a": 1}}


def test_assistant_blocks_documents_and_invalid_calls_are_kept():
    """An assistant turn's image is content (it was dropped, unlike every other role's); a
    text-plain document given as base64 is its text (it became ""); an invalid call goes
    back as written, so the error result that answers it follows a call."""
    png = base64.b64encode(b"\x89PNG fake").decode()
    bad = {"name": "add", "args": '{"a": 1,', "id": "c9", "error": "JSONDecodeError", "type": "invalid_tool_call"}
    msgs = [HumanMessage("hi"),
            AIMessage([{"type": "text", "text": "here"}, {"type": "image", "base64": png, "mime_type": "image/png"}]),
            HumanMessage([{"type": "text-plain", "base64": base64.b64encode("Pump 3 is off. Ü".encode()).decode(),
                           "mime_type": "text/plain"}]),
            AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c8"}],
                      invalid_tool_calls=[bad, {**bad, "id": "c7", "args": '{"a": "x"}'}, {**bad, "id": "c6"}]),
            ToolMessage("ok", tool_call_id="c8"), ToolMessage("Error: bad JSON", tool_call_id="c9", status="error"),
            ToolMessage("Error: a must be an integer", tool_call_id="c7", status="error")]
    out = to_engine_messages(msgs)
    assert out[1]["content"] == [{"type": "text", "text": "here"},
                                 {"type": "image", "image": f"data:image/png;base64,{png}"}]
    assert out[2]["content"] == "Pump 3 is off. Ü"
    # Invalid calls that a result answers (c6 is not: dropped); arguments only as an object,
    # since Qwen3.5's template iterates them.
    assert [c["id"] for c in out[3]["tool_calls"]] == ["c8", "c9", "c7"]
    assert [c["function"]["arguments"] for c in out[3]["tool_calls"][1:]] == ["{}", '{"a": "x"}']
    # One with no name (its text did not parse) goes back too, named "": templates pair
    # results with calls by position, and its error result read as the next call's.
    unnamed = AIMessage("", invalid_tool_calls=[{**bad, "name": None, "id": "c5"}])
    assert to_engine_messages([unnamed, ToolMessage("Error", tool_call_id="c5")])[0]["tool_calls"] == [
        {"id": "c5", "type": "function", "function": {"name": "", "arguments": "{}"}}]
    for block, error in (({"type": "text-plain", "url": "https://example.com/a.txt", "mime_type": "text/plain"},
                          UnsupportedContentError),
                         ({"type": "text-plain", "base64": base64.b64encode(b"\xff\xfe").decode(),
                           "mime_type": "text/plain"}, InvalidRequestError),
                         ({"type": "json", "json": {"x": 1}}, UnsupportedContentError)):
        with pytest.raises(error):
            to_engine_messages([HumanMessage([block])])
    # In an assistant turn a provider's own blocks (Anthropic's tool_use) are its output,
    # not content: skipped, as AIMessage.text skips them; a refusal is text.
    ai = AIMessage([{"type": "text", "text": "a"}, {"type": "tool_use", "id": "t1", "name": "add", "input": {}},
                    {"type": "refusal", "refusal": "no"}])
    assert to_engine_messages([ai])[0]["content"] == "ano"
    from langchain_core.messages import ChatMessage

    named = to_engine_messages([ChatMessage(role="model", content="m"), ToolMessage("r", tool_call_id="c1", name="add")])
    assert named == [{"role": "assistant", "content": "m"},
                     {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "add"}]
    # The whole history renders on the model's template, the invalid call included.
    llm = make_llm()
    prompt = llm.engine.tokenizer.decode(llm.engine.apply_chat_template(to_engine_messages(
        [m for m in msgs if not isinstance(m.content, list)])))
    assert "Error: bad JSON" in prompt and '{"a": "x"}' in prompt


def test_image_on_text_model_is_a_typed_error():
    llm = make_llm()
    png = base64.b64encode(b"\x89PNG fake").decode()
    msg = HumanMessage(content=[{"type": "text", "text": "what is this"},
                                {"type": "image", "base64": png, "mime_type": "image/png"}])
    with pytest.raises(UnsupportedContentError, match="text-only"):
        llm.invoke([msg])
    assert llm.invoke("still serving").response_metadata["finish_reason"] in ("stop", "length")


def test_history_ending_in_tool_message_renders_tool_result():
    llm = make_llm()
    hist = [HumanMessage("add 2 and 3"),
            AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1"}]),
            ToolMessage("RESULT-5", tool_call_id="c1")]
    ids = llm.engine.apply_chat_template(to_engine_messages(hist))
    prompt = llm.engine.tokenizer.decode(ids)
    assert "<tool_response>\nRESULT-5\n</tool_response>" in prompt
    assert '"name": "add"' in prompt
    assert isinstance(llm.invoke(hist), AIMessage)


# ---------------------------------------------------------------------- generation vs the engine
def test_invoke_and_stream_equal_engine_output():
    llm = make_llm()
    ref = llm.engine.chat_sync([{"role": "user", "content": "Hello"}], {"max_tokens": 24})
    msg = llm.invoke("Hello")
    assert msg.content == ref.content
    assert msg.usage_metadata == {"input_tokens": ref.usage.prompt_tokens,
                                  "output_tokens": ref.usage.completion_tokens,
                                  "total_tokens": ref.usage.total_tokens}
    assert msg.response_metadata["model_provider"] == "mlx_tandem"
    assert msg.response_metadata["model_name"] == PATHS["qwen3_5"]
    chunks = list(llm.stream("Hello"))
    assert "".join(c.content for c in chunks) == ref.content
    with_usage = [c for c in chunks if c.usage_metadata]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert chunks[-1].chunk_position == "last"
    assert chunks[-1].response_metadata["finish_reason"] == ref.finish_reason
    # stream_usage=False (ChatOpenAI's option), per call or on the model: no usage chunk.
    for quiet in (list(llm.stream("Hello", stream_usage=False)), list(make_llm(stream_usage=False).stream("Hello"))):
        assert "".join(c.content for c in quiet) == ref.content
        assert not any(c.usage_metadata for c in quiet) and quiet[-1].chunk_position == "last"
    assert llm.invoke("Hello", stream_usage=False).usage_metadata == msg.usage_metadata
    # None per call is the model's setting, as ChatOpenAI reads it.
    assert list(llm.stream("Hello", stream_usage=None))[-1].usage_metadata == chunks[-1].usage_metadata
    assert not any(c.usage_metadata for c in make_llm(stream_usage=False).stream("Hello", stream_usage=None))
    for bad in ("false", 0):  # "false" was truthy: usage came
        with pytest.raises(InvalidRequestError, match="stream_usage"):
            list(llm.stream("Hello", stream_usage=bad))
        with pytest.raises(InvalidRequestError, match="stream_usage"):
            llm.invoke("Hello", stream_usage=bad)


def test_generate_fills_llm_output_with_summed_usage():
    """Callback handlers read usage from ``LLMResult.llm_output`` (ChatOpenAI's keys)."""
    prompts = ["Hello", "What is 2 + 3?"]
    llm = make_llm(max_tokens=12)
    refs = [llm.engine.chat_sync([{"role": "user", "content": p}], {"max_tokens": 12}) for p in prompts]
    result = llm.generate([[HumanMessage(p)] for p in prompts])
    assert result.llm_output == {
        "model_name": PATHS["qwen3_5"],
        "token_usage": {"prompt_tokens": sum(r.usage.prompt_tokens for r in refs),
                        "completion_tokens": sum(r.usage.completion_tokens for r in refs),
                        "total_tokens": sum(r.usage.total_tokens for r in refs),
                        # OpenAI's details, summed key by key
                        "prompt_tokens_details": {"cached_tokens": sum(
                            g[0].message.usage_metadata.get("input_token_details", {}).get("cache_read", 0)
                            for g in result.generations)},
                        "completion_tokens_details": {"reasoning_tokens": 0}}}
    assert [g[0].message.usage_metadata["output_tokens"] for g in result.generations] == [
        r.usage.completion_tokens for r in refs]
    # Streamed, core assembles each result from chunks and gives no llm_output to sum.
    streamed = make_llm(max_tokens=12, streaming=True).generate([[HumanMessage(p)] for p in prompts])
    assert streamed.llm_output == {"model_name": PATHS["qwen3_5"]}
    assert [g[0].message.usage_metadata for g in streamed.generations] == [
        g[0].message.usage_metadata for g in result.generations]


async def test_generations_carry_the_finish_reason_as_chatopenai_fills_them():
    """``LLMResult.generations[i][0].generation_info["finish_reason"]`` (ChatOpenAI fills it,
    and the last chunk's model name when streamed); code written for it read None before."""
    from langchain_core.callbacks import AsyncCallbackHandler

    llm = make_llm(max_tokens=6)
    prompts = [[HumanMessage("Hello")], [HumanMessage("What is 2 + 3?")]]
    ref = [llm.engine.chat_sync([{"role": "user", "content": "Hello"}], {"max_tokens": 6}).finish_reason, "tool_calls"]
    for streaming in (False, True):
        plain = make_llm(max_tokens=6, streaming=streaming)
        infos = [r.generations[0][0].generation_info
                 for r in (plain.generate(prompts[:1]), await plain.agenerate(prompts[:1]))]
        assert all(i["finish_reason"] == ref[0] for i in infos), (streaming, infos)
        if streaming:
            assert all(i["model_name"] == PATHS["qwen3_5"] for i in infos)

    class Ends(AsyncCallbackHandler):
        def __init__(self):
            self.infos = []

        async def on_llm_end(self, response, **kwargs):
            self.infos.append(response.generations[0][0].generation_info)

    ends = Ends()
    caller = make_llm(max_tokens=64).bind_tools([add], tool_choice="add")
    await caller.ainvoke(prompts[1], config={"callbacks": [ends]})
    async for _ in caller.astream(prompts[1], config={"callbacks": [ends]}):
        pass
    assert [i["finish_reason"] for i in ends.infos] == [ref[1], ref[1]]


async def test_concurrent_astream_equals_one_at_a_time(monkeypatch):
    llm = make_llm(max_tokens=16)
    log = AnswerLog(monkeypatch)  # exact text on the CPU; near-ties on a GPU (tests/numerics.py)
    prompts = [f"question number {i}" for i in range(8)]
    alone = [(await llm.ainvoke(p)).content for p in prompts]

    async def streamed(p):
        return "".join([c.content async for c in llm.astream(p)])

    together = await asyncio.gather(*(streamed(p) for p in prompts))
    log.same_answers(list(together), alone, judge=llm.engine)


async def test_abatch_of_16_runs_as_one_engine_batch():
    # A private engine (distinct options) so the batch-size statistic is this test's alone.
    llm = ChatMLX(model=PATHS["qwen3_5"], max_tokens=8,
                  engine_options={"show_progress": False, "max_waiting": 4001})
    outs = await llm.abatch([f"hi {i}" for i in range(16)])
    assert len(outs) == 16
    assert llm.engine.stats()["max_batch_size"] == 16
    llm.engine.close_sync()


def test_lcel_chain_streamed_and_batched():
    # On the embedded (trained) model: the random factory model's logits are flat, and on one
    # of these prompts its top two first tokens were within 1e-4, which a batch of 4 and a
    # single row (different BLAS kernels) resolved differently on one CPU and not on another.
    llm = ChatMLX(max_tokens=12, engine_options=OPTS)
    chain = ChatPromptTemplate.from_messages([("system", "You are terse."), ("human", "{q}")]) | llm | StrOutputParser()
    qs = [{"q": f"topic {i}"} for i in range(4)]
    single = [chain.invoke(q) for q in qs]
    assert chain.batch(qs) == single
    assert "".join(chain.stream(qs[0])) == single[0]


def test_stop_sequences_from_constructor_and_call():
    llm = make_llm(max_tokens=24)
    full = llm.invoke("Hello").content
    assert len(full) > 6
    stop = full[3:6]
    cut = full[: full.index(stop)]
    assert make_llm(max_tokens=24, stop=[stop]).invoke("Hello").content == cut
    assert llm.invoke("Hello", stop=[stop]).content == cut
    assert make_llm(max_tokens=24, stop=stop).invoke("Hello").content == cut  # one string, as per call
    assert make_llm(max_tokens=24, stop_sequences=[stop]).invoke("Hello").content == cut  # ChatOpenAI's alias
    # A lone string is one stop sequence (as OpenAI takes it), never a set of characters.
    assert resolve_call(llm, {"stop": "END"}, owner="ChatMLX", stop="STOP").params.stop == ("STOP", "END")
    assert llm.invoke("Hello", stop=stop).content == cut


def test_model_override_runs_the_other_model():
    llm = make_llm(max_tokens=8)
    msg = llm.invoke("Hello", model=PATHS["llama"])
    assert msg.response_metadata["model_name"] == PATHS["llama"]
    ref = Engine.shared(PATHS["llama"], **OPTS).chat_sync([{"role": "user", "content": "Hello"}], {"max_tokens": 8})
    assert msg.content == ref.content


# ---------------------------------------------------------------------- tools
def test_forced_tool_call_is_valid_and_streams_as_chunks():
    llm = make_llm(max_tokens=80).bind_tools([add], tool_choice="add")
    msg = llm.invoke("add 2 and 3")
    assert [c["name"] for c in msg.tool_calls] == ["add"]
    args = msg.tool_calls[0]["args"]
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    assert msg.tool_calls[0]["id"].startswith("call_")
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert add.__call__(**args) == args["a"] + args["b"]
    chunks = list(llm.stream("add 2 and 3"))
    assert any(c.tool_call_chunks for c in chunks)
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in msg.tool_calls]


def test_a_malformed_call_is_invalid_streamed_as_invoked():
    """LangChain merges streamed calls by parsing each chunk's arguments: a chunk that
    carried the whole call body parsed as an object, so a call whose arguments are a list
    came out of the stream as a valid call of the wrong arguments."""
    llm = make_llm(max_tokens=60)
    llm.engine.start_sync()
    marker = llm.engine._front.grammar.marker
    # A grammar stands in for a model that writes a malformed call: arguments as a list.
    body = '{"name": "add", "arguments": [3, 4]}'
    grammar = f"start: {marker('<tool_call>')} {json.dumps(chr(10) + body + chr(10))} {marker('</tool_call>')}"
    bound = llm.bind_tools([add]).bind(response_format={"type": "lark", "grammar": grammar})
    invoked = bound.invoke("add 3 and 4")
    chunks = list(bound.stream("add 3 and 4"))
    streamed = chunks[0]
    for c in chunks[1:]:
        streamed = streamed + c
    assert invoked.tool_calls == [] and streamed.tool_calls == []
    assert [(c["name"], c["args"]) for c in invoked.invalid_tool_calls] == [("add", "[3, 4]")]
    assert [(c["name"], c["args"]) for c in streamed.invalid_tool_calls] == [("add", "[3, 4]")]


def test_a_call_cut_by_max_tokens_keeps_its_arguments_and_is_never_run_from_a_stream():
    """A call cut off by ``max_tokens`` is invalid with its tool's name and the arguments
    written so far, as OpenAI reports one (its arguments were the whole call text, so the
    stream merged into a call whose arguments were the call itself). Its stream chunk
    carries no name: LangChain merges a streamed call by parsing its arguments, and a named
    one would become a valid call of that tool with the fields written so far, which a
    ToolNode under LangGraph's streaming runs."""
    from langchain_core.utils.json import parse_partial_json

    llm = make_llm()
    llm.engine.start_sync()
    marker = llm.engine._front.grammar.marker
    body = '{"name": "add", "arguments": {"a": 3, "b": 4}}'
    grammar = f"start: {marker('<tool_call>')} {json.dumps(chr(10) + body + chr(10))} {marker('</tool_call>')}"
    bound = llm.bind_tools([add]).bind(response_format={"type": "lark", "grammar": grammar})
    whole = len(llm.engine.encode("<tool_call>\n" + body))
    named = 0
    for cut in range(2, whole):
        invoked = bound.invoke("add 3 and 4", max_tokens=cut)
        chunks = list(bound.stream("add 3 and 4", max_tokens=cut))
        streamed = chunks[0]
        for c in chunks[1:]:
            streamed = streamed + c
        assert invoked.response_metadata["finish_reason"] == "length" and invoked.tool_calls == []
        [bad] = invoked.invalid_tool_calls
        assert bad["name"] in (None, "add") and '{"a": 3, "b": 4}'.startswith(bad["args"]), bad
        named += bad["name"] == "add"
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
            ("", parse_partial_json(bad["args"]) if bad["args"] else {})]
        # Sent back, the streamed message renders as invoke's does: no call the model never
        # finished (the unnamed merged call rendered as one). Answered, both go back as one
        # call that its result follows (invoke's keeps the name it knows).
        history = [HumanMessage("add 3 and 4")]
        assert llm.engine.apply_chat_template(to_engine_messages([*history, streamed])) == \
            llm.engine.apply_chat_template(to_engine_messages([*history, invoked])), cut
        for msg, call_id in ((invoked, bad["id"]), (streamed, streamed.tool_calls[0]["id"])):
            sent = to_engine_messages([*history, msg, ToolMessage("error: cut off", tool_call_id=call_id)])
            assert [c["id"] for c in sent[1]["tool_calls"]] == [sent[2]["tool_call_id"]] == [call_id]
    assert named >= 5
    # One with no id either is answered by the id the history gives it.
    no_id = AIMessage("", tool_calls=[{"name": "", "args": {}, "id": None}])
    sent = to_engine_messages([HumanMessage("hi"), no_id, ToolMessage("error", tool_call_id="call_0")])
    assert [c["id"] for c in sent[1]["tool_calls"]] == ["call_0"]
    # The engine marks the call it cut (and only at max_tokens).
    from langchain_core.utils.function_calling import convert_to_openai_tool

    out = llm.engine.chat_sync([{"role": "user", "content": "add 3 and 4"}], {"max_tokens": whole - 3},
                               tools=[convert_to_openai_tool(add)], response_format={"type": "lark", "grammar": grammar})
    assert out.finish_reason == "length" and [c.truncated for c in out.invalid_tool_calls] == [True]


@pytest.mark.parametrize("model, body", [
    ("demo", '{"name": "add", "arguments": {"a": 3, "b": 4}'),  # JSON calls; the last brace missing
    ("demo", '{"name": "add", "arguments": {"a": 3, "b": 4}}}'),
    ("qwen3_5", "<function=add>\n"),  # XML calls; no parameter, no end
    ("qwen3_5", "<function=add>\n<parameter=a>\n3\n</parameter>\n"),
])
def test_a_malformed_call_is_never_a_valid_call_of_its_tool_in_a_merged_stream(model, body):
    """A call closed by its end marker but malformed is invalid to invoke; streamed, its
    chunk named the tool with arguments LangChain reads as an object, so the merged chunks
    held a valid call that a ToolNode would run (an audit). Now such a chunk is unnamed, as
    a cut one: the merged call is invalid as invoke's, or has an empty name."""
    llm = ChatMLX(max_tokens=80, engine_options=OPTS) if model == "demo" else make_llm(max_tokens=80)
    llm.engine.start_sync()
    marker = llm.engine._front.grammar.marker
    grammar = f"start: {marker('<tool_call>')} {json.dumps(chr(10) + body + chr(10))} {marker('</tool_call>')}"
    bound = llm.bind_tools([add]).bind(response_format={"type": "lark", "grammar": grammar})
    invoked = bound.invoke("add 3 and 4")
    assert invoked.tool_calls == [] and len(invoked.invalid_tool_calls) == 1
    for chunks in (list(bound.stream("add 3 and 4")), asyncio.run(_chunks(bound, "add 3 and 4"))):
        streamed = chunks[0]
        for c in chunks[1:]:
            streamed = streamed + c
        assert len(streamed.tool_calls) + len(streamed.invalid_tool_calls) == 1
        assert [c["name"] for c in streamed.tool_calls] in ([], [""])
        assert [c["args"] for c in streamed.invalid_tool_calls] in ([], [invoked.invalid_tool_calls[0]["args"]])


async def _chunks(model, prompt) -> list:
    return [c async for c in model.astream(prompt)]


def test_streamed_call_chunks_are_numbered_in_the_order_written():
    """A malformed call, then a valid one: each chunk's index is the call's place in the
    answer, from the engine (the adapter used to number a delta's valid calls before its
    invalid ones), and the merged stream keeps both calls as invoke does."""
    llm = make_llm(max_tokens=80)
    llm.engine.start_sync()
    marker = llm.engine._front.grammar.marker

    def call(body):
        return f"{marker('<tool_call>')} {json.dumps(chr(10) + body + chr(10))} {marker('</tool_call>')}"
    grammar = ("start: " + call('{"name": "add", "arguments": [3, 4]}') + ' "\\n" '
               + call('{"name": "add", "arguments": {"a": 1, "b": 2}}'))
    bound = llm.bind_tools([add]).bind(response_format={"type": "lark", "grammar": grammar})
    invoked = bound.invoke("add")
    chunks = list(bound.stream("add"))
    numbered = [(c["index"], c["args"]) for chunk in chunks for c in chunk.tool_call_chunks]
    assert numbered == [(0, "[3, 4]"), (1, '{"a": 1, "b": 2}')]
    streamed = chunks[0]
    for c in chunks[1:]:
        streamed = streamed + c
    assert [c["args"] for c in streamed.tool_calls] == [c["args"] for c in invoked.tool_calls] == [{"a": 1, "b": 2}]
    assert [c["args"] for c in streamed.invalid_tool_calls] == [c["args"] for c in invoked.invalid_tool_calls]


def test_tool_choice_none_never_calls():
    llm = make_llm(max_tokens=24).bind_tools([add], tool_choice="none")
    msg = llm.invoke("add 2 and 3")
    assert msg.tool_calls == [] and "<tool_call>" not in msg.content


def test_bad_tool_choice_raises_the_engine_error():
    llm = make_llm().bind_tools([add], tool_choice="multiply")
    with pytest.raises(ConstraintError, match="multiply"):
        llm.invoke("hi")


def test_engine_errors_surface_not_empty_answers():
    llm = make_llm()
    with pytest.raises(ContextLengthError):
        llm.invoke("word " * 5000)
    with pytest.raises(TandemError):
        llm.invoke("hi", tool_choice="required")  # forced call with no tools


def test_langgraph_agent_loop_with_forced_first_call():
    calls = []

    def add_tool(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    llm = make_llm(max_tokens=80)

    def agent(state: MessagesState):
        # The random-weight model cannot decide to call a tool: force the first call,
        # then forbid tools so it must answer.
        first = not any(isinstance(m, ToolMessage) for m in state["messages"])
        bound = llm.bind_tools([add_tool], tool_choice="any" if first else "none")
        return {"messages": [bound.invoke(state["messages"])]}

    def route(state: MessagesState):
        return "tools" if state["messages"][-1].tool_calls else END

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode([add_tool]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", route, ["tools", END])
    g.add_edge("tools", "agent")
    result = g.compile().invoke({"messages": [HumanMessage("what is 2 + 3?")]})
    msgs = result["messages"]
    assert [type(m).__name__ for m in msgs] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    call = msgs[1].tool_calls[0]
    assert msgs[2].tool_call_id == call["id"]
    assert calls == [(call["args"]["a"], call["args"]["b"])]
    assert msgs[2].content == str(sum(calls[0]))
    assert msgs[3].tool_calls == []


# ---------------------------------------------------------------------- structured output
@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_validates_on_random_weights(method):
    llm = make_llm(max_tokens=100)
    joke = llm.with_structured_output(Joke, method=method).invoke("tell a joke")
    assert isinstance(joke, Joke)
    d = llm.with_structured_output(JokeDict, method=method).invoke("tell a joke")
    assert set(d) >= {"setup", "funny"} and isinstance(d["funny"], bool)
    schema = {"title": "Point", "type": "object",
              "properties": {"x": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["x", "tags"]}
    obj = llm.with_structured_output(schema, method=method).invoke("a point")
    jsonschema.validate(obj, schema)


@pytest.mark.parametrize("method", ["json_schema", "json_mode", "function_calling"])
def test_structured_output_takes_the_schema_forms_chatopenai_takes(method):
    """OpenAI's response-format dict (whole, or its name-and-schema part) and an untitled
    JSON schema hold the answer to the same schema as a titled one does: the same greedy
    answer. Core's converter made the first a bare ``{"title": ...}`` (an unconstrained
    answer, returned without an error; for function_calling a tool without parameters, its
    call held to ``{}``), and refused the others."""
    llm = make_llm(max_tokens=60)
    body = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
            "required": ["a", "b"]}
    reference = llm.with_structured_output({"title": "thing", **body}, method=method).invoke("give a")
    jsonschema.validate(reference, body)
    named = {"name": "thing", "schema": body}
    function = {"name": "thing", "parameters": body}  # and the tool forms with_structured_output takes
    tools = ({"type": "function", "function": function}, function, {"name": "thing", "input_schema": body})
    for form in (named, {"type": "json_schema", "json_schema": named}, body, *tools):
        got = llm.with_structured_output(form, method=method).invoke("give a")
        jsonschema.validate(got, body)
        if method != "function_calling":  # a tool's own dict renders a little otherwise in the prompt
            assert got == reference, form


def test_structured_output_include_raw():
    llm = make_llm(max_tokens=100)
    out = llm.with_structured_output(Joke, include_raw=True).invoke("tell a joke")
    assert set(out) == {"raw", "parsed", "parsing_error"}
    assert isinstance(out["raw"], AIMessage) and isinstance(out["parsed"], Joke)
    assert out["parsing_error"] is None
    assert Joke.model_validate_json(out["raw"].content) == out["parsed"]


class Tree(BaseModel):
    """A labelled tree."""

    v: int
    kids: list["Tree"] = []


def _plant(tree: Tree, depth: int = 1) -> str:
    """Plant a tree.

    Args:
        tree: the tree to plant
        depth: how deep
    """
    return "planted"


@pytest.mark.parametrize("kind", ["tool", "function"])
def test_a_tool_taking_a_recursive_model_is_held_to_every_level(kind):
    """A tool's arguments are a Pydantic model too: one holding a recursive model lost its
    nested levels to {} as well, and forced calls came back with kids that are no Tree. A
    plain function (bind_tools takes one, as core does) lost them until an audit: only
    core's conversion reached the engine, and its calls failed the function's own tool."""
    from langchain_core.tools import StructuredTool, tool

    plant = tool(_plant) if kind == "tool" else _plant
    as_tool = plant if kind == "tool" else StructuredTool.from_function(_plant, parse_docstring=True)
    sent = make_llm().bind_tools([plant]).kwargs["tools"][0]["function"]["parameters"]
    assert sent["$defs"]["Tree"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/Tree"}
    if kind == "function":  # the docstring's argument descriptions, as core reads them
        assert sent["properties"]["depth"]["description"] == "how deep"
    for seed in range(8):
        msg = make_llm(max_tokens=120, temperature=1.0, seed=seed).bind_tools([plant], tool_choice="_plant").invoke(
            "plant a tree")
        assert [c["name"] for c in msg.tool_calls] == ["_plant"], msg
        Tree.model_validate(msg.tool_calls[0]["args"]["tree"])
        assert as_tool.invoke(msg.tool_calls[0]["args"]) == "planted"


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_of_a_recursive_model_holds_every_level(method):
    """langchain-core inlines refs and turns a recursive one into {} (anything goes), so the
    nested items failed the model; its own $defs/$ref schema is sent instead."""
    outs = [make_llm(max_tokens=120, temperature=1.0, seed=seed).with_structured_output(Tree, method=method).invoke("a tree")
            for seed in (1, 2, 3)]
    assert all(isinstance(t, Tree) for t in outs), outs
    bound = make_llm().bind_tools([Tree], tool_choice="Tree")
    assert bound.kwargs["tools"][0]["function"]["parameters"] == Tree.model_json_schema()
    assert make_llm().bind_tools([Joke]).kwargs["tools"][0] == convert_to_openai_tool(Joke)  # not recursive: as core


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_cut_by_max_tokens_is_a_parsing_error_not_a_partial_result(method):
    schema = {"title": "Point", "type": "object",
              "properties": {"x": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["x", "tags"]}
    for target in (schema, Joke):
        raw = make_llm(max_tokens=4).with_structured_output(target, method=method, include_raw=True)
        out = raw.invoke("a point")
        assert out["raw"].response_metadata["finish_reason"] == "length"
        assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException), out
        streamed = list(raw.stream("a point"))[-1]  # ends on the same verdict: not a partial document
        assert streamed["parsed"] is None and isinstance(streamed["parsing_error"], OutputParserException)
        plain = make_llm(max_tokens=4).with_structured_output(target, method=method)
        with pytest.raises(OutputParserException):
            plain.invoke("a point")
        with pytest.raises(OutputParserException):
            list(plain.stream("a point"))


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_a_streamed_answer_that_never_validates_raises_as_invoke_does(method):
    """Core's stream yields only the partial results that parse: an answer whose document
    the model (or a validator the schema cannot express) never lets validate ended the
    stream with nothing and no error, where invoke raises."""
    from pydantic import field_validator

    class Never(BaseModel):
        name: str

        @field_validator("name")
        @classmethod
        def refuse(cls, value: str) -> str:
            raise ValueError("no name is good enough")

    structured = make_llm(max_tokens=40).with_structured_output(Never, method=method)
    with pytest.raises(Exception) as invoked:
        structured.invoke("a name")
    with pytest.raises(type(invoked.value)):
        list(structured.stream("a name"))


async def test_structured_output_include_raw_streams_what_invoke_returns():
    llm = make_llm(max_tokens=100).with_structured_output(Joke, include_raw=True)
    want = await llm.ainvoke("tell a joke")
    chunks = [c async for c in llm.astream("tell a joke")]
    assert all(set(c) == {"raw"} for c in chunks[:-1]) and len(chunks) > 2  # raw chunks as they come
    got = chunks[0]
    for c in chunks[1:]:
        got = got + c
    assert isinstance(want["parsed"], Joke) and got["parsed"] == want["parsed"] and got["parsing_error"] is None
    assert got["raw"].content == want["raw"].content and isinstance(want["raw"], AIMessage)


async def test_structured_output_concurrent_batch_all_valid():
    llm = make_llm(max_tokens=100).with_structured_output(Joke)
    outs = await llm.abatch([f"joke {i}" for i in range(6)])
    assert all(isinstance(o, Joke) for o in outs)


# ---------------------------------------------------------------------- reasoning
def _reasoning_grammar(engine: Engine) -> dict:
    m = engine._front.grammar.marker  # forces a think block: stands in for a model that reasons
    return {"type": "lark", "grammar": f'start: {m("<think>")} "\\nweighing it\\n" {m("</think>")} "\\n\\nthe answer"'}


@pytest.mark.parametrize("lead", ["reasoning", "text"])
def test_v1_stream_keeps_the_call_block_after_reasoning_or_text(lead):
    """output_version="v1": langchain-core numbers a stream's blocks in order, and a tool
    call chunk's own index (the call's place, 0) collided with the first block's 0, so the
    two merged and the call's block was lost from the streamed message's content."""
    def grammar(engine):
        m = engine._front.grammar.marker
        call = json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})
        first = (f'{m("<think>")} "\\nweighing it\\n" {m("</think>")} "\\n\\n"' if lead == "reasoning"
                 else f'{m("<think>")} "\\n\\n" {m("</think>")} "\\n\\nweighing it\\n"')
        return {"type": "lark", "grammar": f'start: {first} '
                f'{m("<tool_call>")} {json.dumps(chr(10) + call + chr(10))} {m("</tool_call>")}'}

    llm = make_llm(max_tokens=60, output_version="v1")
    llm.engine.start_sync()
    bound = llm.bind_tools([add]).bind(response_format=grammar(llm.engine))
    whole = bound.invoke("think, then add")
    assert [b["type"] for b in whole.content] == [lead, "tool_call"]
    added = None
    for chunk in bound.stream("think, then add"):
        added = chunk if added is None else added + chunk
    # invoke with streaming=True merges the chunks as LangGraph's "messages" mode does
    merged = (make_llm(max_tokens=60, output_version="v1", streaming=True).bind_tools([add])
              .bind(response_format=grammar(llm.engine)).invoke("think, then add"))
    for msg in (added, merged):
        assert [b["type"] for b in msg.content] == [lead, "tool_call"]
        assert msg.content[0] == {**whole.content[0], "index": msg.content[0]["index"]}
        call = msg.content[1]
        assert (call["name"], call["args"], call["id"]) == ("add", {"a": 1, "b": 2}, msg.tool_calls[0]["id"])
        assert msg.tool_calls[0]["args"] == {"a": 1, "b": 2}


def test_v1_blocks_keep_text_written_after_a_call_in_place():
    """Text written after a call: invoke's v1 blocks put all the text first (core's blocks of
    the joined content) while a stream's chunks brought text, call, text (an audit), and
    a delta holding text either side of a call gave one text block before the call, so the
    stream's blocks depended on how tokens were grouped (MTP on or off). Both now keep the
    order written; v0 content is the joined text, as before."""
    from types import SimpleNamespace

    from langchain_mlx_tandem._convert import ChunkBuilder, WrittenBlocks
    from mlx_tandem.chat_output import ChatOutputParser

    def grammar(engine):
        m = engine._front.grammar.marker
        call = json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})
        bad = '{"name": "add", "arguments": {"a": 1,}}'
        return {"type": "lark", "grammar": f'start: {m("<think>")} "\\n\\n" {m("</think>")} "\\n\\nabc" '
                f'{m("<tool_call>")} {json.dumps(chr(10) + call + chr(10))} {m("</tool_call>")} "def" '
                f'{m("<tool_call>")} {json.dumps(chr(10) + bad + chr(10))} {m("</tool_call>")} "ghi"'}

    def shape(blocks):
        return [(b["type"], b.get("text") or b.get("name") or b.get("args")) for b in blocks]

    written = [("text", "abc"), ("tool_call", "add"), ("text", "def"),
               ("invalid_tool_call", '{"name": "add", "arguments": {"a": 1,}}'), ("text", "ghi")]
    llm = make_llm(max_tokens=80)
    llm.engine.start_sync()
    g = grammar(llm.engine)
    assert llm.bind_tools([add]).bind(response_format=g).invoke("x").content == "abcdefghi"  # v0
    v1 = make_llm(max_tokens=80, output_version="v1").bind_tools([add]).bind(response_format=g)
    whole = v1.invoke("x")
    assert shape(whole.content) == written and whole.content[1]["args"] == {"a": 1, "b": 2}
    added = None
    for chunk in v1.stream("x"):
        added = chunk if added is None else added + chunk
    # invoke with streaming=True merges the chunks as LangGraph's "messages" mode does
    merged = make_llm(max_tokens=80, output_version="v1", streaming=True).bind_tools([add]).bind(
        response_format=g).invoke("x")
    # (core leaves a streamed invalid call as its chunk's block)
    for msg in (added, merged):
        assert shape(msg.content) == [*written[:3], ("tool_call_chunk", written[3][1]), written[4]]
    # However the answer's text is cut into deltas, the chunks bring the blocks in order.
    out = llm.engine.chat_sync([{"role": "user", "content": "x"}], {"max_tokens": 80},
                               tools=[convert_to_openai_tool(add)], response_format=g)
    parser_args = dict(parse_tool_calls=True, tools=[convert_to_openai_tool(add)])
    assert shape(WrittenBlocks.of(out)) == written
    for size in (1, 2, 3, 5, 8, len(out.text)):
        parser, builder = ChatOutputParser(llm.engine._front.format, **parser_args), ChunkBuilder("m", written=WrittenBlocks())
        pieces = [out.text[i:i + size] for i in range(0, len(out.text), size)]
        brought = []  # text and calls in the order the chunks bring them
        for k, piece in enumerate(pieces):
            d = parser.feed(piece)
            if k == len(pieces) - 1:
                end = parser.finish()
                d.content += end.content
                d.tool_calls += end.tool_calls
                d.invalid_tool_calls += end.invalid_tool_calls
            for chunk in builder.chunks(SimpleNamespace(**vars(d), finish_reason="stop" if k == len(pieces) - 1 else None,
                                                        usage=None, logprobs=None)):
                if chunk.content and brought and brought[-1][0] == "text":
                    brought[-1] = ("text", brought[-1][1] + chunk.content)
                elif chunk.content:
                    brought.append(("text", chunk.content))
                brought += [("call", c["args"]) for c in chunk.tool_call_chunks]
        assert brought == [("text", "abc"), ("call", '{"a": 1, "b": 2}'), ("text", "def"), ("call", written[3][1]),
                           ("text", "ghi")], size
        assert shape(builder.written.blocks) == written


def test_reasoning_goes_to_reasoning_content_not_text():
    llm = make_llm(max_tokens=40)
    llm.engine.start_sync()
    bound = llm.bind(response_format=_reasoning_grammar(llm.engine))
    msg = bound.invoke("think first")
    assert msg.content == "the answer"
    assert msg.additional_kwargs["reasoning_content"] == "weighing it"
    chunks = list(bound.stream("think first"))
    assert "".join(c.content for c in chunks) == "the answer"
    assert "".join(c.additional_kwargs.get("reasoning_content", "") for c in chunks) == "weighing it"
    # The tokens spent reasoning, as ChatOpenAI reports them; none without reasoning.
    ref = llm.engine.chat_sync([{"role": "user", "content": "think first"}], {"max_tokens": 40},
                               response_format=_reasoning_grammar(llm.engine))
    assert ref.reasoning == "weighing it" and ref.usage.reasoning_tokens > 0
    assert msg.usage_metadata["output_token_details"] == {"reasoning": ref.usage.reasoning_tokens}
    assert chunks[-1].usage_metadata["output_token_details"] == {"reasoning": ref.usage.reasoning_tokens}
    assert "output_token_details" not in llm.invoke("hi", reasoning=False).usage_metadata
    v1 = make_llm(max_tokens=40, output_version="v1").bind(response_format=_reasoning_grammar(llm.engine))
    blocks = v1.invoke("think first").content
    assert [b["type"] for b in blocks] == ["reasoning", "text"]
    assert blocks[0]["reasoning"] == "weighing it" and blocks[1]["text"] == "the answer"


def test_reasoning_flag_reaches_the_template():
    on = make_llm(reasoning=True)
    off = make_llm(reasoning=False)
    msgs = [{"role": "user", "content": "hi"}]
    eng = on.engine
    p_off = eng.tokenizer.decode(eng.apply_chat_template(msgs, reasoning=False))
    assert p_off.endswith("<think>\n\n</think>\n\n")
    assert off.invoke("hi").content == eng.chat_sync(msgs, {"max_tokens": 24}, reasoning=False).content
    assert on.invoke("hi").content == eng.chat_sync(msgs, {"max_tokens": 24}, reasoning=True).content
    # Token counts render the template as the call does.
    for llm in (off, on, make_llm(chat_template_kwargs={"enable_thinking": False})):
        assert llm.get_num_tokens_from_messages([HumanMessage("hi")]) == llm.invoke("hi").usage_metadata["input_tokens"]


# ---------------------------------------------------------------------- timeouts, params, profile
def test_timeout_cancels_and_frees_the_slot():
    llm = make_llm(max_tokens=4000, timeout=0.05)
    with pytest.raises(TimeoutError):
        llm.invoke("go on for a long time")
    with pytest.raises(TimeoutError):
        list(llm.stream("go on for a long time"))
    with pytest.raises(TimeoutError):
        asyncio.run(llm.ainvoke("go on for a long time"))
    for _ in range(100):
        if llm.engine.stats()["running"] == 0:
            break
        import time
        time.sleep(0.05)
    assert llm.engine.stats()["running"] == 0


def test_none_sampling_values_are_the_defaults():
    """None is the default, as ChatOpenAI reads it: in the constructor and per call."""
    ref = make_llm().invoke("Hello").content
    assert make_llm(temperature=None, top_p=None, top_k=None, min_p=None).invoke("Hello").content == ref
    assert make_llm().invoke("Hello", temperature=None, repetition_penalty=None).content == ref


def test_the_repetition_window_reaches_the_engine():
    msgs = [{"role": "user", "content": "Hi"}]
    llm = make_llm(repetition_penalty=0.05, repetition_context_size=1)
    answers = {n: llm.engine.chat_sync(msgs, {"max_tokens": 24, "repetition_penalty": 0.05,
                                              "repetition_context_size": n}).content for n in (1, 20)}
    assert answers[1] != answers[20]  # under 1 the penalty favours repeats: the window shows
    assert llm.invoke("Hi").content == answers[1]
    assert llm.invoke("Hi", repetition_context_size=20).content == answers[20]
    assert llm._identifying_params["repetition_context_size"] == 1


def test_identity_params_and_profile():
    llm = make_llm(temperature=0.5, max_tokens=7, stop=["x"])
    ls = llm._get_ls_params(stop=["y"])
    assert ls["ls_provider"] == "mlx_tandem" and ls["ls_model_name"] == PATHS["qwen3_5"]
    assert ls["ls_temperature"] == 0.5 and ls["ls_max_tokens"] == 7 and ls["ls_stop"] == ["x", "y"]
    assert llm._identifying_params["model"] == PATHS["qwen3_5"]
    cfg = json.load(open(f"{PATHS['qwen3_5']}/config.json"))
    ctx = cfg.get("text_config", cfg)["max_position_embeddings"]
    assert llm.profile["max_input_tokens"] == ctx
    assert llm.profile["tool_calling"] is True
    assert llm.profile["image_inputs"] is llm.profile["image_tool_message"] is False  # a text model
    assert ChatMLX().model_name == DEFAULT_MODEL_NAME


def test_an_llm_cache_keeps_apart_models_that_answer_differently():
    """LangChain's LLM cache keys on ``_identifying_params``: a model-level stop, template
    kwargs or engine options left out of it made two models share one answer."""
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import set_llm_cache

    variants = [make_llm(), make_llm(stop=["e"]), make_llm(chat_template_kwargs={"enable_thinking": False}),
                ChatMLX(model=PATHS["qwen3_5"], max_tokens=24, engine_options={**OPTS, "max_model_len": 40})]
    # Each changes the prompt or the answer, so each needs a key of its own (whether the
    # random-weight model's answer changes too depends on the Python the tokenizer was
    # trained on: mlx_tandem/testing/tokenizer.py).
    assert len({v._get_llm_string() for v in variants}) == len(variants)
    uncached = [v.invoke("Tell me a story").content for v in variants]
    assert len(set(uncached)) >= 3
    set_llm_cache(InMemoryCache())
    try:
        assert [v.invoke("Tell me a story").content for v in variants] == uncached
        assert [v.invoke("Tell me a story").content for v in variants] == uncached  # now from the cache
    finally:
        set_llm_cache(None)


def test_an_llm_cache_keys_on_the_checkpoint_and_the_output_version(tmp_path, monkeypatch):
    """One relative path made in two directories is two models, at construction or per call;
    the cache keyed on the text given and returned one's answer for the other. And a v1
    model got a cached v0 message (an audit)."""
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import set_llm_cache

    dirs = {name: tmp_path / name for name in ("qwen3_5", "llama")}
    for name, d in dirs.items():
        d.mkdir()
        (d / "m").symlink_to(PATHS[name])

    def made_in(name, **kw):
        monkeypatch.chdir(dirs[name])
        return ChatMLX(model="m", engine_options=OPTS, max_tokens=24, **kw)

    def called_in(name):
        monkeypatch.chdir(dirs[name])
        return make_llm().invoke("Hello", model="m").content

    def pinned_then_called(made, called):  # "m" names the model itself: its pinned checkpoint
        llm = made_in(made)
        monkeypatch.chdir(dirs[called])
        return llm.invoke("Hello", model="m").content, llm.invoke("Hello", model=str(dirs[called] / "m")).content

    uncached = {name: made_in(name).invoke("Hello").content for name in dirs}
    assert uncached["qwen3_5"] != uncached["llama"]
    v1 = made_in("qwen3_5", output_version="v1").invoke("Hello").content
    assert v1 == [{"type": "text", "text": uncached["qwen3_5"]}]
    set_llm_cache(InMemoryCache())
    try:
        for _ in range(2):  # the second round from the cache
            assert {name: made_in(name).invoke("Hello").content for name in dirs} == uncached
            assert {name: called_in(name) for name in dirs} == uncached
            assert pinned_then_called("qwen3_5", "llama") == (uncached["qwen3_5"], uncached["llama"])
            reassigned = ChatMLX(model=str(dirs["qwen3_5"] / "m"), engine_options=OPTS, max_tokens=24)
            reassigned.model = "m"  # not the pinned text: read where each call is made
            for name in dirs:
                monkeypatch.chdir(dirs[name])
                assert reassigned.invoke("Hello").content == uncached[name]
            assert made_in("qwen3_5", output_version="v1").invoke("Hello").content == v1
    finally:
        set_llm_cache(None)


def test_a_model_langchain_rebuilds_from_its_fields_keeps_its_pinned_checkpoint(tmp_path, monkeypatch):
    """``configurable_fields`` builds a new model from the fields of the first; the pin was
    kept out of them, so a relative path was read again in the call's working directory:
    another checkpoint loaded, beside the first (review h151)."""
    from langchain_core.runnables import ConfigurableField

    dirs = {name: tmp_path / name for name in ("qwen3_5", "llama")}
    for name, d in dirs.items():
        d.mkdir()
        (d / "m").symlink_to(PATHS[name])
    monkeypatch.chdir(dirs["qwen3_5"])
    llm = ChatMLX(model="m", engine_options=OPTS, max_tokens=12)
    configurable = llm.configurable_fields(max_tokens=ConfigurableField(id="max_tokens"))
    monkeypatch.chdir(dirs["llama"])
    plain = llm.invoke("Hello").content
    assert configurable.invoke("Hello", config={"configurable": {"max_tokens": 12}}).content == plain
    assert configurable.invoke("Hello").content == plain
    assert "checkpoint_pin" not in llm.model_dump() and "checkpoint_pin" not in repr(llm)
    # A pin given for another model is not taken: the model's own text is read.
    assert ChatMLX(model=str(PATHS["llama"]), checkpoint_pin=("m", str(PATHS["qwen3_5"])))._pinned == \
        ChatMLX(model=str(PATHS["llama"]))._pinned


# ---------------------------------------------------------------------- construction
def test_model_name_is_an_alias_and_unknown_arguments_are_errors():
    from pydantic import ValidationError

    assert ChatMLX(model_name=PATHS["qwen3_5"]).model == PATHS["qwen3_5"]
    from pathlib import Path  # as Engine takes it (the string field refused it)

    assert ChatMLX(model=Path(PATHS["qwen3_5"])).model == ChatMLX(model_name=Path(PATHS["qwen3_5"])).model == PATHS["qwen3_5"]
    assert ChatMLX(model=PATHS["qwen3_5"], model_name=PATHS["qwen3_5"]).model == PATHS["qwen3_5"]
    with pytest.raises(ValidationError, match="disagree"):
        ChatMLX(model=PATHS["qwen3_5"], model_name=PATHS["llama"])
    with pytest.raises(ValidationError, match="max_tokns"):
        ChatMLX(model=PATHS["qwen3_5"], max_tokns=5)


def test_core_stream_switch_is_accepted_per_call():
    # core routes invoke(stream=...) and then hands the keyword on to _generate/_stream
    llm = make_llm()
    ref = llm.invoke("Hello")
    assert llm.invoke("Hello", stream=False).content == ref.content
    assert llm.invoke("Hello", stream=True).content == ref.content
    assert asyncio.run(llm.ainvoke("Hello", stream=False)).content == ref.content


# ---------------------------------------------------------------------- token counting
def test_token_counts_use_the_models_tokenizer_and_template():
    from langchain_core.messages import trim_messages

    llm = make_llm()
    text = "Count these tokens, please."
    assert llm.get_token_ids(text) == list(llm.engine.tokenizer.encode(text, add_special_tokens=False))
    hist = [SystemMessage("be brief"), HumanMessage("first question " * 20), AIMessage("first answer " * 20),
            HumanMessage("second question")]
    tools = [add]
    assert llm.get_num_tokens_from_messages(hist) == len(llm.engine.apply_chat_template(to_engine_messages(hist)))
    # The tool as bind_tools sends it (core's converter, its key order included: the
    # same schema with "type" first is another token count under some tokenizers).
    sent_tool = openai_tool(add, None)
    assert sent_tool["function"]["parameters"]["required"] == ["a", "b"]
    with_tools = llm.engine.apply_chat_template(to_engine_messages(hist), tools=[sent_tool])
    assert llm.get_num_tokens_from_messages(hist, tools=tools) == len(with_tools)
    assert len(with_tools) > llm.get_num_tokens_from_messages(hist)
    assert llm.get_num_tokens_from_messages([]) == 0
    # A recursive model's tool is counted with the schema bind_tools sends (core's converter
    # inlines and flattens it: 201 tokens counted for a 272-token prompt).
    sent = llm.bind_tools([Tree]).invoke(hist).usage_metadata["input_tokens"]
    assert llm.get_num_tokens_from_messages(hist, tools=[Tree]) == sent

    whole = llm.get_num_tokens_from_messages(hist)
    kept = trim_messages(hist, token_counter=llm, max_tokens=whole - 1, strategy="last", include_system=True)
    assert kept[0] == hist[0] and kept[-1] == hist[-1] and len(kept) < len(hist)
    assert llm.get_num_tokens_from_messages(kept) <= whole - 1


def test_token_count_of_a_history_the_template_refuses_is_per_message(monkeypatch):
    from langchain_core.messages import get_buffer_string
    from mlx_tandem.errors import TemplateError

    llm = make_llm()
    hist = [AIMessage("an answer with no question"), ToolMessage("42", tool_call_id="c1")]

    def refuse(*a, **k):
        raise TemplateError("No user query found in messages.")

    monkeypatch.setattr(type(llm.engine), "apply_chat_template", refuse)
    expected = sum(len(llm.engine.tokenizer.encode(get_buffer_string([m]), add_special_tokens=False)) for m in hist)
    assert llm.get_num_tokens_from_messages(hist) == expected > 0


# ---------------------------------------------------------------------- content blocks core leaves untyped
def test_untyped_blocks_are_read_or_refused_never_dropped():
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()
    # The Responses API's input blocks and image_url as a bare string are read as text / image.
    out = to_engine_messages([HumanMessage(content=[{"type": "input_text", "text": "look"},
                                                    {"type": "input_image", "image_url": png},
                                                    {"type": "image_url", "image_url": png}])])
    assert out[0]["content"] == [{"type": "text", "text": "look"}, {"type": "image", "image": png},
                                 {"type": "image", "image": png}]
    assert to_engine_messages([HumanMessage(content=[{"type": "input_text", "text": "hi"}])]) == \
        to_engine_messages([HumanMessage("hi")])
    # A plain-text document block is its text.
    doc = HumanMessage(content=[{"type": "document", "source": {"type": "text", "data": "the notes"}}])
    assert to_engine_messages([doc])[0]["content"] == "the notes"
    # Anything else is a typed error naming the block, on the call too: an image is never dropped.
    with pytest.raises(UnsupportedContentError, match="'audio_ref'"):
        to_engine_messages([HumanMessage(content=[{"type": "text", "text": "x"}, {"type": "audio_ref", "id": 1}])])
    with pytest.raises(UnsupportedContentError, match="text-only"):
        make_llm().invoke([HumanMessage(content=[{"type": "text", "text": "what is this"},
                                                 {"type": "input_image", "image_url": png}])])


def test_tool_result_blocks_without_a_type_are_shown_as_json():
    value = {"type": "json", "json": {"temperature": 21, "unit": "C"}}
    tool = ToolMessage(content=[value], tool_call_id="c1")
    assert to_engine_messages([tool]) == [{"role": "tool", "content": json.dumps(value), "tool_call_id": "c1"}]


def test_reasoning_given_as_v1_blocks_reaches_the_history_as_v0_does():
    v1 = AIMessage(content=[{"type": "reasoning", "reasoning": "weighing it"}, {"type": "text", "text": "4"}])
    v0 = AIMessage("4", additional_kwargs={"reasoning_content": "weighing it"})
    assert to_engine_messages([v1]) == to_engine_messages([v0]) == [
        {"role": "assistant", "content": "4", "reasoning_content": "weighing it"}]


@pytest.mark.parametrize("value", [1, 0, 2.0, "1"])
def test_mtp_takes_no_coerced_values(value):
    """The field took 1 as True (pydantic's lax mode) where a call's ``mtp=1`` is refused:
    one rule for both, a wrong option is never reinterpreted."""
    with pytest.raises(ValueError):
        ChatMLX(mtp=value) if value != "1" else make_llm().invoke("hi", mtp=value)


class Price(BaseModel):
    """A price."""

    amount: Decimal
    currency: str
    tip: Decimal = Field(multiple_of=Decimal("0.05"))


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_a_decimal_is_held_to_what_a_decimal_takes(method):
    """Pydantic writes a Decimal as a number or any string: held to that, sampled answers
    wrote ``"amount": "<any text>"`` and failed their own model. The engine's schema holds
    the string branch to a decimal's pattern, and a step to the number that holds it (a
    string ``"0.07"`` passed Pydantic's schema); a tool taking one is held the same way."""
    from langchain_core.tools import tool

    outs = [make_llm(max_tokens=60, temperature=1.0, seed=seed).with_structured_output(Price, method=method).invoke(
        "a price") for seed in range(6)]
    assert all(isinstance(p, Price) for p in outs), outs

    @tool
    def pay(price: Price) -> str:
        """Pay a price."""
        return "paid"

    for seed in range(4):
        msg = make_llm(max_tokens=60, temperature=1.0, seed=seed).bind_tools([pay], tool_choice="pay").invoke("pay")
        Price.model_validate(msg.tool_calls[0]["args"]["price"])


def test_a_relative_model_path_is_fixed_when_the_adapter_is_made(tmp_path, monkeypatch):
    from ..adapter_checks import relative_model_path_is_fixed_at_construction

    relative_model_path_is_fixed_at_construction(ChatMLX, PATHS, tmp_path, monkeypatch)


def test_n_answers_decode_together_each_as_its_own_request():
    """ChatOpenAI's ``n``: every answer a generation of one result, answer i as the same
    request with seed + i; ``invoke`` and ``stream`` give the first; usage counts the prompt
    once and every answer's tokens."""
    prompt = "Tell me about rivers."
    sampled = dict(max_tokens=16, temperature=1.0, seed=11)
    llm = make_llm(n=3, **sampled)
    want = [llm.engine.chat_sync([{"role": "user", "content": prompt}], {**sampled, "seed": 11 + i})
            for i in range(3)]
    assert len({w.text for w in want}) > 1  # the seeds draw different answers
    result = llm.generate([[HumanMessage(prompt)]])
    assert [g.message.content for g in result.generations[0]] == [w.content for w in want]
    usage = result.llm_output["token_usage"]
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": want[0].usage.prompt_tokens, "completion_tokens": sum(w.usage.completion_tokens for w in want),
        "total_tokens": want[0].usage.prompt_tokens + sum(w.usage.completion_tokens for w in want)}
    assert llm.invoke(prompt).content == want[0].content
    assert [c.content for c in llm.stream(prompt)] == [want[0].content]  # whole, not streamed
    agen = asyncio.run(llm.agenerate([[HumanMessage(prompt)]]))
    assert [g.message.content for g in agen.generations[0]] == [w.content for w in want]
    # Per call, and on a model built to stream.
    per_call = make_llm(streaming=True, **sampled).generate([[HumanMessage(prompt)]], n=2)
    assert [g.message.content for g in per_call.generations[0]] == [w.content for w in want[:2]]
    with pytest.raises(InvalidRequestError, match="n="):
        make_llm(max_tokens=4).invoke(prompt, n=0)
    for bad in ("3", True, 2.0, 0):  # the same rule at construction as per call
        with pytest.raises(ValueError):
            make_llm(n=bad)


def test_n_beyond_what_the_engine_holds_is_refused_before_any_answer_is_submitted():
    """An ``n`` over max_batch_size + max_waiting could never be queued: it fails at once,
    submitting nothing (it filled the waiting queue, so other callers' requests failed, then
    failed itself with QueueFullError after tens of seconds at n=60000); one that fits runs."""
    llm = ChatMLX(model=PATHS["qwen3_5"], engine_options={**OPTS, "max_batch_size": 2, "max_waiting": 3},
                  max_tokens=2)
    before = llm.engine.stats()["requests"]
    for call in (lambda: llm.invoke("Hi", n=6), lambda: asyncio.run(llm.ainvoke("Hi", n=6))):
        with pytest.raises(InvalidRequestError, match="at most 5 requests"):
            call()
    assert llm.engine.stats()["requests"] == before
    result = llm.generate([[HumanMessage("Hi")]], n=5)
    assert len(result.generations[0]) == 5


def test_n_answers_opened_before_one_fails_to_open_are_cancelled_at_once(monkeypatch):
    """When answer 2 of n cannot be submitted, answer 1 is aborted then and there (sync and
    async), not left decoding until its stream is garbage-collected."""
    llm = make_llm(n=2, max_tokens=200, temperature=1.0, seed=1)
    engine, opened = llm.engine, []

    def failing_second(open_stream):
        def wrapper(*args, **kwargs):
            if opened:
                raise QueueFullError("full")
            opened.append(open_stream(*args, **kwargs))
            return opened[-1]
        return wrapper

    async def afailing_second(*args, **kwargs):
        if opened:
            raise QueueFullError("full")
        opened.append(await open_async(*args, **kwargs))
        return opened[-1]

    open_async = engine.open_chat_stream
    monkeypatch.setattr(engine, "open_chat_stream_sync", failing_second(engine.open_chat_stream_sync))
    monkeypatch.setattr(engine, "open_chat_stream", afailing_second)
    for call in (lambda: llm.invoke("Tell me about rivers."), lambda: asyncio.run(llm.ainvoke("Tell me about rivers."))):
        opened.clear()
        before = engine.stats()["aborted"]
        with pytest.raises(QueueFullError):
            call()
        assert len(opened) == 1 and opened[0]._done  # cancelled, while still referenced here
        _wait_until(lambda: engine.stats()["aborted"] == before + 1)


def _wait_until(condition, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_n_of_one_streams_and_several_answers_never_stream_on_any_path():
    """Per call ``n=1`` streams as without it; ``n > 1`` takes the whole path on every
    streaming route of langchain-core, its v2 protocol too (stream_events v3, LangGraph's
    v2 handler), which a review found streaming one answer or failing."""
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.tracers._streaming import _V2StreamingCallbackHandler

    class V2(BaseCallbackHandler, _V2StreamingCallbackHandler):
        def on_stream_event(self, *args, **kwargs):
            pass

    prompt = "Tell me about rivers."
    sampled = dict(max_tokens=12, temperature=1.0, seed=3)
    llm = make_llm(**sampled)
    one = [c.content for c in llm.stream(prompt)]
    assert [c.content for c in llm.stream(prompt, n=1)] == one
    assert [c.content for c in llm.bind(n=None).stream(prompt)] == one
    assert make_llm(streaming=True, **sampled).invoke(prompt, n=1).content == "".join(one)
    events = asyncio.run(_events(llm.bind(n=1), prompt))
    assert "on_chat_model_stream" in events
    for model, kwargs in ((llm, {"n": 2}), (make_llm(n=2, **sampled), {})):
        result = model.generate([[HumanMessage(prompt)]], callbacks=[V2()], **kwargs)
        assert len(result.generations[0]) == 2
        assert model.invoke(prompt, config={"callbacks": [V2()]}, **kwargs).content == result.generations[0][0].text
    # stream_events v3 (beta) streams with no way to decline: refused, typed, for n > 1.
    if hasattr(llm, "stream_events"):
        with pytest.raises(InvalidRequestError, match="never streamed"):
            llm.stream_events(prompt, version="v3", n=2).output


async def _events(model, prompt) -> list[str]:
    return [e["event"] async for e in model.astream_events(prompt, version="v2")]
