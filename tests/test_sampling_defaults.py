"""Sampling fields a request leaves unset follow the checkpoint's generation_config.json (as
vLLM reads it); the values a request or an adapter gives win, 0 included."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest

from mlx_tandem import Engine, SamplingParams
from mlx_tandem.model_info import sampling_defaults_of
from mlx_tandem.params import MODEL_DEFAULTS

from .prompts import chat_prompts

RECOMMENDED = {"temperature": 1.0, "top_k": 5, "top_p": 0.9}


@pytest.fixture(scope="module")
def recommending_path(llama_path, tmp_path_factory):
    """The factory llama whose generation_config.json recommends sampling (Qwen3's ships
    temperature 0.6, top_p 0.95, top_k 20)."""
    path = shutil.copytree(llama_path, tmp_path_factory.mktemp("sampling") / "llama")
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, **RECOMMENDED}))
    return path


def test_unset_fields_take_defaults_and_given_ones_win():
    assert SamplingParams().unset == frozenset(MODEL_DEFAULTS)
    assert SamplingParams().temperature is None and SamplingParams().greedy  # greedy unless told
    filled = SamplingParams(top_p=0.5).with_defaults(RECOMMENDED)
    assert (filled.temperature, filled.top_k, filled.top_p, filled.min_p, filled.repetition_penalty) \
        == (1.0, 5, 0.5, 0.0, 1.0)  # the rest: the built-ins
    assert filled.unset == frozenset() and filled.with_defaults({"min_p": 0.1}) is filled
    greedy = SamplingParams(temperature=0).with_defaults(RECOMMENDED)
    assert greedy.greedy and greedy.top_k == 5  # an explicit 0 is kept; the filters still apply
    assert SamplingParams.coerce({"temperature": None}).with_defaults(RECOMMENDED).temperature == 1.0
    # However a field is set, a default does not overwrite it; set back to None, it does.
    assert SamplingParams().with_updates(temperature=0.3).with_defaults(RECOMMENDED).temperature == 0.3
    assert dataclasses.replace(SamplingParams(), temperature=0.3).with_defaults(RECOMMENDED).temperature == 0.3
    assert SamplingParams(temperature=0.3).with_updates(temperature=None).with_defaults(RECOMMENDED).temperature == 1.0
    # Left unset and set to the built-in value are different requests.
    assert SamplingParams() != SamplingParams(temperature=0.0)
    assert SamplingParams.coerce(dataclasses.asdict(SamplingParams(top_k=3))) == SamplingParams(top_k=3)


def test_generation_config_is_read_as_vllm_reads_it(tmp_path, caplog):
    def read(config) -> dict:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
        return sampling_defaults_of(tmp_path)

    assert sampling_defaults_of(tmp_path / "nowhere") == {}
    assert read({"eos_token_id": 2, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 9}) \
        == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert read({"do_sample": False, "temperature": 0.6}) == {}  # greedy, as transformers reads it
    assert read({"top_k": -1, "temperature": 0.5}) == {"top_k": 0, "temperature": 0.5}  # vLLM's "off"
    assert read({"top_k": 20.0}) == {"top_k": 20}
    with caplog.at_level(logging.WARNING, logger="mlx_tandem.model_info"):
        assert read({"temperature": 0.7, "top_p": 0, "top_k": -2}) == {"temperature": 0.7}
    assert "top_p is not used" in caplog.text and "top_k is not used" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_tandem.model_info"):
        (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
        assert sampling_defaults_of(tmp_path, warn=False) == {} and not caplog.text  # model_info() reads
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults_of(tmp_path) == {}


async def test_a_request_samples_as_the_checkpoint_recommends(recommending_path, llama_path):
    prompt = chat_prompts(1)[0]
    async with Engine(recommending_path, show_progress=False) as engine, \
            Engine(llama_path, show_progress=False) as plain:
        assert engine.model_info(load=False).sampling_defaults == RECOMMENDED  # from the files
        assert engine.model_info().sampling_defaults == RECOMMENDED  # what the loaded engine applies
        hash(engine.model_info())
        assert plain.model_info().sampling_defaults == {}
        unset = await engine.chat(prompt, SamplingParams(max_tokens=16, seed=7))
        given = await plain.chat(prompt, SamplingParams(max_tokens=16, seed=7, **RECOMMENDED))
        greedy = await plain.chat(prompt, SamplingParams(max_tokens=16))
        assert unset.token_ids == given.token_ids != greedy.token_ids
        # A request's own values win: temperature 0 is greedy here too (top_k 5 keeps the top token).
        assert (await engine.chat(prompt, SamplingParams(max_tokens=16, temperature=0))).token_ids == greedy.token_ids


def test_the_adapters_leave_unset_fields_to_the_checkpoint(recommending_path, llama_path):
    from langchain_mlx_tandem import ChatMLX
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.mlx_tandem import MLXTandemLLM

    prompt = chat_prompts(1)[0][-1]["content"]
    with Engine(llama_path, show_progress=False) as plain:
        given = plain.chat_sync([{"role": "user", "content": prompt}],
                                SamplingParams(max_tokens=12, seed=3, **RECOMMENDED)).text
        greedy = plain.chat_sync([{"role": "user", "content": prompt}], SamplingParams(max_tokens=12)).text
    assert given != greedy
    assert ChatMLX(model=str(recommending_path), max_tokens=12, seed=3).invoke(prompt).content == given
    assert ChatMLX(model=str(recommending_path), max_tokens=12, temperature=0).invoke(prompt).content == greedy
    llm = MLXTandemLLM(model=str(recommending_path), max_tokens=12, seed=3)
    assert llm.chat([ChatMessage(role="user", content=prompt)]).message.content == given


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_vl"])
async def test_a_stop_id_listed_in_generation_config_only_stops_text_and_vision_checkpoints(kind, request,
                                                                                            tmp_path):
    """Qwen-VL checkpoints list ``<|endoftext|>`` among the stop ids of generation_config.json
    only (mlx-lm and mlx-vlm merge that list into the config). The vision path read
    config.json alone, so a VLM ran past such a token to max_tokens where the same
    checkpoint served as text stopped (review h152)."""
    path = shutil.copytree(request.getfixturevalue(f"{kind}_path"), tmp_path / kind)
    config = json.loads((path / "generation_config.json").read_text())
    extra = 7  # an ordinary token, listed as a stop id in generation_config.json alone
    assert extra not in json.loads((path / "config.json").read_text()).get("eos_token_id", [])
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [*config["eos_token_id"],
                                                                                         extra]}))
    async with Engine(path, show_progress=False) as engine:
        assert extra in engine.loaded.eos_token_ids
        out = await engine.chat([{"role": "user", "content": "hi"}],
                                {"temperature": 0, "max_tokens": 8, "logit_bias": {extra: 100}})
    assert (out.finish_reason, out.text, out.usage.completion_tokens) == ("stop", "", 1)
