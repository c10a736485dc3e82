"""Message normalization: strict templates accept real clients' histories, nothing is lost."""

from __future__ import annotations

import copy
import datetime
import re

import pytest

from mlx_tandem import InvalidRequestError, SamplingParams, normalize_messages
from mlx_tandem.errors import TemplateError
from mlx_tandem.messages import hoisted_order

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


def test_tool_messages_are_never_merged_and_calls_merge_with_their_ids():
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
    assert [c["id"] for c in out[1]["tool_calls"]] == ["call_1", "call_2"]  # one turn, both calls
    assert [m.get("tool_call_id") for m in out[2:4]] == ["call_1", "call_2"]
    assert out[4] == {"role": "assistant", "content": "Sunny and rainy.\n\nAnything else?"}
    assert len(out) == 5


def test_text_then_calls_is_one_assistant_turn_and_text_after_calls_stays_apart():
    """Responses-style histories (and LangGraph's) give the text and each call their own
    assistant message; Gemma's and Mistral's templates refuse two assistant turns in a row."""
    later = {"role": "assistant", "content": "Done."}
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me check.",
                                                "reasoning_content": "R"},
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}, later]
    out = normalize_messages(msgs)
    assert out[1] == {"role": "assistant", "content": "Let me check.", "reasoning_content": "R",
                      "tool_calls": [TOOL_CALL]}
    assert out[2] == later  # templates print a turn's text before its calls: kept apart
    # Text with calls of its own after calls: kept apart too (it would move before them).
    b = {**TOOL_CALL, "id": "call_b"}
    mixed = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
             {"role": "assistant", "content": "Now B.", "tool_calls": [b]}]
    assert [m.get("content") for m in normalize_messages(mixed)[1:]] == ["", "Now B."]
    named = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "name": "x"},
             {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL], "name": "y"}]
    assert len(normalize_messages(named)) == 3


def test_tool_results_follow_the_order_of_their_calls():
    """Clients match results by id, in any order; Qwen-style templates pair them by position."""
    calls = [{**TOOL_CALL, "id": i} for i in ("A", "B", "C")]
    results = [{"role": "tool", "tool_call_id": i, "content": f"r{i}"} for i in ("C", "A", "B")]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls}, *results,
            {"role": "system", "content": "S"}]
    out = normalize_messages(msgs)
    assert [m["tool_call_id"] for m in out[3:]] == ["A", "B", "C"]
    # The images of a conversation are read in the same order (media.load_images).
    assert [i for i, _ in hoisted_order(msgs)] == [5, 0, 1, 3, 4, 2]
    # Ids that do not answer distinct calls of the turn before: left as given.
    odd = msgs[:2] + [results[0], {**results[1], "tool_call_id": "Z"}]
    assert [m["tool_call_id"] for m in normalize_messages(odd)[2:]] == ["C", "Z"]
    unhashable = msgs[:2] + [results[0], {**results[1], "tool_call_id": ["A"]}]
    assert [m["tool_call_id"] for m in normalize_messages(unhashable)[2:]] == ["C", ["A"]]


def test_list_content_merges_keep_every_part_and_input_is_untouched():
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"}, img]},
            {"role": "user", "content": "and this"}]
    before = copy.deepcopy(msgs)
    out = normalize_messages(msgs)
    assert msgs == before
    assert out[0]["content"][1] == img
    assert out[0]["content"][-1] == {"type": "text", "text": "and this"}


@pytest.mark.parametrize("empty", [[], [{"type": "text", "text": ""}]])
def test_empty_part_lists_merge_as_no_content(empty):
    """[] joined with text added a lone separator (a blank line) to the prompt; "" did not."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for msgs in ([{"role": "assistant", "content": "Let me check"},
                  {"role": "assistant", "content": "{}", "tool_calls": calls}],
                 [{"role": "system", "content": "{}"}, {"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": "hi"}]):
        with_empty = [dict(m, content=empty) if m["content"] == "{}" else m for m in msgs]
        with_blank = [dict(m, content="") if m["content"] == "{}" else m for m in msgs]
        assert normalize_messages(with_empty) == normalize_messages(with_blank)


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
    [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}], [{"role": "user", "content": [{"type": {"t": 1}}]}],
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
                                   [{"id": "x", "arguments": {}}],
                                   # arguments the template cannot print as JSON: a set came out
                                   # "<set>" (the adapters refused them already)
                                   [{"function": {"name": "f", "arguments": {"a": {1, 2}}}}],
                                   [{"name": "f", "arguments": {"when": datetime.date(2020, 1, 2)}}]])
def test_malformed_tool_calls_are_typed_errors(calls):
    with pytest.raises(InvalidRequestError):
        normalize_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}])


def test_arguments_holding_an_infinity_go_back_into_the_history():
    """A call the engine read holds an infinity where the model wrote a number past a
    double's range (valid JSON, which the call grammars take): its answer must go back into
    the history, as Python's JSON writes it (a stricter check broke the agent loop)."""
    for value in (float("inf"), float("nan")):
        msgs = normalize_messages([{"role": "user", "content": "hi"},
                                   {"role": "assistant", "tool_calls": [{"name": "f", "arguments": {"x": value}}]}])
        assert msgs[1]["tool_calls"][0]["arguments"]["x"] is value


