"""MLXTandemLLM behaviour beyond the conformance suite, checked against the engine as reference."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from decimal import Decimal

import pytest
from pydantic import BaseModel
from llama_index.core.base.llms.types import (
    CachePoint,
    CacheControl,
    ChatMessage,
    CitableBlock,
    CitationBlock,
    ChatResponse,
    DocumentBlock,
    ImageBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.core.types import PydanticProgramMode

from llama_index.llms.mlx_tandem import MLXTandemLLM
from llama_index.llms.mlx_tandem._convert import to_engine_messages
from mlx_tandem import Engine
from mlx_tandem.default_model import DEFAULT_MODEL_NAME
from mlx_tandem.errors import ContextLengthError, InvalidRequestError, UnsupportedContentError

from .conformance import Person, add, multiply, user
from .conftest import PATHS

OPTS = {"show_progress": False}
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


def make_llm(**kw) -> MLXTandemLLM:
    kw.setdefault("max_tokens", 16)
    return MLXTandemLLM(model=PATHS["qwen3_5"], engine_options=OPTS, **kw)


# ---------------------------------------------------------------------- messages
def test_message_conversion(tmp_path):
    img = tmp_path / "cat.png"
    img.write_bytes(PNG)
    b64 = base64.b64encode(PNG).decode()
    msgs = [
        ChatMessage(role="developer", content="be brief"),
        ChatMessage(role="user", blocks=[TextBlock(text="look"), ImageBlock(image=PNG), ImageBlock(path=img),
                                         ImageBlock(url="https://example.com/cat.png"),
                                         ImageBlock(image=b64.encode(), image_mimetype="image/png"),
                                         CachePoint(cache_control=CacheControl(type="ephemeral"))]),
        ChatMessage(role="assistant", blocks=[ThinkingBlock(content="hmm"), TextBlock(text=""),
                                              ToolCallBlock(tool_call_id="c1", tool_name="add",
                                                            tool_kwargs={"a": 1, "b": 2})]),
        ChatMessage(role="tool", content="3", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 5, "b": 6}'}}]}),
        ChatMessage(role="chatbot", content="line one"),
    ]
    out = to_engine_messages(msgs)
    assert out[0] == {"role": "developer", "content": "be brief"}
    parts = out[1]["content"]
    assert parts[0] == {"type": "text", "text": "look"}
    uri = "data:image/png;base64," + b64
    assert [p["image"] for p in parts[1:]] == [uri, uri, "https://example.com/cat.png", uri]
    assert out[2] == {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
    assert out[3] == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    assert out[4]["tool_calls"][0]["id"] == "c2"
    assert out[5] == {"role": "assistant", "content": "line one"}
    with pytest.raises(UnsupportedContentError):
        to_engine_messages([ChatMessage(role="user", blocks=[DocumentBlock(data=b"%PDF-1.4")])])


def test_plain_text_documents_are_read_as_text(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("Gauge 7 reads 4.2 m.", encoding="utf-8")
    blocks = [TextBlock(text="Summarise:"),
              DocumentBlock(data="Pump 3 is offline. Ünïcode ok.".encode(), document_mimetype="text/plain"),
              DocumentBlock(path=notes)]
    content = to_engine_messages([ChatMessage(role="user", blocks=blocks)])[0]["content"]
    assert content == "Summarise:\nPump 3 is offline. Ünïcode ok.\nGauge 7 reads 4.2 m."
    for bad, error in ((DocumentBlock(url="https://example.com/a.txt", document_mimetype="text/plain"),
                        UnsupportedContentError),
                       (DocumentBlock(data=b"\xff\xfe\x00bad", document_mimetype="text/plain"), InvalidRequestError)):
        with pytest.raises(error):
            to_engine_messages([ChatMessage(role="user", blocks=[bad])])
    # JSON and YAML are text whether their MIME type is given or not.
    data = tmp_path / "data.json"
    data.write_text('{"a": 1}', encoding="utf-8")
    for block in (DocumentBlock(path=data), DocumentBlock(path=data, document_mimetype="application/json"),
                  DocumentBlock(data=b'{"a": 1}', document_mimetype="application/json; charset=utf-8"),
                  DocumentBlock(data=b'{"a": 1}', document_mimetype="application/ld+json"),
                  DocumentBlock(data=b'{"a": 1}', document_mimetype="application/octet-stream", title="a.json")):
        assert to_engine_messages([ChatMessage(role="user", blocks=[block])])[0]["content"] == '{"a": 1}'
    assert to_engine_messages([ChatMessage(role="user", blocks=[
        DocumentBlock(data=b"a: 1", document_mimetype="application/yaml")])])[0]["content"] == "a: 1"
    with pytest.raises(UnsupportedContentError):
        to_engine_messages([ChatMessage(role="user", blocks=[
            DocumentBlock(data=b"%PDF", document_mimetype="application/pdf", title="a.json")])])


def test_tool_outputs_files_and_invalid_calls_convert():
    """What core hands an LLM that earlier versions refused or lost: a tool's CitableBlock
    (FunctionTool passes it on), an image as a file-like object (the block type allows it),
    text blocks beside media (joined by newlines, as without), and this adapter's own
    invalid calls in the history (the error result that answers one must follow a call)."""
    import io

    cited = CitableBlock(title="w", source="https://w.example", content=[TextBlock(text="Sunny in Oslo")])
    citation = CitationBlock(cited_content=TextBlock(text="Rain in Bergen"), source="s", title="t",
                             additional_location_info={})
    buf = io.BytesIO(PNG)
    buf.read()  # a caller's buffer need not be at its start
    msgs = [ChatMessage(role="user", blocks=[TextBlock(text="Describe."), TextBlock(text="One word."),
                                             ImageBlock(image=buf, image_mimetype="image/png")]),
            ChatMessage(role="assistant", content="", additional_kwargs={"invalid_tool_calls": [
                {"id": "c9", "name": "add", "arguments": '{"a": 1,', "error": "JSONDecodeError"},
                {"id": "c8", "name": "add", "arguments": '{"a": 2}', "error": "unanswered"}]}),
            ChatMessage(role="tool", blocks=[cited, citation], additional_kwargs={"tool_call_id": "c9"})]
    out = to_engine_messages(msgs)
    uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert out[0]["content"] == [{"type": "text", "text": "Describe."}, {"type": "text", "text": "\n"},
                                 {"type": "text", "text": "One word."}, {"type": "image", "image": uri}]
    # Answered invalid calls only (c8 is not); arguments only as an object (Qwen3.5's
    # template iterates them), the result says what was wrong.
    assert out[1]["tool_calls"] == [{"id": "c9", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
    assert out[2] == {"role": "tool", "content": "Sunny in Oslo\nRain in Bergen", "tool_call_id": "c9"}
    # One with no name (its text did not parse) goes back too, named "": templates pair
    # results with calls by position, and its error result read as the next call's.
    unnamed = ChatMessage(role="assistant", content="", additional_kwargs={"invalid_tool_calls": [
        {"id": "c5", "name": None, "arguments": "{oops}", "error": "JSONDecodeError"}]})
    assert "tool_calls" not in to_engine_messages([unnamed, msgs[2]])[0]  # answered by no result
    assert to_engine_messages([unnamed, ChatMessage(role="tool", content="Error", additional_kwargs={
        "tool_call_id": "c5"})])[0]["tool_calls"] == [
        {"id": "c5", "type": "function", "function": {"name": "", "arguments": "{}"}}]
    # An answer's valid and invalid calls go back in the order written (its kwargs number them).
    answer = ChatMessage(role="assistant", blocks=[TextBlock(text=""), ToolCallBlock(
        tool_call_id="c2", tool_name="add", tool_kwargs={"a": 1, "b": 2})], additional_kwargs={
        "tool_calls": [{"id": "c2", "type": "function", "index": 1,
                        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
        "invalid_tool_calls": [{"id": "c1", "name": "add", "arguments": '{"a": 1,', "error": "cut", "index": 0}]})
    results = [ChatMessage(role="tool", content=r, additional_kwargs={"tool_call_id": i}) for i, r in
               (("c1", "Error: bad JSON"), ("c2", "3"))]
    assert [c["id"] for c in to_engine_messages([answer, *results])[0]["tool_calls"]] == ["c1", "c2"]


def test_history_that_is_not_json_or_not_a_call_is_a_typed_error():
    """A call's kwargs that JSON cannot spell (a date), and legacy ``tool_calls`` entries that
    are not calls, are typed errors, not a TypeError or AttributeError from the conversion."""
    import datetime

    result = ChatMessage(role="tool", content="ok", additional_kwargs={"tool_call_id": "c1"})
    histories = [
        [ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_call_id="c1", tool_name="f",
                                                              tool_kwargs={"d": datetime.date(2020, 1, 2)})])],
        [ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": ["x"]})],
        [ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [{"id": "c1", "function": "f"}]})],
    ]
    for history in histories:
        with pytest.raises(InvalidRequestError):
            to_engine_messages([*user("hi"), *history, result])


def test_tools_that_are_not_llama_index_tools_are_a_typed_error():
    """A name, None or an OpenAI-style dict where a tool belongs raised a bare AttributeError
    (an audit); the call is refused before anything reaches the engine."""
    llm = make_llm()
    good = FunctionTool.from_defaults(add)
    before = llm.engine.stats()["requests"]
    for bad in ("add", None, good.metadata.to_openai_tool()):
        with pytest.raises(InvalidRequestError, match="LlamaIndex tools"):
            llm.chat_with_tools([good, bad], user_msg="What is 2 + 3?")
    assert llm.engine.stats()["requests"] == before


def test_images_on_text_model_are_a_typed_error_and_the_engine_keeps_serving():
    llm = make_llm()
    msg = ChatMessage(role="user", blocks=[TextBlock(text="what is this"), ImageBlock(image=PNG)])
    with pytest.raises(UnsupportedContentError, match="text-only"):
        llm.chat([msg])
    assert llm.chat(user("hi")).message.content == llm.engine.chat_sync(
        [{"role": "user", "content": "hi"}], {"max_tokens": 16}).content


def test_tool_history_renders_calls_and_results():
    llm = make_llm()
    hist = [ChatMessage(role="user", content="add 2 and 3"),
            ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_call_id="c1", tool_name="add",
                                                                tool_kwargs={"a": 2, "b": 3})]),
            ChatMessage(role="tool", content="RESULT-5", additional_kwargs={"tool_call_id": "c1"})]
    prompt = llm.engine.tokenizer.decode(llm.engine.apply_chat_template(to_engine_messages(hist)))
    assert "<tool_response>\nRESULT-5\n</tool_response>" in prompt
    assert '{"name": "add", "arguments": {"a": 2, "b": 3}}' in prompt


# ---------------------------------------------------------------------- generation vs the engine
def test_chat_and_usage_equal_the_engine():
    llm = make_llm()
    ref = llm.engine.chat_sync([{"role": "user", "content": "Hello"}], {"max_tokens": 16})
    r = llm.chat(user("Hello"))
    assert r.message.content == ref.content
    assert r.raw["usage"] == {"prompt_tokens": ref.usage.prompt_tokens,
                              "completion_tokens": ref.usage.completion_tokens,
                              "total_tokens": ref.usage.total_tokens}
    assert r.raw["finish_reason"] == ref.finish_reason
    assert r.additional_kwargs["completion_tokens"] == ref.usage.completion_tokens


def test_double_messages_equal_the_merged_history():
    llm = make_llm()
    double = [ChatMessage(role="user", content="hi"), ChatMessage(role="user", content="again")]
    merged = [ChatMessage(role="user", content="hi\n\nagain")]
    assert llm.chat(double).message.content == llm.chat(merged).message.content


def test_formatted_complete_continues_the_raw_prompt():
    llm = make_llm()
    raw = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert llm.complete(raw, formatted=True).text == llm.engine.complete_sync(raw, {"max_tokens": 16}).text
    # Options that shape the template's rendering cannot apply to a rendered prompt: refused.
    for option in ({"reasoning": True}, {"parallel_tool_calls": True}, {"chat_template_kwargs": {"x": 1}}):
        with pytest.raises(TypeError, match="formatted=True"):
            llm.complete(raw, formatted=True, **option)
    assert llm.complete("Hi").text == llm.engine.chat_sync([{"role": "user", "content": "Hi"}],
                                                           {"max_tokens": 16}).content


def test_callers_prompt_functions_replace_the_chat_template():
    """messages_to_prompt and completion_to_prompt, the LLM fields local-model integrations
    honour: given, they render the prompt, which then runs raw (they were ignored)."""
    def messages_to_prompt(messages):
        return "".join(f"{m.role.value}: {m.content}\n" for m in messages) + "assistant:"

    def completion_to_prompt(text):
        return f"Q: {text}\nA:"

    llm = make_llm(messages_to_prompt=messages_to_prompt, completion_to_prompt=completion_to_prompt)
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    raw = llm.engine.complete_sync(messages_to_prompt(msgs), {"max_tokens": 16})
    assert llm.chat(msgs).message.content == raw.text
    assert "".join(r.delta for r in llm.stream_chat(msgs)) == raw.text
    assert asyncio.run(llm.achat(msgs)).message.content == raw.text
    assert llm.complete("Hi").text == llm.engine.complete_sync("Q: Hi\nA:", {"max_tokens": 16}).text
    assert llm.complete("Hi", formatted=True).text == llm.engine.complete_sync("Hi", {"max_tokens": 16}).text
    with pytest.raises(TypeError, match="tools need a chat"):  # tools are rendered by the template
        llm.chat_with_tools([FunctionTool.from_defaults(fn=add)], user_msg="add 2 and 3")
    # predict_and_call then takes core's ReAct path: its system prompt lists the tool and
    # the prompt function renders it (core 0.14 built its agent with formatter=None and
    # every such call failed).
    from llama_index.core.chat_engine.types import AgentChatResponse

    seen = []
    react = make_llm(messages_to_prompt=lambda ms: seen.append(ms) or messages_to_prompt(ms))
    for call in (lambda: react.predict_and_call([FunctionTool.from_defaults(fn=add)], user_msg="add 2 and 3"),
                 lambda: asyncio.run(react.apredict_and_call([FunctionTool.from_defaults(fn=add)], user_msg="add 2"))):
        n = len(seen)
        assert isinstance(call(), AgentChatResponse)
        assert len(seen) > n and "> Tool Name: add" in seen[n][0].content
    # Without them, a chat goes through the model's chat template.
    plain = make_llm()
    assert plain.chat(msgs).message.content == plain.engine.chat_sync(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {"max_tokens": 16}).content


def test_sampling_fields_reach_the_engine():
    seeded = make_llm(temperature=0.9, top_p=0.9, seed=7)
    ref = seeded.engine.chat_sync([{"role": "user", "content": "Hi"}],
                                  {"max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7})
    assert seeded.chat(user("Hi")).message.content == ref.content
    assert seeded.chat(user("Hi"), seed=8).message.content == seeded.engine.chat_sync(
        [{"role": "user", "content": "Hi"}], {"max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 8}).content


def test_the_repetition_window_reaches_the_engine():
    msgs = [{"role": "user", "content": "Hi"}]
    llm = make_llm(repetition_penalty=0.05, repetition_context_size=1)
    answers = {n: llm.engine.chat_sync(msgs, {"max_tokens": 16, "repetition_penalty": 0.05,
                                              "repetition_context_size": n}).content for n in (1, 20)}
    assert answers[1] != answers[20]  # under 1 the penalty favours repeats: the window shows
    assert llm.chat(user("Hi")).message.content == answers[1]
    assert llm.chat(user("Hi"), repetition_context_size=20).message.content == answers[20]


def test_unknown_kwargs_and_engine_errors_are_typed():
    llm = make_llm()
    with pytest.raises(TypeError, match="unexpected keyword"):
        llm.chat(user("hi"), frobnicate=True)
    with pytest.raises(ContextLengthError):
        llm.chat(user("word " * 5000))


def test_model_name_is_an_alias_and_unknown_constructor_arguments_are_errors():
    from pydantic import ValidationError

    assert MLXTandemLLM(model_name=PATHS["qwen3_5"]).model == PATHS["qwen3_5"]
    from pathlib import Path  # as Engine takes it (the string field refused it)

    assert MLXTandemLLM(model=Path(PATHS["qwen3_5"])).model == MLXTandemLLM(model_name=Path(PATHS["qwen3_5"])).model == PATHS["qwen3_5"]
    with pytest.raises(ValidationError, match="disagree"):
        MLXTandemLLM(model=PATHS["qwen3_5"], model_name=PATHS["llama"])
    with pytest.raises(ValidationError, match="max_tokns"):
        MLXTandemLLM(model=PATHS["qwen3_5"], max_tokns=5)
    llm = make_llm(temperature=0.3)  # serialization still round-trips
    assert MLXTandemLLM.from_dict(llm.to_dict()).temperature == 0.3
    # As with core's LLMs, a dump builds the same LLM (it holds core's class_name).
    assert MLXTandemLLM(**llm.model_dump()).model_dump() == llm.model_dump()
    with pytest.raises(ValidationError, match="class_name"):
        MLXTandemLLM(model=PATHS["qwen3_5"], class_name="OpenAI")  # another class's dump


# ---------------------------------------------------------------------- reasoning
def _grammar(engine: Engine, body: str) -> dict:
    return {"type": "lark", "grammar": f"start: {body}"}


def _reasoning_format(engine: Engine) -> dict:
    m = engine._front.grammar.marker  # forces a think block: stands in for a model that reasons
    return _grammar(engine, f'{m("<think>")} "\\nweighing it\\n" {m("</think>")} "\\n\\nthe answer"')


def test_reasoning_goes_to_thinking_block_and_thinking_delta():
    llm = make_llm(max_tokens=40)
    llm.engine.start_sync()
    fmt = _reasoning_format(llm.engine)
    r = llm.chat(user("think first"), response_format=fmt)
    assert r.message.content == "the answer"
    thinking = [b for b in r.message.blocks if isinstance(b, ThinkingBlock)]
    assert [b.content for b in thinking] == ["weighing it"]
    chunks = list(llm.stream_chat(user("think first"), response_format=fmt))
    assert "".join(c.additional_kwargs.get("thinking_delta", "") for c in chunks) == "weighing it"
    assert "".join(c.delta for c in chunks) == chunks[-1].message.content == "the answer"
    assert [b.content for b in chunks[-1].message.blocks if isinstance(b, ThinkingBlock)] == ["weighing it"]
    # Sent back in a history, the reasoning reaches the template as reasoning_content.
    assert to_engine_messages([r.message])[0]["reasoning_content"] == "weighing it"
    # The tokens spent reasoning: the block's num_tokens, and OpenAI's usage shape in raw.
    ref = llm.engine.chat_sync([{"role": "user", "content": "think first"}], {"max_tokens": 40}, response_format=fmt)
    n = ref.usage.reasoning_tokens
    assert ref.reasoning == "weighing it" and n > 0
    assert thinking[0].num_tokens == n and r.raw["usage"]["completion_tokens_details"] == {"reasoning_tokens": n}
    last = [b for b in chunks[-1].message.blocks if isinstance(b, ThinkingBlock)]
    assert last[0].num_tokens == n and chunks[-1].raw["usage"]["completion_tokens_details"] == {"reasoning_tokens": n}
    assert "completion_tokens_details" not in llm.chat(user("hi"), reasoning=False).raw["usage"]
    # Completions: complete() and the last streamed response both carry the whole reasoning.
    done = llm.complete("think first", response_format=fmt)
    streamed = list(llm.stream_complete("think first", response_format=fmt))
    assert done.additional_kwargs["thinking"] == streamed[-1].additional_kwargs["thinking"] == "weighing it"
    assert streamed[-1].text == done.text == "the answer"


def test_reasoning_flag_reaches_the_template():
    msgs = [{"role": "user", "content": "hi"}]
    on, off = make_llm(reasoning=True), make_llm(reasoning=False)
    eng = on.engine
    assert on.chat(user("hi")).message.content == eng.chat_sync(msgs, {"max_tokens": 16}, reasoning=True).content
    assert off.chat(user("hi")).message.content == eng.chat_sync(msgs, {"max_tokens": 16}, reasoning=False).content


# ---------------------------------------------------------------------- tools
def _two_calls_format(engine: Engine) -> dict:
    m = engine._front.grammar.marker  # the model "decides" to call two tools (under tool_choice="auto")
    call = lambda name, a, b: (f'{m("<tool_call>")} "\\n{{\\"name\\": \\"{name}\\", \\"arguments\\": '  # noqa: E731
                               f'{{\\"a\\": {a}, \\"b\\": {b}}}}}\\n" {m("</tool_call>")}')
    return _grammar(engine, f'{call("add", 2, 3)} "\\n" {call("multiply", 4, 5)}')


def _collect_async(agen_coro) -> list:
    async def run():
        return [c async for c in await agen_coro]
    return asyncio.run(run())


def test_unforced_tool_calls_are_parsed_and_trimmed_unless_parallel():
    llm = make_llm(max_tokens=80)
    llm.engine.start_sync()
    tools = [FunctionTool.from_defaults(fn=add), FunctionTool.from_defaults(fn=multiply)]
    fmt = _two_calls_format(llm.engine)
    both = llm.chat_with_tools(tools, user_msg="go", allow_parallel_tool_calls=True, response_format=fmt)
    calls = llm.get_tool_calls_from_response(both)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("add", {"a": 2, "b": 3}),
                                                             ("multiply", {"a": 4, "b": 5})]
    assert len({c.tool_id for c in calls}) == 2
    assert both.raw["finish_reason"] == "tool_calls"
    one = llm.chat_with_tools(tools, user_msg="go", response_format=fmt)
    assert [c.tool_name for c in llm.get_tool_calls_from_response(one)] == ["add"]
    streamed = list(llm.stream_chat_with_tools(tools, user_msg="go", allow_parallel_tool_calls=True,
                                               response_format=fmt))
    counts = [len(llm.get_tool_calls_from_response(c, error_on_no_tool_call=False)) for c in streamed]
    assert counts == sorted(counts) and counts[-1] == 2  # calls appear as they complete
    # Streamed without parallel calls (FunctionAgent's default), the answer ends at its first
    # call, as the non-streamed one is trimmed to it; the row is freed at once.
    for stream in (llm.stream_chat_with_tools(tools, user_msg="go", response_format=fmt),
                   _collect_async(llm.astream_chat_with_tools(tools, user_msg="go", response_format=fmt))):
        chunks = list(stream)
        assert [c.tool_name for c in llm.get_tool_calls_from_response(chunks[-1])] == ["add"]
        assert chunks[-1].raw["finish_reason"] == "tool_calls"
        assert chunks[-1].raw["usage"]["completion_tokens"] < both.raw["usage"]["completion_tokens"]
    llm.engine.run_on_owner_thread(lambda: None)  # the owner thread has read the aborts queued before
    assert llm.engine.stats()["running"] == 0
    # The calls round-trip: sent back, they render as the model wrote them.
    back = to_engine_messages([both.message])[0]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in back] == [{"a": 2, "b": 3}, {"a": 4, "b": 5}]


def test_without_parallel_calls_a_stream_keeps_the_one_call_chat_keeps():
    """The model writes an invalid call, then a valid one. The engine ends the answer at its
    first valid call, so both were streamed, and FunctionAgent (which streams) ran both;
    chat_with_tools keeps one. Streams now keep the same one."""
    llm = make_llm(max_tokens=80)
    llm.engine.start_sync()
    m = llm.engine._front.grammar.marker
    call = lambda body: f"{m('<tool_call>')} {json.dumps(chr(10) + body + chr(10))} {m('</tool_call>')}"  # noqa: E731
    fmt = _grammar(llm.engine, call('{"name": "add", "arguments": [3, 4]}') + ' "\\n" '
                   + call('{"name": "add", "arguments": {"a": 1, "b": 2}}'))
    tools = [FunctionTool.from_defaults(fn=add)]

    def selections(response):
        return [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(response)]

    both = llm.chat_with_tools(tools, user_msg="go", allow_parallel_tool_calls=True, response_format=fmt)
    # In the order written: the invalid call (its arguments read leniently), then the valid one.
    assert selections(both) == [("add", {}), ("add", {"a": 1, "b": 2})]
    one = selections(llm.chat_with_tools(tools, user_msg="go", response_format=fmt))
    assert one == [("add", {"a": 1, "b": 2})]
    for stream in (llm.stream_chat_with_tools(tools, user_msg="go", response_format=fmt),
                   _collect_async(llm.astream_chat_with_tools(tools, user_msg="go", response_format=fmt))):
        assert selections(list(stream)[-1]) == one


def test_string_arguments_from_other_integrations_are_read_leniently():
    """As the OpenAI LLM reads them: a truncated object keeps its complete fields."""
    llm = make_llm()
    blocks = [ToolCallBlock(tool_call_id="c1", tool_name="add", tool_kwargs='{"a": 2, "b": 3'),
              ToolCallBlock(tool_call_id="c2", tool_name="add", tool_kwargs="not json")]
    response = ChatResponse(message=ChatMessage(role="assistant", blocks=blocks))
    calls = llm.get_tool_calls_from_response(response)
    assert [(c.tool_id, c.tool_kwargs) for c in calls] == [("c1", {"a": 2, "b": 3}), ("c2", {})]


def test_a_call_that_failed_to_parse_goes_to_the_agent():
    """An invalid call that names a tool is a ToolSelection (arguments read leniently): the
    agent runs it and the tool's error goes back to the model. Dropped, FunctionAgent ended
    its turn with nothing said. One call in all unless parallel calls are allowed."""
    llm = make_llm()
    tool = FunctionTool.from_defaults(fn=add)
    bad = [{"id": "c9", "name": "add", "arguments": '{"a": 2, "b": ', "error": "broken"},
           {"id": "c8", "name": None, "arguments": "<tool_call>{", "error": "no name"},
           # Cut off by max_tokens: never run with the fields written so far.
           {"id": "c7", "name": "add", "arguments": '{"a": 2, "b": ', "error": "cut off", "truncated": True}]

    def response(blocks):
        return ChatResponse(message=ChatMessage(role="assistant", blocks=blocks,
                                                additional_kwargs={"invalid_tool_calls": [dict(b) for b in bad]}))

    calls = llm.get_tool_calls_from_response(response([TextBlock(text="")]))
    assert [(c.tool_id, c.tool_name, c.tool_kwargs) for c in calls] == [("c9", "add", {"a": 2, "b": None})]
    valid = ToolCallBlock(tool_call_id="c1", tool_name="add", tool_kwargs={"a": 1, "b": 2})
    kept = llm._validate_chat_with_tools_response(response([valid]), [tool])
    assert [c.tool_id for c in llm.get_tool_calls_from_response(kept)] == ["c1"]
    both = llm._validate_chat_with_tools_response(response([valid]), [tool], allow_parallel_tool_calls=True)
    assert [c.tool_id for c in llm.get_tool_calls_from_response(both)] == ["c1", "c9"]


def test_tool_required_forces_a_valid_call_in_a_batch():
    llm = make_llm(max_tokens=80)
    tool = FunctionTool.from_defaults(fn=add)

    async def run():
        return await asyncio.gather(*(llm.achat_with_tools([tool], user_msg=f"sum {i}", tool_required=True)
                                      for i in range(6)))

    before = llm.engine.stats()["constrained_requests"]
    for r in asyncio.run(run()):
        (call,) = llm.get_tool_calls_from_response(r)
        assert call.tool_name == "add" and isinstance(call.tool_kwargs["a"], int)
    assert llm.engine.stats()["constrained_requests"] - before == 6


@pytest.mark.parametrize("name", ["math.add", "Box[int]"])
def test_a_tool_whose_name_core_rewrites_is_called_by_its_own_name(name):
    """Core writes a tool's name in OpenAI's alphabet for the model (``math_add``) but runs
    the tool it finds by its own name: predict_and_call raised KeyError. The model is shown
    the tool's own name, and the call runs the tool."""
    llm = make_llm(max_tokens=80)
    tool = FunctionTool.from_defaults(fn=add, name=name)
    for out in (llm.predict_and_call([tool], user_msg="add 2 and 3", tool_required=True),
                asyncio.run(llm.apredict_and_call([tool], user_msg="add 2 and 3", tool_required=True))):
        (source,) = out.sources
        assert source.tool_name == name and not source.is_error
        assert source.raw_output == add(**source.raw_input["kwargs"])


