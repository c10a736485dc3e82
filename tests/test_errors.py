"""Bad input fails that request only, with a typed error; the engine keeps serving."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mlx_tandem import (ConstraintError, ContextLengthError, Engine, EngineClosedError, EngineStepError, InvalidRequestError,
                        ModelLoadError, QueueFullError, SamplingParams, TandemError, UnsupportedContentError)

from .numerics import same_greedy
from .prompts import chat_prompts
from .reference import reference_greedy

TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(max_tokens=1.5),
    dict(top_k=-1), dict(min_p=1.0), dict(repetition_penalty=0), dict(seed=-3), dict(stop=[""]),
    dict(temperature=float("nan")), dict(logits_processors=["not callable"]),
    dict(stop=5), dict(logits_processors=5), dict(seed=2**64), dict(stop={"a": 1}),
    dict(repetition_context_size=True), dict(temperature=1e308), dict(repetition_penalty=1e-308),
    dict(repetition_penalty=1e9),
    dict(stop=["a", "\ud800"]),  # a lone surrogate never appears in decoded text: it could never match
    # Ints too large for a float: math.isfinite raised OverflowError, not a typed error.
    dict(temperature=10**400), dict(top_p=10**400), dict(min_p=10**400), dict(repetition_penalty=10**400),
])
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("stop", [b"ab", bytearray(b"ab"), memoryview(b"ab")])
def test_a_bytes_stop_is_refused_as_written(stop):
    """Bytes are a sequence of ints: the error named stop=(97, 98), never what was passed."""
    with pytest.raises(InvalidRequestError, match=r"stop=(b'ab'|bytearray\(b'ab'\)|<memory)"):
        SamplingParams(stop=stop)


async def test_temperatures_too_small_to_sample_are_greedy(llama_engine):
    """1/temperature overflows float32 near 1e-38 and the draw became a random pick; under
    1e-5 the request decodes greedily, as vLLM's does."""
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=1e-4).greedy
    prompt = [5, 6, 7]
    greedy = await llama_engine.complete(prompt, {"max_tokens": 12})
    tiny = await asyncio.gather(*(llama_engine.complete(prompt, {"max_tokens": 12, "temperature": 1e-39, "seed": s})
                                  for s in range(4)))
    assert all(t.token_ids == greedy.token_ids for t in tiny)


async def test_a_top_p_too_small_for_float32_keeps_the_top_token(llama_engine):
    """mlx-lm compares top_p times the total in float32: where that rounded to 0 every
    token was masked and the draw was random. Any top_p under 1/vocab keeps the top token
    alone, i.e. greedy."""
    prompt = [5, 6, 7]
    greedy = await llama_engine.complete(prompt, {"max_tokens": 10})
    tiny = await asyncio.gather(*(llama_engine.complete(
        prompt, {"max_tokens": 10, "temperature": 1.0, "top_p": top_p, "seed": s})
        for s, top_p in enumerate((1e-6, 1e-46, 1e-300))))
    assert all(t.token_ids == greedy.token_ids for t in tiny)


def test_call_options_of_the_wrong_type_are_typed_errors():
    from mlx_tandem.call_options import merge_stops, resolve_call

    class Defaults:  # the adapters' fields
        temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed = 0.0, 1.0, 0, 0.0, 1.0, 20, None
        mtp = specprefill = keep_pct = max_tokens = timeout = reasoning = presence_penalty = frequency_penalty = None
        logprobs = top_logprobs = logit_bias = None
        stop, chat_template_kwargs = None, {}

    for stop in (5, {"zz": 1}):
        with pytest.raises(InvalidRequestError):
            merge_stops(None, stop)
    with pytest.raises(InvalidRequestError):
        resolve_call(Defaults(), {"chat_template_kwargs": ["x"]}, owner="test")
    call = resolve_call(Defaults(), {"chat_template_kwargs": None, "stop": ("a", "b")}, owner="test")
    assert call.params.stop == ("a", "b")


def test_a_model_argument_of_the_wrong_type_is_a_typed_error():
    from mlx_tandem import ModelLoadError

    with pytest.raises(ModelLoadError, match="got int"):
        Engine(12345)