async def test_hf_style_tool_calls_render_like_openai_style(llama_engine):
    """HF chat templates take a call's name and arguments at its top level too."""
    openai = [{"role": "user", "content": "w?"}, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    hf = copy.deepcopy(openai)
    hf[1]["tool_calls"] = [{"name": TOOL_CALL["function"]["name"], "arguments": {"city": "Paris"}}]
    assert llama_engine.apply_chat_template(hf) == llama_engine.apply_chat_template(openai)


def test_openai_image_parts_reach_the_template_as_image_parts():
    """Templates such as Gemma's render a placeholder only for ``type == "image"``: an
    ``image_url`` part was read as an image but got no placeholder in the prompt."""
    import jinja2

    from mlx_tandem.prompt import _template_ready

    gemma_like = jinja2.Template(
        "{% for m in messages %}{% for p in m.content %}"
        "{% if p.type == 'image' %}<image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
        "{% endfor %}{% endfor %}")
    url = {"url": "data:image/png;base64,AAAA"}
    msgs = [{"role": "user", "content": [{"type": "input_text", "text": "what?"}, {"type": "image_url", "image_url": url},
                                         {"type": "input_image", "image_url": "AAAA"}]}]
    ready = _template_ready(normalize_messages(msgs))
    assert gemma_like.render(messages=ready) == "what?<image><image>"
    assert ready[0]["content"][1] == {"type": "image", "image_url": url}  # the source stays for the loader
    assert msgs[0]["content"][1]["type"] == "image_url"  # the caller's messages are untouched


def test_mistral_templates_get_their_nine_character_call_ids():
    """Mistral's templates raise on any call id that is not 9 letters or digits, so a
    history of the engine's own ``call_...`` ids did not render. With ``short_call_ids`` (the
    engine sets it for mlx-lm's "mistral" tool format) each id is shortened, the same for
    the call and its result; ids already in that form are kept."""
    import jinja2

    from mlx_tandem.prompt import PromptRenderer

    source = (
        "{% for m in messages %}"
        "{% for c in m.tool_calls or [] %}{% if c.id|length != 9 %}{{ raise('Tool call IDs should be "
        "alphanumeric strings with length 9!') }}{% endif %}[CALL {{ c.id }}]{% endfor %}"
        "{% if m.role == 'tool' %}{% if m.tool_call_id|length != 9 %}{{ raise('bad id') }}{% endif %}"
        "[RESULT {{ m.tool_call_id }}: {{ m.content }}]{% else %}{{ m.content }}{% endif %}{% endfor %}")

    class MistralLike:
        def encode(self, text, add_special_tokens=False):
            return [ord(ch) for ch in text]

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
            def fail(msg):
                raise jinja2.TemplateError(msg)

            return jinja2.Environment().from_string(source).render(messages=messages, **{"raise": fail})

    call = lambda i: {"id": i, "type": "function", "function": {"name": "w", "arguments": "{}"}}  # noqa: E731
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call("call_0123456789abcdef01234567"), call("a1B2c3D4e")]},
            {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "r1"},
            {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "r2"}]
    with pytest.raises(TemplateError, match="length 9"):
        PromptRenderer(MistralLike()).render_with_text(msgs)
    text, _ = PromptRenderer(MistralLike(), short_call_ids=True).render_with_text(msgs)
    short = re.findall(r"\[CALL (\w+)\]", text)
    assert len(short[0]) == 9 and short[0].isalnum() and short[1] == "a1B2c3D4e"
    assert re.findall(r"\[RESULT (\w+):", text) == short  # each result still names its call