def test_structured_predict_in_function_mode_uses_a_forced_call():
    llm = make_llm(max_tokens=120, pydantic_program_mode=PydanticProgramMode.FUNCTION)
    before = llm.engine.stats()["constrained_requests"]
    p = llm.structured_predict(Person, PromptTemplate("Describe {who}."), who="a pirate")
    assert isinstance(p, Person)
    assert llm.engine.stats()["constrained_requests"] == before + 1


def test_structured_predict_shows_the_model_the_schema(monkeypatch):
    """The grammar holds the answer to the class; the model is shown the class too, its
    docstring and fields' descriptions, in core's words and place (after the last user text,
    or in the system prompt), as core's programs show it. It was shown nothing."""
    from llama_index.core.output_parsers.pydantic import PydanticOutputParser

    seen = []
    original = Engine.open_chat_stream_sync

    def spy(self, messages, params=None, **options):
        seen.append(messages)
        return original(self, messages, params, **options)

    monkeypatch.setattr(Engine, "open_chat_stream_sync", spy)
    schema = PydanticOutputParser(Person).get_format_string(escape_json=False)
    assert "{{" not in schema and json.dumps(Person.model_json_schema(), ensure_ascii=False) in schema
    make_llm(max_tokens=60).structured_predict(Person, PromptTemplate("Describe {who}."), who="a pirate")
    assert seen[-1] == [{"role": "user", "content": "Describe a pirate.\n\n" + schema}]
    make_llm(max_tokens=60, system_prompt="Be brief.").structured_predict(
        Person, PromptTemplate("Describe {who}."), who="a pirate")
    assert seen[-1] == [{"role": "system", "content": "Be brief.\n\n" + schema},
                        {"role": "user", "content": "Describe a pirate."}]