def test_a_request_from_the_engines_own_thread_is_refused_not_a_hang(llama_engine):
    """A logits processor (or run_on_owner_thread) that makes a request would wait for
    output only the engine thread can make: the engine, and close(), hung for good."""
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="own thread"):
        llama_engine.run_on_owner_thread(lambda: llama_engine.chat_sync(msgs, {"max_tokens": 2}))
    with pytest.raises(InvalidRequestError, match="own thread"):
        llama_engine.run_on_owner_thread(lambda: asyncio.run(llama_engine.chat(msgs, {"max_tokens": 2})))
    seen = []

    def nested(tokens, logits):
        if not seen:
            try:
                llama_engine.chat_sync(msgs, {"max_tokens": 2})
            except InvalidRequestError as exc:
                seen.append(exc)
        return logits

    out = llama_engine.chat_sync(msgs, {"max_tokens": 3, "logits_processors": [nested]})
    assert len(seen) == 1 and out.finish_reason in ("stop", "length")
    assert llama_engine.chat_sync(msgs, {"max_tokens": 2}).finish_reason in ("stop", "length")


def test_a_sync_timeout_beyond_what_a_thread_can_wait_is_accepted(llama_engine):
    msgs = [{"role": "user", "content": "hi"}]
    out = llama_engine.open_chat_stream_sync(msgs, {"max_tokens": 3}, timeout=1e10).collect()
    assert out.finish_reason in ("stop", "length")


def test_bad_engine_options():
    with pytest.raises(InvalidRequestError):
        Engine("x", max_batch_size=0)
    with pytest.raises(InvalidRequestError):
        Engine("x", not_an_option=1)
    with pytest.raises(InvalidRequestError, match="mtp_depth"):
        Engine("x", mtp_depth=2.0)  # equal to 2, yet it failed every speculative step later
    with pytest.raises(InvalidRequestError, match="coalesce_ms"):
        Engine("x", coalesce_ms=True)
    with pytest.raises(InvalidRequestError, match="specprefill_draft"):
        Engine("x", specprefill_draft="")  # Path("") is the working directory
    for empty in ("", "  "):
        with pytest.raises(ModelLoadError, match="empty"):
            Engine(empty)
    for name in ("show_progress", "allow_remote_images"):  # Engine.shared hashed them: TypeError
        with pytest.raises(InvalidRequestError, match=name):
            Engine.shared("x", **{name: []})


def test_the_vocabulary_size_comes_from_the_model_where_the_config_has_none():
    """A config without vocab_size that mlx-lm fills with the architecture's default (cohere)
    loaded, then failed with a bare TypeError; with no size anywhere it is a ModelLoadError."""
    from types import SimpleNamespace

    from mlx_tandem import ModelLoadError
    from mlx_tandem.model_loader import _vocab_size

    model = SimpleNamespace(args=SimpleNamespace(vocab_size=256000))
    assert _vocab_size(model, {"model_type": "cohere"}) == 256000
    assert _vocab_size(model, {"vocab_size": 32}) == 32
    assert _vocab_size(SimpleNamespace(), {"text_config": {"vocab_size": 64}}) == 64
    vlm_text = SimpleNamespace(language_model=SimpleNamespace(args=SimpleNamespace(vocab_size=128)))
    assert _vocab_size(vlm_text, {}) == 128
    with pytest.raises(ModelLoadError, match="vocab_size"):
        _vocab_size(SimpleNamespace(), {"vocab_size": None, "text_config": "not a dict"})


def test_a_relative_model_path_is_fixed_when_the_engine_is_made(llama_path, qwen3_5_path, tmp_path, monkeypatch):
    """Resolved only at load, a relative path followed the working directory: the engine
    Engine.shared had keyed on one directory loaded and served another model."""
    import shutil

    # A copy of its own: a shared engine another test file made for llama_path (this
    # process's, under pytest-xdist) would be found first, under the name it was given.
    llama_path = shutil.copytree(llama_path, tmp_path / "llama")
    for where, target in (("a", llama_path), ("b", qwen3_5_path)):
        (tmp_path / where).mkdir()
        (tmp_path / where / "model").symlink_to(target, target_is_directory=True)
    monkeypatch.chdir(tmp_path / "a")
    engine = Engine.shared("model", show_progress=False)
    monkeypatch.chdir(tmp_path / "b")  # a notebook's %cd, a library's chdir
    try:
        assert Engine.shared(str(tmp_path / "a" / "model"), show_progress=False) is engine
        assert engine.model_info(load=False).name == "model"  # the name as given
        engine.start_sync()
        assert engine.loaded.path.resolve() == llama_path.resolve() and engine.loaded.model_type == "llama"
    finally:
        engine.close_sync()


