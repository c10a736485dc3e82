"""The Engine facade: sharing, lifecycle, stats."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

from mlx_tandem import Engine, InvalidRequestError, RequestTimeoutError, SamplingParams, TandemError

from .prompts import chat_prompts


def test_shared_engine_per_model_and_options(llama_path, qwen3_5_path):
    a = Engine.shared(llama_path, show_progress=False)
    b = Engine.shared(str(llama_path), show_progress=False)
    c = Engine.shared(llama_path, show_progress=False, max_batch_size=4)
    d = Engine.shared(qwen3_5_path, show_progress=False)
    try:
        assert a is b
        assert a is not c and a is not d
        # A draft's path is part of the options, in any spelling of the same directory.
        drafted = [Engine.shared(llama_path, show_progress=False, specprefill_draft=p)
                   for p in (qwen3_5_path, str(qwen3_5_path) + "/", qwen3_5_path.parent / "." / qwen3_5_path.name)]
        assert drafted[0] is drafted[1] is drafted[2] and drafted[0] is not a
        drafted[0].close_sync()
        # A display option makes no second engine (and no second copy of the weights).
        assert Engine.shared(llama_path) is a
        a.close_sync()
        assert Engine.shared(llama_path, show_progress=False) is not a
    finally:
        for e in (a, c, d, Engine.shared(llama_path, show_progress=False)):
            e.close_sync()


def test_the_default_models_reported_name_can_be_passed_back(tmp_path, monkeypatch):
    """``model_name`` and usage metadata report the default model by its name; given back as
    ``model`` it is the default (it was a hub id that does not exist). A directory of that
    name still wins."""
    from mlx_tandem.default_model import DEFAULT_MODEL_NAME

    default = Engine.shared(show_progress=False)
    try:
        assert Engine.shared(DEFAULT_MODEL_NAME, show_progress=False) is default
        # So is the directory model_info() reports (a second engine loaded the weights again).
        assert Engine.shared(default.model_info().path, show_progress=False) is default
        named = Engine(DEFAULT_MODEL_NAME, show_progress=False)
        try:
            msgs = [{"role": "user", "content": "Hi"}]
            assert named.chat_sync(msgs, {"max_tokens": 6}).token_ids == \
                default.chat_sync(msgs, {"max_tokens": 6}).token_ids
            assert named.model_info().name == DEFAULT_MODEL_NAME
        finally:
            named.close_sync()
    finally:
        default.close_sync()
    (tmp_path / DEFAULT_MODEL_NAME).mkdir()
    monkeypatch.chdir(tmp_path)
    assert Engine(DEFAULT_MODEL_NAME)._model_arg == str((tmp_path / DEFAULT_MODEL_NAME).resolve())  # the directory


def test_construction_is_cheap(llama_path):
    engine = Engine(llama_path)
    assert engine.stats()["loaded"] is False and engine._core is None
    engine.close_sync()


def test_stats_name_the_model_say_when_it_is_loaded_and_are_the_readers_own(llama_path):
    """Review h156: the default model read "None" until it loaded; a closed engine read
    loaded; and a snapshot shared its memory rows with the engine (and, before load, with
    every other engine), so a reader that edited its copy changed the next one."""
    from mlx_tandem.default_model import DEFAULT_MODEL_NAME

    default, engine = Engine(), Engine(llama_path, show_progress=False)
    try:
        assert default.stats()["model"] == DEFAULT_MODEL_NAME and not default.stats()["loaded"]
        before = engine.stats()
        before["memory"]["rows"]["text"] = {"kv_bytes_per_token": -1}
        assert default.stats()["memory"]["rows"] == {} and engine.stats()["memory"]["rows"] == {}
        engine.start_sync()
        engine.chat_sync([{"role": "user", "content": "Hi"}], {"max_tokens": 3})
        snapshot = engine.stats()
        assert snapshot["loaded"] and snapshot["model"] == str(Path(llama_path).resolve())
        want = copy.deepcopy(snapshot)
        for section in ("memory", "prefix_cache", "specprefill", "mtp"):
            for value in snapshot[section].values():
                if isinstance(value, dict):
                    value.clear()
            snapshot[section].clear()
        fresh = engine.stats()
        assert {k: fresh[k] for k in ("memory", "prefix_cache", "specprefill", "mtp")} == \
            {k: want[k] for k in ("memory", "prefix_cache", "specprefill", "mtp")}
        engine.close_sync()
        assert engine.stats()["loaded"] is False
    finally:
        default.close_sync()
        engine.close_sync()


async def test_stats_count_what_happened(llama_path):
    async with Engine(llama_path, show_progress=False, max_batch_size=4) as engine:
        outs = await asyncio.gather(*[engine.chat(p, SamplingParams(max_tokens=9)) for p in chat_prompts(10)])
        s = engine.stats()
        assert s["requests"] == s["finished"] == 10
        assert s["running"] == 0 and s["waiting"] == 0
        assert s["max_batch_size"] == 4  # the option caps the batch; the rest waited
        assert s["prompt_tokens"] == sum(o.usage.prompt_tokens for o in outs)
        assert s["generation_tokens"] == sum(o.usage.completion_tokens for o in outs)
        assert s["generation_tokens_per_s"] > 0 and s["prompt_tokens_per_s"] > 0
        assert all(o.time_to_first_token is not None and o.latency >= o.time_to_first_token for o in outs)


async def test_read_only_mappings_are_taken_as_messages_and_params(llama_engine):
    """The chat methods are typed for mappings (so a TypedDict history type-checks); a
    read-only mapping must then work as the dict it reads as, not be refused."""
    from types import MappingProxyType

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    params = {"max_tokens": 8, "stop": ["zz"]}
    ref = await llama_engine.chat(messages, params)
    out = await llama_engine.chat([MappingProxyType(m) for m in messages], MappingProxyType(params))
    assert out.token_ids == ref.token_ids and out.text == ref.text
    assert messages[0] == {"role": "system", "content": "Be brief."}  # the caller's dicts unchanged


async def test_template_kwargs_reach_the_template(llama_engine):
    msgs = [{"role": "user", "content": "hi"}]
    on = llama_engine.apply_chat_template(msgs, template_kwargs={"enable_thinking": True})
    off = llama_engine.apply_chat_template(msgs, template_kwargs={"enable_thinking": False})
    assert llama_engine.tokenizer.decode(off).endswith("<think>\n\n</think>\n\n")
    assert off[: len(on)] == on and len(off) > len(on)


async def test_reasoning_none_keeps_the_templates_own_thinking_default(llama_engine, llama_path, tmp_path):
    """``reasoning=None`` renders the template's default. mlx-lm's wrapper passed
    ``enable_thinking=True`` to every template that knows ``<think>``, so one that thinks
    only when asked (Qwen3.5's) thought anyway, and a small model's answer went to its
    reasoning. A template that thinks by default still does."""
    import shutil

    from mlx_tandem.testing.chat_template import CHAT_TEMPLATE

    msgs = [{"role": "user", "content": "hi"}]
    # The factory template thinks unless told not to: None is the same as True there.
    assert llama_engine.apply_chat_template(msgs) == llama_engine.apply_chat_template(msgs, reasoning=True)
    default_on = "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    asked = ("{%- if enable_thinking is defined and enable_thinking is true -%}{{- '<think>\\n' -}}"
             "{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}")
    assert CHAT_TEMPLATE.count(default_on) == 1, "the factory template changed"
    path = shutil.copytree(llama_path, tmp_path / "asked")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE.replace(default_on, asked)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(config["chat_template"])
    async with Engine(path, show_progress=False) as engine:
        text = {r: engine.tokenizer.decode(engine.apply_chat_template(msgs, reasoning=r)) for r in (None, True, False)}
        assert text[None].endswith("assistant\n<think>\n\n</think>\n\n"), text[None]
        assert text[False] == text[None]
        assert text[True].endswith("assistant\n<think>\n"), text[True]
        out = await engine.chat(msgs, SamplingParams(max_tokens=4))
        assert out.prompt_token_ids == engine.apply_chat_template(msgs)
        # A constrained request renders thinking off by default, as before.
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        assert engine.apply_chat_template(msgs, response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": schema}}) == engine.apply_chat_template(msgs)


async def test_apply_chat_template_gives_the_prompt_a_request_with_the_same_options_runs(qwen3_5_engine):
    """``apply_chat_template`` and a request render through one path (RequestBuilder.render_chat):
    for each mix of tools, tool_choice, response_format, reasoning and parallel_tool_calls
    (which turn thinking off, drop the tools from the prompt, ...) the ids are the ones the
    request ran on."""
    engine = qwen3_5_engine
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Oslo?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    mixes = [{}, {"reasoning": True}, {"reasoning": False}, {"response_format": schema},
             {"tools": tools}, {"tools": tools, "tool_choice": "none"}, {"tools": tools, "tool_choice": "required"},
             {"tools": tools, "tool_choice": "get_weather", "parallel_tool_calls": True},
             {"tools": tools, "response_format": schema, "reasoning": False}]
    prompts = set()
    for options in mixes:
        out = await engine.chat(msgs, SamplingParams(max_tokens=1), **options)
        assert out.prompt_token_ids == engine.apply_chat_template(msgs, **options), options
        prompts.add(tuple(out.prompt_token_ids))
    assert len(prompts) >= 4  # the options do shape the prompt: the comparison can fail
    with pytest.raises(InvalidRequestError, match="parallel_tool_calls"):
        engine.apply_chat_template(msgs, tools=tools, parallel_tool_calls="yes")


async def test_a_final_assistant_message_is_continued_only_when_asked(llama_engine, llama_path):
    """By default a final assistant message is history and a new turn follows (OpenAI); with
    continue_final_message (transformers, vLLM) the answer goes on inside it."""
    from .reference import reference_greedy

    msgs = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}]
    cont = {"continue_final_message": True}
    closed = llama_engine.tokenizer.decode(llama_engine.apply_chat_template(msgs))
    opened_ids = llama_engine.apply_chat_template(msgs, template_kwargs=cont)
    opened = llama_engine.tokenizer.decode(opened_ids)
    assert closed.endswith("one two<|im_end|>\n<|im_start|>assistant\n")
    assert opened.endswith("one two") and closed.startswith(opened)
    out = await llama_engine.chat(msgs, SamplingParams(max_tokens=6), template_kwargs=cont)
    assert out.prompt_token_ids == opened_ids
    assert out.token_ids == reference_greedy(llama_path, opened_ids, 6)
    with pytest.raises(InvalidRequestError, match="ends with an assistant"):
        await llama_engine.chat(msgs[:1], SamplingParams(max_tokens=2), template_kwargs=cont)


async def test_tools_reach_the_template(llama_engine):
    tools = [{"type": "function", "function": {"name": "lookup_capital", "description": "capital of a country",
                                               "parameters": {"type": "object", "properties": {"country": {"type": "string"}}}}}]
    ids = llama_engine.apply_chat_template([{"role": "user", "content": "capital of France?"}], tools=tools)
    text = llama_engine.tokenizer.decode(ids)
    assert "lookup_capital" in text and "<tools>" in text
    out = await llama_engine.chat([{"role": "user", "content": "capital of France?"}], SamplingParams(max_tokens=3), tools=tools)
    assert out.prompt_token_ids == ids


def test_model_info_reads_the_checkpoint_without_loading(qwen3_5_path, qwen3_5_engine):
    import json

    engine = Engine(qwen3_5_path, show_progress=False, max_model_len=1024)
    info = engine.model_info()
    assert engine._core is None  # nothing loaded, no owner thread started
    cfg = json.loads((qwen3_5_path / "config.json").read_text())
    assert info.model_type == cfg["model_type"]
    assert info.context_length == 1024 and info.default_max_tokens == SamplingParams().max_tokens
    # The file heuristics agree with the loaded tokenizer's inference.
    loaded = qwen3_5_engine.model_info()
    assert (info.supports_tools, info.supports_reasoning) == (loaded.supports_tools, loaded.supports_reasoning)
    assert loaded.context_length == qwen3_5_engine.context_length
    assert Engine("/no/such/model").model_info(load=False) is None
    engine.close_sync()


def test_model_info_without_loading_never_raises_a_failed_loads_error():
    """load=False answers None for a model not on disk, also after its load failed (it
    re-raised the load's error, a long chained traceback)."""
    from mlx_tandem.errors import ModelLoadError

    engine = Engine("/no/such/model", show_progress=False)
    with pytest.raises(ModelLoadError):
        engine.chat_sync([{"role": "user", "content": "hi"}])
    assert engine.model_info(load=False) is None
    with pytest.raises(ModelLoadError):
        engine.model_info()
    engine.close_sync()


def test_operator_warnings_say_what_to_do(llama_path, caplog):
    """A budget set too small says to raise it (not to set it); a long prompt's only
    message is the engine's ContextLengthError, not transformers' warning of indexing
    errors that never come."""
    import logging

    from mlx_tandem import ContextLengthError

    with caplog.at_level(logging.WARNING):
        engine = Engine(llama_path, show_progress=False, request_memory_bytes=1000).start_sync()
        engine.close_sync()
        engine = Engine(llama_path, show_progress=False).start_sync()
        try:
            with pytest.raises(ContextLengthError):
                engine.complete_sync("word " * (engine.context_length + 10))
        finally:
            engine.close_sync()
    text = caplog.text
    assert "cannot hold one row's cache" in text and "raise request_memory_bytes" in text
    assert "indexing errors" not in text and "sequence length is longer" not in text


def _keys(tree: dict, prefix: str = "") -> set[str]:
    """Every key path of nested stats, except inside per-lane / per-row tables (data, not schema)."""
    out = set()
    for k, v in tree.items():
        out.add(prefix + k)
        if isinstance(v, dict) and k not in ("rows", "lanes", "lane_requests"):
            out |= _keys(v, prefix + k + ".")
    return out


def test_stats_have_every_key_before_the_first_request(llama_path, llama_engine):
    llama_engine.complete_sync("warm", SamplingParams(max_tokens=2))
    fresh = Engine(llama_path)
    assert _keys(fresh.stats()) == _keys(llama_engine.stats())
    assert fresh.stats()["requests"] == 0
    fresh.start_sync()  # the configured prefix-cache budget shows before any request
    assert fresh.stats()["prefix_cache"]["budget_bytes"] == fresh.options.prefix_cache_bytes > 0
    fresh.close_sync()


async def test_stream_deadlines_cancel_and_free_the_slot(llama_engine):
    msgs = [{"role": "user", "content": "go on"}]
    before = llama_engine.stats()
    for open_stream in (lambda: llama_engine.open_chat_stream(msgs, {"max_tokens": 4000}, timeout=0.05),
                        lambda: llama_engine.open_complete_stream("go on", {"max_tokens": 4000}, timeout=0.05)):
        stream = await open_stream()
        with pytest.raises(RequestTimeoutError):
            await stream.collect()
    sync = llama_engine.open_complete_stream_sync("go on", {"max_tokens": 4000}, timeout=0.05)
    with pytest.raises(RequestTimeoutError):
        sync.collect()
    assert issubclass(RequestTimeoutError, TandemError) and issubclass(RequestTimeoutError, TimeoutError)
    for _ in range(100):
        if llama_engine.stats()["running"] == 0:
            break
        await asyncio.sleep(0.05)
    after = llama_engine.stats()
    assert after["running"] == 0
    # A timeout counts as failed whether the reader's deadline or the engine's noticed it
    # first (a reader's deadline counted it aborted until 2026-11-28).
    assert (after["failed"] - before["failed"], after["aborted"] - before["aborted"]) == (3, 0)
    # A deadline that is not reached changes nothing.
    ref = await llama_engine.chat(msgs, {"max_tokens": 8})
    stream = await llama_engine.open_chat_stream(msgs, {"max_tokens": 8}, timeout=60)
    assert (await stream.collect()).text == ref.text


def test_a_reader_timed_out_during_the_last_step_counts_failed(llama_path):
    """The reader's deadline passed while the engine ran the step that finished the
    request: the caller got RequestTimeoutError, and stats() counted the request finished."""
    import threading
    import time

    release, calls = threading.Event(), []

    def blocks(tokens, logits):
        # The first call samples the only token; the second runs in the step that emits it
        # (mlx-lm computes the next token before it yields this one): that step waits.
        calls.append(len(calls))
        if len(calls) > 1:
            release.wait(30)
        return logits

    engine = Engine(llama_path, show_progress=False, prefix_cache_bytes=0).start_sync()
    try:
        before = engine.stats()
        stream = engine.open_complete_stream_sync("go on", SamplingParams(max_tokens=1, logits_processors=[blocks]),
                                                  timeout=0.3)
        with pytest.raises(RequestTimeoutError):
            stream.collect()
        release.set()
        deadline = time.monotonic() + 30
        while engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        engine.run_on_owner_thread(lambda: None)  # the reader's command is handled by then
        after = engine.stats()
        assert {k: after[k] - before[k] for k in ("requests", "finished", "failed", "aborted")} == {
            "requests": 1, "finished": 0, "failed": 1, "aborted": 0}
    finally:
        release.set()
        engine.close_sync()


async def test_output_that_arrived_in_time_is_read_after_the_deadline(llama_engine):
    """A deadline cancels a request still running at it. One that finished in time gives
    its output however late it is read, async as sync (asyncio.wait_for with no time left
    cancelled the queue's get even with the whole answer queued)."""
    msgs = [{"role": "user", "content": "go on"}]
    ref = await llama_engine.chat(msgs, {"max_tokens": 6})
    streams = [await llama_engine.open_chat_stream(msgs, {"max_tokens": 6}, timeout=0.5),
               await llama_engine.open_chat_stream(msgs, {"max_tokens": 6}, timeout=0.5)]
    sync = llama_engine.open_chat_stream_sync(msgs, {"max_tokens": 6}, timeout=0.5)
    await asyncio.sleep(1.0)
    assert (await streams[0].collect()).token_ids == ref.token_ids
    deltas = [d async for d in streams[1]]  # read delta by delta, all after the deadline
    assert deltas[-1].finish_reason == ref.finish_reason
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert sync.collect().token_ids == ref.token_ids


def test_an_unread_stream_past_its_deadline_leaves_its_slot(llama_path):
    """The engine enforces the deadline, not only the reader: a stream held but not read
    loses its slot (here the only one, so the waiting request can start), and its reader
    then gets TimeoutError, not the output of a request that ran on."""
    import time

    engine = Engine(llama_path, show_progress=False, max_batch_size=1).start_sync()
    try:
        held = engine.open_complete_stream_sync("go on", {"max_tokens": 100_000}, timeout=0.3)
        started = time.monotonic()
        queued = engine.complete_sync("hi", {"max_tokens": 4})  # waits for the one slot
        assert queued.finish_reason == "length"
        assert time.monotonic() - started < 30  # freed at the deadline, not after 100k tokens
        with pytest.raises(TimeoutError):
            held.collect()
        assert engine.stats()["running"] == 0
    finally:
        engine.close_sync()


def test_a_stream_whose_event_loop_closed_leaves_its_slot(llama_path):
    """The handle outlives its event loop (asyncio.run returned it unread): nobody can read
    it, so the engine aborts the request at its next delivery instead of decoding on."""
    import time

    engine = Engine(llama_path, show_progress=False, max_batch_size=1).start_sync()
    try:
        eos = sorted(engine.loaded.eos_token_ids)  # ids, not an array: the processor runs on the engine thread

        async def open_and_leave():
            return await engine.open_complete_stream("go on", {"max_tokens": 100_000, "logits_processors": [
                lambda tokens, logits: logits.at[:, eos].add(-1e9)]})

        held = asyncio.run(open_and_leave())  # the loop is closed now; the handle is kept
        started = time.monotonic()
        queued = engine.complete_sync("hi", {"max_tokens": 4})  # waits for the one slot
        assert queued.finish_reason == "length"
        assert time.monotonic() - started < 30
        # Aborted, not run on to the end of the context window (about 4,000 tokens).
        assert engine.stats()["aborted"] == 1 and engine.stats()["running"] == 0
        del held
    finally:
        engine.close_sync()


async def test_preparing_a_request_leaves_the_event_loop_free(llama_engine, llama_path, monkeypatch):
    # Templating a long prompt or decoding images must not stall the caller's event loop:
    # the render below only proceeds once a coroutine on that loop has run.
    import threading

    from mlx_tandem.prompt import PromptRenderer

    from .reference import reference_greedy

    engine = llama_engine
    prompt = chat_prompts(1)[0]
    expected = reference_greedy(llama_path, engine.apply_chat_template(prompt), 6)
    real = PromptRenderer.render_with_text
    loop_ran = threading.Event()

    def gated(self, *args, **kwargs):
        if not loop_ran.wait(5):
            raise AssertionError("the request was prepared on the event loop, which was blocked")
        return real(self, *args, **kwargs)

    async def tick():
        await asyncio.sleep(0.02)
        loop_ran.set()

    monkeypatch.setattr(PromptRenderer, "render_with_text", gated)
    out, _ = await asyncio.gather(engine.chat(prompt, SamplingParams(max_tokens=6)), tick())
    assert out.token_ids == expected


async def test_a_shared_engine_whose_load_failed_is_replaced_on_the_next_call(tmp_path, llama_path):
    # e.g. a checkpoint directory still being copied: once its files are there, the next
    # call loads it, instead of raising the first load's error for the life of the process.
    import shutil

    from mlx_tandem import ModelLoadError

    path = tmp_path / "arriving"
    path.mkdir()
    first = Engine.shared(path, show_progress=False)
    with pytest.raises(ModelLoadError):
        await first.start()
    assert first.closed
    for f in llama_path.iterdir():
        shutil.copy(f, path / f.name)
    second = Engine.shared(path, show_progress=False)
    try:
        assert second is not first
        prompt = chat_prompts(1)[0]
        out = await second.chat(prompt, SamplingParams(max_tokens=5))
        with Engine(llama_path, show_progress=False) as ref:
            assert out.token_ids == ref.chat_sync(prompt, SamplingParams(max_tokens=5)).token_ids
    finally:
        second.close_sync()