def test_completions_carry_their_tool_calls():
    """A completion with tools has its calls in ``additional_kwargs``, as core's
    chat-to-completion conversion carries them; they were dropped (text '' and nothing else)."""
    llm = make_llm(max_tokens=80)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}]
    chat = llm.chat(user("add 2 and 3"), tools=tools, tool_choice="required")
    expected = chat.message.additional_kwargs["tool_calls"]
    done = llm.complete("add 2 and 3", tools=tools, tool_choice="required")
    last = list(llm.stream_complete("add 2 and 3", tools=tools, tool_choice="required"))[-1]
    adone = asyncio.run(llm.acomplete("add 2 and 3", tools=tools, tool_choice="required"))
    for got in (done, last, adone):
        calls = got.additional_kwargs["tool_calls"]
        assert [(c["function"], c["index"]) for c in calls] == [(c["function"], c["index"]) for c in expected]
        assert got.raw["finish_reason"] == "tool_calls"


def test_an_async_stream_opens_on_the_loop_that_reads_it():
    """astream_chat/astream_complete return generators that open their request when first
    read, as the sync twins and core's providers do: one obtained on a loop can be read on
    another (it was opened at the await, on the first loop, and then refused)."""
    llm = make_llm(max_tokens=8)
    ref = llm.chat(user("hi")).message.content
    for make in (lambda: llm.astream_chat(user("hi")), lambda: llm.astream_complete("hi")):
        gen = asyncio.run(make())

        async def read(gen=gen):
            last = None
            async for r in gen:
                last = r
            return last

        last = asyncio.run(read())
        assert (last.message.content if hasattr(last, "message") else last.text) == (
            ref if hasattr(last, "message") else llm.complete("hi").text)
    assert llm.engine.stats()["running"] == 0