def test_a_home_directory_that_does_not_exist_is_a_load_error():
    from mlx_tandem import ModelLoadError

    engine = Engine("~no-such-user-here/model", show_progress=False)
    with pytest.raises(ModelLoadError):
        engine.start_sync()
    # Its facts read without loading (LlamaIndex's metadata): not on disk, where a
    # RuntimeError was raised; read with a load, the load's typed error.
    assert Engine("~no-such-user-here/model", show_progress=False).model_info(load=False) is None
    with pytest.raises(ModelLoadError):
        Engine("~no-such-user-here/model", show_progress=False).model_info()


def test_a_checkpoint_without_its_tokenizer_file_is_a_load_error(qwen3_5_path, tmp_path):
    """transformers 5 builds a tokenizer of the special tokens alone when tokenizer.json is
    missing: the load went through and every prompt's text encoded to nothing."""
    import shutil

    from mlx_tandem import ModelLoadError

    path = shutil.copytree(qwen3_5_path, tmp_path / "partial")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="encodes text to no tokens"):
        Engine(path, show_progress=False).start_sync()


async def test_bad_requests_fail_alone_while_others_keep_going(llama_engine, llama_path):
    engine = llama_engine
    good = chat_prompts(6)
    expected = [reference_greedy(llama_path, engine.apply_chat_template(p), 12) for p in good]

    def boom(tokens, logits):
        raise RuntimeError("processor exploded")

    bad_calls = [
        engine.chat([{"role": "user", "content": "x " * 5000}], SamplingParams(max_tokens=4)),
        engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
        engine.chat([{"role": "user", "content": "hi"}], {"temperature": -2}),
        engine.chat([{"role": "user", "content": "hi"}], {"no_such_param": 1}),
        engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=8, logits_processors=[boom])),
        engine.complete([10**9]),
    ]
    results = await asyncio.gather(*bad_calls, *[engine.chat(p, SamplingParams(max_tokens=12)) for p in good],
                                   return_exceptions=True)
    errors, outs = results[:len(bad_calls)], results[len(bad_calls):]
    assert isinstance(errors[0], ContextLengthError) and errors[0].prompt_tokens > errors[0].max_context
    assert isinstance(errors[1], UnsupportedContentError)
    assert isinstance(errors[2], InvalidRequestError) and isinstance(errors[3], InvalidRequestError)
    assert isinstance(errors[4], InvalidRequestError) and "processor exploded" in str(errors[4])
    assert isinstance(errors[5], InvalidRequestError)
    assert all(isinstance(e, TandemError) for e in errors)
    assert [o.token_ids for o in outs] == expected
    assert engine.stats()["running"] == 0


