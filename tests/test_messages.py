"""Message normalization: strict templates accept real clients' histories, nothing is lost."""

from __future__ import annotations

import copy

import pytest

from mlx_tandem import InvalidRequestError, SamplingParams, normalize_messages
from mlx_tandem.errors import TemplateError

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_opencode_style_system_system_user_user():
    msgs = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
            {"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}]
    assert normalize_messages(msgs) == [{"role": "system", "content": "A\n\nB"},
                                        {"role": "user", "content": "u1\n\nu2"}]


def test_developer_becomes_system_and_merges_with_system():
    msgs = [{"role": "developer", "content": "D"}, {"role": "system", "content": "S"},
            {"role": "user", "content": "hi"}]
    assert normalize_messages(msgs) == [{"role": "system", "content": "D\n\nS"},
                                        {"role": "user", "content": "hi"}]


def test_system_messages_mid_conversation_are_hoisted():
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "system", "content": "late rule"}, {"role": "user", "content": "q2"}]
    out = normalize_messages(msgs)
    assert out[0] == {"role": "system", "content": "late rule"}
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]


def test_tool_messages_and_tool_calls_are_never_merged_or_dropped():
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "assistant", "content": "", "tool_calls": [{**TOOL_CALL, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
        {"role": "assistant", "content": "Sunny and rainy."},
        {"role": "assistant", "content": "Anything else?"},
    ]
    out = normalize_messages(msgs)
    assert out[1]["tool_calls"][0]["id"] == "call_1"
    assert out[2]["tool_calls"][0]["id"] == "call_2"
    assert [m.get("tool_call_id") for m in out[3:5]] == ["call_1", "call_2"]
    assert out[5] == {"role": "assistant", "content": "Sunny and rainy.\n\nAnything else?"}
    assert len(out) == 6


def test_list_content_merges_keep_every_part_and_input_is_untouched():
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"}, img]},
            {"role": "user", "content": "and this"}]
    before = copy.deepcopy(msgs)
    out = normalize_messages(msgs)
    assert msgs == before
    assert out[0]["content"][1] == img
    assert out[0]["content"][-1] == {"type": "text", "text": "and this"}


def test_image_payloads_that_cannot_be_deep_copied_are_kept_as_given():
    """The structure is copied (the caller's messages stay as they were); payloads are not:
    a memoryview cannot be deep-copied, and copying a PIL image or bytes would be waste."""
    payload = memoryview(b"\x89PNG fake bytes")
    msgs = [{"role": "user", "content": [{"type": "image", "image": payload}]},
            {"role": "user", "content": [{"type": "text", "text": "and this?"}]},
            {"role": "system", "content": "Be brief."}]
    before = copy.copy(msgs)
    out = normalize_messages(msgs)
    assert [m["role"] for m in out] == ["system", "user"]
    assert out[1]["content"][0]["image"] is payload
    assert out[1]["content"] is not msgs[0]["content"] and msgs == before
    assert len(msgs[0]["content"]) == 1


def test_merged_assistant_messages_keep_every_reasoning_and_other_fields_stay_apart():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a1", "reasoning_content": "R1"},
            {"role": "assistant", "content": "a2", "reasoning_content": "R2"},
            {"role": "user", "content": "q2", "cache_hint": 1},
            {"role": "user", "content": "q3", "cache_hint": 2}]
    out = normalize_messages(msgs)
    assert out[1] == {"role": "assistant", "content": "a1\n\na2", "reasoning_content": "R1\n\nR2"}
    assert [m["content"] for m in out[2:]] == ["q2", "q3"]  # a field a merge cannot join: kept apart


def test_different_names_are_not_merged():
    msgs = [{"role": "user", "name": "alice", "content": "a"}, {"role": "user", "name": "bob", "content": "b"}]
    assert len(normalize_messages(msgs)) == 2


@pytest.mark.parametrize("bad", [
    [], "hello", [{"role": "wizard", "content": "x"}], [{"content": "no role"}],
    [{"role": "user", "content": 42}], [{"role": "tool", "content": "no id"}],
    [{"role": "user", "content": [{"text": "no type"}]}],
])
def test_malformed_messages_are_typed_errors(bad):
    with pytest.raises(InvalidRequestError):
        normalize_messages(bad)


async def test_engine_renders_what_the_raw_template_rejects(llama_engine):
    msgs = [{"role": "user", "content": "q1"}, {"role": "system", "content": "rule"},
            {"role": "developer", "content": "dev"}, {"role": "user", "content": "q2"}]
    # The template itself insists on system-first (like Qwen's) ...
    with pytest.raises(Exception):
        llama_engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # ... the engine normalizes first, and renders exactly the normalized conversation.
    expected = llama_engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "rule\n\ndev"}, {"role": "user", "content": "q1\n\nq2"}],
        add_generation_prompt=True)
    assert llama_engine.apply_chat_template(msgs) == list(expected)
    out = await llama_engine.chat(msgs, SamplingParams(max_tokens=3))
    assert out.prompt_token_ids == list(expected)


async def test_openai_tool_call_arguments_render_like_dicts(llama_engine):
    as_string = [{"role": "user", "content": "w?"}, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    as_dict = copy.deepcopy(as_string)
    as_dict[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert llama_engine.apply_chat_template(as_string) == llama_engine.apply_chat_template(as_dict)


async def test_template_failure_is_a_typed_error(llama_engine):
    with pytest.raises(TemplateError):  # the template iterates over "tools"
        await llama_engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                                template_kwargs={"tools": 5})


@pytest.mark.parametrize("calls", ["nope", [1], [{"id": "x", "function": "f"}], [{"function": {"name": None}}],
                                   [{"id": "x", "arguments": {}}]])
def test_malformed_tool_calls_are_typed_errors(calls):
    with pytest.raises(InvalidRequestError):
        normalize_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}])


async def test_hf_style_tool_calls_render_like_openai_style(llama_engine):
    """HF chat templates take a call's name and arguments at its top level too."""
    openai = [{"role": "user", "content": "w?"}, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    hf = copy.deepcopy(openai)
    hf[1]["tool_calls"] = [{"name": TOOL_CALL["function"]["name"], "arguments": {"city": "Paris"}}]
    assert llama_engine.apply_chat_template(hf) == llama_engine.apply_chat_template(openai)