def test_stream_structured_predict_yields_growing_partials():
    llm = make_llm(max_tokens=120)
    parts = list(llm.stream_structured_predict(Person, PromptTemplate("Describe {who}."), who="a pirate"))
    assert len(parts) >= 2
    filled = [sum(v is not None for v in p.model_dump().values()) for p in parts]
    assert filled == sorted(filled)
    assert isinstance(parts[-1], Person)


# ---------------------------------------------------------------------- metadata, timeouts, cancellation
def test_metadata_from_the_checkpoint_without_loading():
    cfg = json.load(open(f"{PATHS['qwen3_5']}/config.json"))
    ctx = cfg.get("text_config", cfg)["max_position_embeddings"]
    fresh = MLXTandemLLM(model=PATHS["qwen3_5"], engine_options={"show_progress": False, "max_waiting": 4002})
    md = fresh.metadata
    assert md.context_window == ctx and md.num_output == 256
    assert md.is_function_calling_model and md.model_name == PATHS["qwen3_5"]
    assert fresh.engine.stats()["loaded"] is False  # metadata never loads the weights
    assert make_llm(context_window=1000, max_tokens=50).metadata.context_window == 1000
    assert MLXTandemLLM().metadata.model_name == DEFAULT_MODEL_NAME
    # A caller's own messages_to_prompt renders a raw prompt, which cannot carry tools:
    # core must not take its tool-calling path.
    assert not make_llm(messages_to_prompt=lambda ms: "\n".join(m.content for m in ms)).metadata.is_function_calling_model