def test_a_context_window_beyond_the_models_positions_is_allowed_with_a_warning(llama_path, caplog):
    """A deliberate override (RoPE scaling may hold more), but never a silent one."""
    import logging

    for extra, warned in ((0, False), (1, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mlx_tandem"):
            positions = Engine(llama_path, show_progress=False).model_info().context_length  # not loaded
            engine = Engine(llama_path, show_progress=False, max_model_len=positions + extra)
            engine.start_sync()
            assert engine.model_info().context_length == positions + extra
            engine.close_sync()
        assert ("beyond the %d positions" % positions in caplog.text) == warned, caplog.text


async def test_generation_stops_at_the_context_window(llama_path):
    async with Engine(llama_path, max_model_len=40, show_progress=False) as engine:
        prompt = [{"role": "user", "content": "count with me"}]
        n = len(engine.apply_chat_template(prompt))
        eos = engine.loaded.eos_token_ids

        def never_eos(tokens, logits):
            import mlx.core as mx
            mask = mx.zeros(logits.shape[-1]).at[mx.array(eos)].add(-1e9)
            return logits + mask

        out = await engine.chat(prompt, SamplingParams(max_tokens=500, logits_processors=[never_eos]))
        assert out.finish_reason == "length"
        assert n + len(out.token_ids) == 40


async def test_a_failing_step_fails_its_requests_and_the_engine_recovers(llama_path, monkeypatch, caplog):
    async with Engine(llama_path, show_progress=False) as engine:
        model_cls = type(engine.loaded.model)
        real_call = model_cls.__call__
        state = {"fail_at": None, "calls": 0}

        def flaky(self, *a, **k):
            state["calls"] += 1
            if state["fail_at"] is not None and state["calls"] == state["fail_at"]:
                raise RuntimeError("simulated Metal failure")
            return real_call(self, *a, **k)

        monkeypatch.setattr(model_cls, "__call__", flaky)
        state["fail_at"] = state["calls"] + 6  # a few steps into decoding
        ids = [f"victim-{i}" for i in range(4)]
        with caplog.at_level(logging.ERROR, logger="mlx_tandem.core"):
            victims = await asyncio.gather(*[engine.chat(p, SamplingParams(max_tokens=30), request_id=rid)
                                             for p, rid in zip(chat_prompts(4), ids)], return_exceptions=True)
        assert all(isinstance(v, EngineStepError) for v in victims), victims
        assert engine.stats()["step_errors"] == 1
        # One record, naming the requests it failed (a log reader matches them to callers).
        [record] = [r for r in caplog.records if "step of lane" in r.getMessage()]
        assert all(rid in record.getMessage() for rid in ids) and record.exc_info
        monkeypatch.setattr(model_cls, "__call__", real_call)
        prompts = chat_prompts(4)
        expected = [reference_greedy(llama_path, engine.apply_chat_template(p), 10) for p in prompts]
        outs = await asyncio.gather(*[engine.chat(p, SamplingParams(max_tokens=10)) for p in prompts])
        assert [o.token_ids for o in outs] == expected


def _held_arrays(exc: BaseException) -> list[str]:
    """Frames in ``exc``'s tracebacks (chained ones too) whose locals hold an mx.array."""
    import mlx.core as mx

    out, stack, seen = [], [exc], set()
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        tb = err.__traceback__
        while tb is not None:
            if any(isinstance(v, mx.array) for v in tb.tb_frame.f_locals.values()):
                out.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        held = [*err.args, *vars(err).values()]
        held += [v for x in held if isinstance(x, (tuple, list)) for v in x]
        if any(isinstance(v, mx.array) for v in held):
            out.append(f"{type(err).__name__}'s arguments")
        stack += [err.__cause__, err.__context__]
    return out


def test_arrays_in_built_in_exception_fields_become_numpy_copies():
    """Built-in exceptions keep some arguments in fields of their own (not ``__dict__``)."""
    import mlx.core as mx
    import numpy as np

    from mlx_tandem.teardown import clear_frames

    errors = [OSError(2, "gone", mx.arange(3)), StopIteration(mx.arange(3)), KeyError(mx.arange(3).astype(mx.bfloat16))]
    for err in errors:
        clear_frames(err)
    assert isinstance(errors[0].filename, np.ndarray) and list(errors[0].filename) == [0, 1, 2]
    assert isinstance(errors[1].value, np.ndarray) and isinstance(errors[2].args[0], np.ndarray)
    class Touchy(Exception):  # a user's error whose field raises when read (a review)
        @property
        def value(self):
            raise RuntimeError("no value here")

        def __getattr__(self, name):
            raise KeyError(name)

    touchy = Touchy("bad row", mx.arange(3))
    clear_frames(touchy)  # raised, and the engine loop crashed with it
    assert isinstance(touchy.args[1], np.ndarray)
    untouched = ValueError("no arrays", [1, 2], {"a": (3,)})
    args = untouched.args
    clear_frames(untouched)
    assert untouched.args is args  # nothing copied where nothing held an array


async def test_errors_handed_to_callers_hold_no_engine_state(llama_path, monkeypatch):
    """A failed step's or processor's error keeps no frames of the engine thread with their
    locals (the lane, its caches, a step's arrays), and no arrays in its arguments or
    attributes: a caller holding it kept the engine's MLX state alive past close(), to be
    freed on the caller's thread."""
    import gc
    import weakref

    def broken(tokens, logits):
        raise ValueError("a processor bug")

    class HoldsLogits(Exception):
        def __init__(self, message, logits):
            super().__init__(message, [logits])
            self.message, self.logits = message, logits

        def __str__(self):  # reads its array: kept as a NumPy copy, so this still works
            return f"{self.message}: max {float(self.logits.max()):.3f}"

    def telling(tokens, logits):  # the user's error carries the step's logits (an audit)
        raise HoldsLogits("bad row", logits)

    engine = Engine(llama_path, show_progress=False)
    await engine.start()
    lane = weakref.ref(engine._core._lanes["text"])
    model_cls = type(engine.loaded.model)
    real_call = model_cls.__call__
    calls = {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated step failure")
        return real_call(self, *a, **k)

    with pytest.raises(InvalidRequestError) as processor_error:
        await engine.chat(chat_prompts(1)[0], {"max_tokens": 8, "logits_processors": [broken]})
    with pytest.raises(InvalidRequestError) as telling_error:
        await engine.chat(chat_prompts(1)[0], {"max_tokens": 8, "logits_processors": [telling]})
    assert "bad row: max " in str(telling_error.value.__cause__)  # the message is kept, its values too
    monkeypatch.setattr(model_cls, "__call__", flaky)
    with pytest.raises(EngineStepError) as step_error:
        await engine.chat(chat_prompts(1)[0], {"max_tokens": 8})
    monkeypatch.setattr(model_cls, "__call__", real_call)
    held = [processor_error.value, step_error.value, telling_error.value]
    await engine.close()
    del engine
    gc.collect()
    assert [_held_arrays(e) for e in held] == [[], [], []]
    # The engine loop's own frame may still name the lane, but a closed lane holds nothing.
    assert lane() is None or not vars(lane())


async def test_a_repetition_context_longer_than_any_context_is_the_whole_context(llama_engine):
    """A huge repetition_context_size reached mlx as a slice index past 32 bits and failed
    the step, so every request in the batch failed with it."""
    prompts = chat_prompts(2)
    whole = {"max_tokens": 12, "repetition_penalty": 1.3, "repetition_context_size": 100_000}
    huge = dict(whole, repetition_context_size=2**40)
    ref = await asyncio.gather(llama_engine.chat(prompts[0], whole), llama_engine.chat(prompts[1], {"max_tokens": 12}))
    got = await asyncio.gather(llama_engine.chat(prompts[0], huge), llama_engine.chat(prompts[1], {"max_tokens": 12}))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


async def test_closed_engine(llama_path):
    engine = Engine(llama_path, show_progress=False)
    await engine.start()
    slow = asyncio.create_task(engine.chat(chat_prompts(1)[0], SamplingParams(max_tokens=100000)))
    while engine.stats()["running"] == 0:
        await asyncio.sleep(0.01)
    await engine.close()
    with pytest.raises(EngineClosedError):
        await slow
    with pytest.raises(EngineClosedError):
        await engine.chat(chat_prompts(1)[0])


async def test_missing_model_is_a_load_error(tmp_path):
    from mlx_tandem import ModelLoadError

    (tmp_path / "empty").mkdir()
    engine = Engine(tmp_path / "empty", show_progress=False)
    with pytest.raises(ModelLoadError):
        await engine.start()
    # Reading its facts without loading (LlamaIndex's metadata and payload do) is the same
    # typed error, not the FileNotFoundError or JSONDecodeError it was.
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    for name in ("empty", "broken"):
        with pytest.raises(ModelLoadError, match="not a checkpoint directory"):
            Engine(tmp_path / name, show_progress=False).model_info()


async def test_malformed_inputs_are_typed_errors_and_the_engine_keeps_serving(llama_engine, llama_path):
    engine = llama_engine
    hi = [{"role": "user", "content": "hi"}]
    deep, deep_json = "x", '{"a":' * 3000 + "1" + "}" * 3000  # past Python's recursion limit
    for _ in range(5000):
        deep = [deep]
    bad_calls = [
        engine.complete(123), engine.complete(["a"]), engine.complete([1.5]), engine.complete([None]),
        engine.chat([{"role": "user", "content": [{"type": "text", "text": None}]}]),
        engine.chat(hi, template_kwargs=5), engine.chat(hi, reasoning="yes"),
        engine.chat(hi, {"max_tokens": 2}, request_id=5),
        engine.chat(hi, response_format={"type": "regex", "regex": "[a-z]+"}),  # the key is "pattern"
        engine.complete("x", response_format={"type": "lark"}),
        engine.chat([{"role": "user", "content": "bad \ud800 text"}]),  # a lone surrogate
        engine.complete("bad \udcff text"),
        engine.complete(b"abc"), engine.complete([True, 5]),  # bytes and booleans are not token ids
        engine.chat(hi, parallel_tool_calls="no"),
        engine.chat(hi, tools=[TOOL], tool_choice={"type": "function"}),  # forced, but which tool?
        # Names that are not strings (a TypeError in the grammar's Lark, or unhashable).
        *(engine.chat(hi, tools=[{"type": "function", "function": {"name": name}}]) for name in (5, ["a"], {"a": 1})),
        engine.chat([{"role": "user", "content": "x", "meta": deep}]),  # a RecursionError
        engine.chat(hi, response_format={"type": "json_schema", "json_schema": {"schema": deep_json}}),
        # Reasoning that is not text, on turns normalization merges (a TypeError there).
        engine.chat([*hi, {"role": "assistant", "content": "a", "reasoning_content": "x"},
                     {"role": "assistant", "content": "b", "reasoning_content": 5}, *hi]),
        engine.chat(hi, tools=5), engine.chat(hi, tools=TOOL),  # not a list of tools
        # Unknown names, and chat options a raw prompt has no template for (a TypeError).
        engine.complete("x", bogus=1), engine.complete("x", tool_choice="auto"),
        engine.open_complete_stream("x", tools=[TOOL]),
        # A tool whose arguments are not an object: its forced call was always invalid.
        engine.chat(hi, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
                    tool_choice="f"),
    ]
    errors = await asyncio.gather(*bad_calls, return_exceptions=True)
    assert all(isinstance(e, InvalidRequestError) for e in errors), errors
    # Grammars no answer can hold: llguidance dropped a pattern's dangling backslash
    # (``[0-9]+\\`` answered "0"), and a language of no string answered "" with "stop".
    unsatisfiable = [
        {"type": "regex", "pattern": "[0-9]+\\"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "^a\\"}}},
        {"type": "regex", "pattern": "[^\\x00-\\x{10FFFF}]"},
        {"type": "lark", "grammar": "start: /[^\\x00-\\x{10FFFF}]/"},
    ]
    errors = await asyncio.gather(*(engine.chat(hi, response_format=f) for f in unsatisfiable), return_exceptions=True)
    assert all(isinstance(e, ConstraintError) for e in errors), errors
    assert "unpaired backslash" in str(errors[0]) and "matches no string" in str(errors[3])
    with pytest.raises(InvalidRequestError):
        engine.encode(5)
    with pytest.raises(InvalidRequestError, match="unknown"):
        engine.apply_chat_template(hi, bogus=1)
    with pytest.raises(InvalidRequestError, match="unknown"):
        engine.complete_sync("x", {"max_tokens": 1}, bogus=1)
    submitted = engine.stats()["requests"]
    for timeout in (float("nan"), -1, "5", 10**400):  # refused before anything is submitted
        with pytest.raises(InvalidRequestError):
            await engine.open_chat_stream(hi, timeout=timeout)
        with pytest.raises(InvalidRequestError):
            engine.open_complete_stream_sync("hi", timeout=timeout)
    assert engine.stats()["requests"] == submitted
    out = await engine.chat(hi, SamplingParams(max_tokens=8))
    assert out.token_ids == reference_greedy(llama_path, engine.apply_chat_template(hi), 8)


async def test_top_k_at_or_above_the_vocabulary_keeps_every_token(llama_engine, llama_path):
    # mlx-lm's top-k needs k < vocab; k >= vocab filters nothing, as k = 0 does. Seeded
    # draws depend only on the seed, so the outputs must match token for token. The three
    # share one batch, so their logits are the same on any backend (tests/numerics.py).
    engine = llama_engine
    vocab = engine.loaded.vocab_size
    prompt, greedy_prompt = chat_prompts(2)
    sampled = dict(max_tokens=12, temperature=1.0, seed=7)
    outs = await asyncio.gather(
        engine.chat(prompt, SamplingParams(top_k=vocab, **sampled)),
        engine.chat(prompt, SamplingParams(top_k=10 * vocab, **sampled)),
        engine.chat(prompt, SamplingParams(top_k=0, **sampled)),
        engine.chat(greedy_prompt, SamplingParams(max_tokens=12)))
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    greedy_ids = engine.apply_chat_template(greedy_prompt)
    same_greedy(outs[3].token_ids, reference_greedy(llama_path, greedy_ids, 12), judge=llama_path,
                prompt_ids=greedy_ids, what="the greedy row beside them")


async def test_a_sampler_failing_mid_trace_leaves_sampling_usable(llama_path, monkeypatch):
    # mlx-lm compiles its samplers with the global PRNG state as input and output; one
    # that raises while being traced left a placeholder there, and every later unseeded
    # draw failed ("eval an array without a primitive"), until the engine was restarted.
    from functools import partial

    import mlx.core as mx
    from mlx_tandem import samplers

    real = samplers._shared_sampler

    def shared_sampler(temperature, top_p, min_p, top_k):
        if temperature != 0.25:
            return real(temperature, top_p, min_p, top_k)

        @partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
        def failing(logprobs):
            mx.random.categorical(logprobs)
            raise ValueError("sampler failed while traced")

        return failing

    monkeypatch.setattr(samplers, "_shared_sampler", shared_sampler)
    async with Engine(llama_path, show_progress=False) as engine:
        prompt = chat_prompts(1)[0]
        with pytest.raises(EngineStepError, match="sampler failed"):
            await engine.chat(prompt, SamplingParams(max_tokens=4, temperature=0.25))
        outs = await asyncio.gather(*[engine.chat(prompt, SamplingParams(max_tokens=6, temperature=0.7))
                                      for _ in range(3)])
        # Unseeded draws work again (they raised): whether one draws EOS depends on the global
        # key, which the tests run before this one move.
        assert all(o.finish_reason == "length" and len(o.token_ids) == 6 or
                   o.finish_reason == "stop" and len(o.token_ids) < 6 for o in outs), outs


async def test_a_request_id_in_use_is_refused_and_the_live_request_is_untouched(llama_engine, llama_path):
    engine = llama_engine
    prompt = chat_prompts(1)[0]
    first = await engine.open_chat_stream(prompt, SamplingParams(max_tokens=16), request_id="same")
    await first.__anext__()  # running
    refused = await engine.open_chat_stream(prompt, SamplingParams(max_tokens=16), request_id="same")
    await refused.aclose()  # its abort must not reach the live request that has the id
    again = await engine.open_chat_stream(prompt, SamplingParams(max_tokens=4), request_id="same")
    with pytest.raises(InvalidRequestError, match="already in use"):
        await again.collect()
    out = await first.collect()
    assert out.finish_reason == "length"
    assert out.token_ids == reference_greedy(llama_path, engine.apply_chat_template(prompt), 16)


def test_a_submit_racing_close_ends_with_engine_closed_not_a_hang(llama_path):
    # The owner thread's last drain of its inbox must see every request put in before it
    # closed: a put that lands after that drain is never answered.
    import threading

    engine = Engine(llama_path, show_progress=False).start_sync()
    core = engine._core
    entered = threading.Event()

    class SlowInbox:
        def __init__(self, inbox):
            self.inbox = inbox
            self.get, self.get_nowait = inbox.get, inbox.get_nowait

        def put(self, item):
            if item[0] == "add":
                entered.set()
                threading.Event().wait(0.3)  # the caller is between its "closed?" check and the put
            self.inbox.put(item)

    core._inbox = SlowInbox(core._inbox)
    result: list = []
    caller = threading.Thread(target=lambda: result.append(_outcome(engine, chat_prompts(1)[0])))
    caller.start()
    entered.wait(5)
    engine.close_sync()
    caller.join(10)
    assert not caller.is_alive(), "the caller was left waiting on a closed engine"
    assert isinstance(result[0], EngineClosedError) or result[0].finish_reason == "length"


def _outcome(engine, prompt):
    try:
        return engine.chat_sync(prompt, SamplingParams(max_tokens=4))
    except TandemError as exc:
        return exc


def test_a_burst_fills_free_slots_before_the_waiting_limit_applies(llama_path):
    """max_waiting bounds the requests that wait for a slot, not a burst that free slots take:
    six requests drained in one go by an idle engine with 32 slots and max_waiting=2 all run.
    With every slot busy, the next request past the limit is a QueueFullError (overload, not
    a bad request), and the engine keeps serving."""
    import threading

    engine = Engine(llama_path, show_progress=False, max_waiting=2, max_batch_size=32).start_sync()
    try:
        release = threading.Event()
        held = engine._core.call(release.wait)  # the owner thread waits: the burst queues up
        streams = [engine.open_complete_stream_sync("hi", SamplingParams(max_tokens=4)) for _ in range(6)]
        release.set()
        held.result(10)
        outs = [s.collect() for s in streams]
        assert [o.finish_reason for o in outs] == ["length"] * 6
    finally:
        engine.close_sync()

    engine = Engine(llama_path, show_progress=False, max_waiting=1, max_batch_size=1).start_sync()
    try:
        busy = engine.open_complete_stream_sync("hi", SamplingParams(max_tokens=2000))
        next(busy)  # running: the one slot is taken
        waiting = engine.open_complete_stream_sync("hi", SamplingParams(max_tokens=4))
        with pytest.raises(QueueFullError, match="max_waiting"):
            engine.complete_sync("hi", SamplingParams(max_tokens=4))
        assert not isinstance(QueueFullError("x"), InvalidRequestError)
        busy.cancel()
        assert waiting.collect().finish_reason == "length"
    finally:
        engine.close_sync()


async def test_a_processor_raising_a_base_exception_fails_only_its_request(llama_engine, llama_path):
    """CancelledError and SystemExit are not Exceptions: raised by a user's processor on the
    engine thread, they fail that request, not the engine."""
    engine = llama_engine
    prompt = [5, 6, 7, 8, 9]
    victim = asyncio.create_task(engine.complete(prompt, SamplingParams(max_tokens=40)))

    def raising(exc):
        def proc(tokens, logits):
            raise exc
        return proc

    for exc in (asyncio.CancelledError(), SystemExit(3)):
        with pytest.raises(InvalidRequestError, match="logits processor failed"):
            await engine.complete([11, 12, 13], SamplingParams(max_tokens=4, logits_processors=[raising(exc)]))
    assert (await victim).token_ids == reference_greedy(llama_path, prompt, 40)
    assert not engine.closed


async def test_a_step_failing_after_a_row_finished_fails_that_request_too(llama_path):
    """The lane hands a finished row's cache to the prefix cache inside its step; a failure
    there fails the step after the row left the batch. Its request still gets the step's
    error (no reader left waiting, no memory left reserved)."""
    async with Engine(llama_path, show_progress=False) as engine:
        cache = engine._core._lanes["text"].prefix_cache
        store = cache.store

        def failing_store(tokens, snapshot, kind):
            if kind == "final":
                raise RuntimeError("simulated allocation failure")
            return store(tokens, snapshot, kind)

        cache.store = failing_store
        short = engine.complete([20 + i for i in range(30)], SamplingParams(max_tokens=4))
        long = engine.complete([40 + i for i in range(30)], SamplingParams(max_tokens=400))
        outs = await asyncio.wait_for(asyncio.gather(short, long, return_exceptions=True), 60)
        assert [type(o) for o in outs] == [EngineStepError, EngineStepError], outs
        cache.store = store
        stats = engine.stats()
        assert stats["running"] == 0 and stats["memory"]["reserved_bytes"] == 0
        out = await engine.complete([20 + i for i in range(30)], SamplingParams(max_tokens=4))
        assert out.token_ids == reference_greedy(llama_path, [20 + i for i in range(30)], 4)