class _JinjaTokenizer:
    """A tokenizer stand-in that renders ``source`` (a chat template written for a test)."""

    def __init__(self, source: str):
        import jinja2

        def fail(msg):
            raise jinja2.TemplateError(msg)

        self._template = jinja2.Environment().from_string(source)
        self._raise = fail

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{"raise": self._raise})


# Llama 3.1's way with calls: a call turn prints its one call and nothing else, and two
# calls in one turn raise. (Written for this test, after the behaviour of Meta's template.)
CALLS_ONLY = (
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% if m.tool_calls|length != 1 %}{{ raise('only single tool-calls at once') }}{% endif %}"
    "CALL {{ m.tool_calls[0].function.name }}{% else %}{{ m.content }}{% endif %}{% endfor %}")
# Mistral v3's: only user turns and assistant turns without calls must alternate, and a
# call turn prints only its calls.
ALTERNATING = (
    "{% set ns = namespace(i=0) %}{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "{% if (m.role == 'user') != (ns.i % 2 == 0) %}{{ raise('roles must alternate') }}{% endif %}"
    "{% set ns.i = ns.i + 1 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
# Qwen's: a call turn prints its text, then each of its calls.
TEXT_AND_CALLS = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}"
    "{% endfor %}{% endfor %}")


def _call(i: int, name: str) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}


@pytest.mark.parametrize("source,turns", [
    (CALLS_ONLY, (False, False)), (ALTERNATING, (False, True)), (TEXT_AND_CALLS, (True, True)),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", (True, True)),  # no calls at all: merges stay on
])
def test_text_and_calls_merge_only_where_the_template_renders_the_turn_whole(source, turns):
    """Responses-style and LangGraph histories give an assistant's text and each call their
    own message. Merged into one turn, Llama 3.1's template dropped the text and raised on
    two calls, and Mistral v3's refused the history (it counts only text turns when it
    checks that roles alternate). The renderer finds out what the template does with a call
    turn, and merges only where the turn renders whole; the history as given renders."""
    from mlx_tandem.prompt import PromptRenderer

    renderer = PromptRenderer(_JinjaTokenizer(source))
    assert (renderer.call_turns.text, renderer.call_turns.several) == turns
    history = [{"role": "user", "content": "Weather in Paris and Rome?"},
               {"role": "assistant", "content": "Let me check."},
               {"role": "assistant", "content": None, "tool_calls": [_call(1, "weather_paris")]},
               {"role": "assistant", "content": None, "tool_calls": [_call(2, "weather_rome")]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
               {"role": "assistant", "content": "Sunny, and rain."},
               {"role": "user", "content": "thanks"}]
    if "CALL" not in source:
        return
    # The history as a client sends it mid-loop (the answer still to come): nothing is lost,
    # the text and both calls are in the prompt.
    mid_loop = history[:6]
    text, _ = renderer.render_with_text(mid_loop)
    assert "Let me check." in text and "CALL weather_paris" in text and "CALL weather_rome" in text
    merged = normalize_messages(mid_loop, renderer.call_turns)
    assert len([m for m in merged if m["role"] == "assistant"]) == {
        (True, True): 1, (False, True): 2, (False, False): 3}[turns]
    # With the answer after the results, Mistral v3's check sees two text turns in a row:
    # kept apart the history would raise, so it is merged as that template's design wants
    # (it prints a call turn's calls only).
    text, _ = renderer.render_with_text(history)
    assert "CALL weather_paris" in text and "CALL weather_rome" in text and "Sunny, and rain." in text
    assert ("Let me check." in text) == (source is not ALTERNATING)


def test_hoisted_system_messages_keep_the_fields_they_share():
    """The merged system message was built from role and content only: a ``name`` every
    system message carried was lost. Fields they disagree on cannot be kept."""
    same = normalize_messages([{"role": "system", "name": "policy", "content": "a"}, {"role": "user", "content": "q"},
                               {"role": "developer", "name": "policy", "content": "b"}])
    assert same[0] == {"role": "system", "name": "policy", "content": "a\n\nb"}
    differ = normalize_messages([{"role": "system", "name": "policy", "content": "a"},
                                 {"role": "system", "name": "other", "content": "b"}, {"role": "user", "content": "q"}])
    assert differ[0] == {"role": "system", "content": "a\n\nb"}


def test_the_continued_message_follows_the_history_the_prompt_rendered():
    """Where the history kept apart breaks the template (Mistral v3 style) the prompt is
    rendered merged; the continued message (and the cache points, given the same ``turns``)
    read the history the same way (they normalized it apart: the continued text ran from
    the call on, and a "<think>" in a tool result then read the answer as reasoning)."""
    from mlx_tandem.messages import CallTurns
    from mlx_tandem.prompt import PromptRenderer

    renderer = PromptRenderer(_JinjaTokenizer(ALTERNATING))
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "Let me check."},
               {"role": "assistant", "content": None, "tool_calls": [_call(1, "weather_paris")]},
               {"role": "tool", "tool_call_id": "call_1", "content": "docs mention <think> tags"},
               {"role": "assistant", "content": "Sunny"}]
    kwargs = {"continue_final_message": True}
    text, _, turns = renderer.render_chat(history, template_kwargs=kwargs)
    assert turns == CallTurns() and text.endswith("Sunny")  # merged: the default
    # This template writes no generation prompt: the continued part is the final turn.
    assert renderer.continued_text(history, text, template_kwargs=kwargs, turns=turns) == "<assistant>Sunny"