def test_instrumentation_payload_never_loads_the_model(monkeypatch):
    """Core records ``to_payload()`` on the event loop before every async call; for a
    checkpoint not on disk yet, reading the metadata there loaded (downloaded) the model
    and stalled the loop."""
    import mlx_tandem.engine as engine_module

    on_disk = make_llm().to_payload()
    assert on_disk["class_name"] == "MLXTandemLLM" and on_disk["is_function_calling_model"] is True
    monkeypatch.setattr(engine_module, "local_checkpoint", lambda model: None)  # as for a hub id not fetched
    fresh = MLXTandemLLM(model="org/not-fetched", engine_options={"show_progress": False, "max_waiting": 4003})
    assert fresh.to_payload() == {"class_name": "MLXTandemLLM", "model_name": "org/not-fetched", "is_chat_model": True}
    assert fresh.engine.stats()["loaded"] is False


def test_a_default_tool_choice_holds_for_tool_calls():
    llm = make_llm(additional_kwargs={"tool_choice": "required"})
    tool = FunctionTool.from_defaults(add)
    assert llm._prepare_chat_with_tools([tool], user_msg="hi")["tool_choice"] == "required"
    assert llm._prepare_chat_with_tools([tool], user_msg="hi", tool_choice="none")["tool_choice"] == "none"
    assert make_llm()._prepare_chat_with_tools([tool], user_msg="hi")["tool_choice"] == "auto"


