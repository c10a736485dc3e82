"""Bad input fails that request only, with a typed error; the engine keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from mlx_tandem import (ContextLengthError, Engine, EngineClosedError, EngineStepError, InvalidRequestError,
                        SamplingParams, TandemError, UnsupportedContentError)

from .prompts import chat_prompts
from .reference import reference_greedy


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(max_tokens=1.5),
    dict(top_k=-1), dict(min_p=1.0), dict(repetition_penalty=0), dict(seed=-3), dict(stop=[""]),
    dict(temperature=float("nan")), dict(logits_processors=["not callable"]),
])
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_bad_engine_options():
    with pytest.raises(InvalidRequestError):
        Engine("x", max_batch_size=0)
    with pytest.raises(InvalidRequestError):
        Engine("x", not_an_option=1)


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


async def test_a_failing_step_fails_its_requests_and_the_engine_recovers(llama_path, monkeypatch):
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
        victims = await asyncio.gather(*[engine.chat(p, SamplingParams(max_tokens=30)) for p in chat_prompts(4)],
                                       return_exceptions=True)
        assert all(isinstance(v, EngineStepError) for v in victims), victims
        assert engine.stats()["step_errors"] == 1
        monkeypatch.setattr(model_cls, "__call__", real_call)
        prompts = chat_prompts(4)
        expected = [reference_greedy(llama_path, engine.apply_chat_template(p), 10) for p in prompts]
        outs = await asyncio.gather(*[engine.chat(p, SamplingParams(max_tokens=10)) for p in prompts])
        assert [o.token_ids for o in outs] == expected


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