@pytest.mark.parametrize("source,assistant_turns", [(CALLS_ONLY, 3), (ALTERNATING, 2), (TEXT_AND_CALLS, 1)])
def test_one_message_with_text_and_calls_is_split_where_the_template_cannot_print_it_whole(source, assistant_turns):
    """LangChain's AIMessage carries an assistant's text and its calls in one message. A
    template that prints only a call turn's one call (Llama 3.1 style) dropped the text and
    raised on two calls, as transformers does; split into turns it can print, nothing is
    lost. The results follow the calls' order across the split turns."""
    from mlx_tandem.prompt import PromptRenderer

    renderer = PromptRenderer(_JinjaTokenizer(source))
    several = [_call(1, "weather_paris"), _call(2, "weather_rome")] if source is not ALTERNATING else \
        [_call(1, "weather_paris")]
    history = [{"role": "user", "content": "Weather in Paris and Rome?"},
               {"role": "assistant", "content": "Let me check.", "tool_calls": several},
               *({"role": "tool", "tool_call_id": c["id"], "content": c["function"]["name"]} for c in reversed(several))]
    text, _ = renderer.render_with_text(history)
    assert "Let me check." in text and all(f"CALL {c['function']['name']}" in text for c in several)
    merged = normalize_messages(history, renderer.call_turns)
    assert len([m for m in merged if m["role"] == "assistant"]) == assistant_turns
    assert [m["tool_call_id"] for m in merged if m["role"] == "tool"] == [c["id"] for c in several]
    # Each caller's message once (the split turns share one), the results in call order.
    assert [i for i, _ in hoisted_order(history, renderer.call_turns)] == [0, 1, *range(1 + len(several), 1, -1)]
    # One call a turn: each result follows its own call, as such a model calls tools in turn.
    steps = [m.get("tool_call_id") or m["tool_calls"][0]["id"] for m in merged if m.get("tool_calls") or
             m["role"] == "tool"]
    assert steps == {3: ["call_1", "call_1", "call_2", "call_2"], 2: ["call_1", "call_1"],
                     1: ["call_1", "call_1", "call_2"]}[assistant_turns]
    if assistant_turns == 3:
        assert text.index("<tool>weather_paris") < text.index("CALL weather_rome")


def test_results_follow_their_calls_one_by_one_only_where_the_template_takes_one_call_a_turn():
    """Two call turns kept apart for another reason (a differing ``name``) on a template
    that takes several calls a turn: the results are reordered, never interleaved."""
    from mlx_tandem.messages import CallTurns

    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "", "name": "a", "tool_calls": [_call(1, "f")]},
               {"role": "assistant", "content": "", "name": "b", "tool_calls": [_call(2, "g")]},
               {"role": "tool", "tool_call_id": "call_2", "content": "r2"},
               {"role": "tool", "tool_call_id": "call_1", "content": "r1"}]
    steps = {}
    for turns in (CallTurns(), CallTurns(text=True, several=False)):
        out = normalize_messages(history, turns)
        steps[turns.several] = [m.get("tool_call_id") or m["tool_calls"][0]["id"] for m in out[1:]]
    assert steps[True] == ["call_1", "call_2", "call_1", "call_2"]  # calls, then results in order
    assert steps[False] == ["call_1", "call_1", "call_2", "call_2"]  # each result after its call