def test_tool_defaults_on_the_llm_leave_calls_without_tools_alone():
    """``additional_kwargs`` tool options are defaults for tool turns and templated calls: a
    completion, a formatted prompt and a structured program answer as on an LLM without
    them. They raised ConstraintError ("tool_choice='required' needs tools") or TypeError
    ("tools need a chat"), and an LLM-level tool list leaked into structured programs."""
    tools = [FunctionTool.from_defaults(add).metadata.to_openai_tool()]
    plain = make_llm()
    raw = plain.engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                     add_generation_prompt=True)
    prompt = PromptTemplate("Describe a person called {name}.")
    expected = (plain.complete("Hi").text, plain.complete(raw, formatted=True).text,
                plain.structured_predict(Person, prompt, name="Ann"))
    for extra in ({"tool_choice": "required"}, {"tools": tools}, {"tools": tools, "tool_choice": "add"}):
        llm = make_llm(additional_kwargs=extra)
        got = (llm.complete("Hi").text if "tools" not in extra else expected[0],
               llm.complete(raw, formatted=True).text, llm.structured_predict(Person, prompt, name="Ann"))
        assert got == expected, extra
    # ... and still the default where tools are given.
    forced = make_llm(additional_kwargs={"tool_choice": "required"}, max_tokens=40).chat_with_tools(
        [FunctionTool.from_defaults(add)], user_msg="hi")
    assert forced.message.additional_kwargs["tool_calls"]


def _wait_idle(engine: Engine) -> int:
    for _ in range(100):
        if engine.stats()["running"] == 0:
            break
        time.sleep(0.05)
    return engine.stats()["running"]


def test_timeout_cancels_and_frees_the_slot():
    llm = make_llm(max_tokens=4000, timeout=0.05)
    with pytest.raises(TimeoutError):
        llm.chat(user("go on for a long time"))
    with pytest.raises(TimeoutError):
        list(llm.stream_complete("go on for a long time"))
    with pytest.raises(TimeoutError):
        asyncio.run(llm.achat(user("go on for a long time")))
    assert _wait_idle(llm.engine) == 0


def test_leaving_a_stream_early_frees_the_slot():
    llm = make_llm(max_tokens=4000)
    gen = llm.stream_chat(user("go on"))
    next(gen)
    assert llm.engine.stats()["running"] == 1
    gen.close()
    assert _wait_idle(llm.engine) == 0


@pytest.mark.parametrize("value", [1, 0, 2.0])
def test_mtp_takes_no_coerced_values(value):
    """The field took 1 as True (pydantic's lax mode) where a call's ``mtp=1`` is refused."""
    with pytest.raises(ValueError):
        MLXTandemLLM(mtp=value)


class Price(BaseModel):
    """A price."""

    amount: Decimal
    currency: str


class PayArgs(BaseModel):  # this module's annotations are strings, which core cannot resolve
    price: Price


def pay(price: Price) -> str:
    """Pay a price."""
    return "paid"


def test_a_decimal_is_held_to_what_a_decimal_takes():
    """Pydantic writes a Decimal as a number or any string: held to that, sampled answers
    wrote ``"amount": "<any text>"`` and failed their own model. The engine's schema holds
    the string branch to a decimal's pattern, for structured output and for a tool."""
    prompt = PromptTemplate("Give a price.")
    outs = [make_llm(max_tokens=60, temperature=1.0, seed=seed).structured_predict(Price, prompt) for seed in range(6)]
    assert all(isinstance(p, Price) for p in outs), outs

    tool = FunctionTool.from_defaults(fn=pay, fn_schema=PayArgs)
    for seed in range(4):
        llm = make_llm(max_tokens=60, temperature=1.0, seed=seed)
        response = llm.chat_with_tools([tool], user_msg="pay", tool_required=True)
        (call,) = llm.get_tool_calls_from_response(response)
        Price.model_validate(call.tool_kwargs["price"])


class Tree(BaseModel):
    v: int
    kids: list["Tree"] = []


def plant(**kwargs) -> str:
    """Plant a tree."""
    return "planted"


def test_a_recursive_tool_schema_keeps_its_ref():
    """A recursive model is a "$ref" to its own "$defs" entry; core's ``to_openai_tool``
    keeps the "$defs" and drops the "$ref", a schema of any JSON: a forced call's arguments
    came back ``0.0`` or ``true``, an invalid call (a fuzz, 2026-11-30)."""
    tool = FunctionTool.from_defaults(fn=plant, name="plant", fn_schema=Tree)
    assert "$ref" not in tool.metadata.to_openai_tool()["function"]["parameters"]
    for seed in range(3):
        llm = make_llm(max_tokens=60, temperature=1.0, seed=seed)
        response = llm.chat_with_tools([tool], user_msg="plant", tool_required=True)
        (call,) = llm.get_tool_calls_from_response(response)
        Tree.model_validate(call.tool_kwargs)
        assert not response.message.additional_kwargs.get("invalid_tool_calls")


def test_a_relative_model_path_is_fixed_when_the_adapter_is_made(tmp_path, monkeypatch):
    from ..adapter_checks import relative_model_path_is_fixed_at_construction

    relative_model_path_is_fixed_at_construction(MLXTandemLLM, PATHS, tmp_path, monkeypatch)
