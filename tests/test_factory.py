"""The offline model factory: complete, deterministic, loadable checkpoints."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from mlx_tandem.testing import make_tiny_model
from mlx_tandem.testing.factory import _init_model, qwen3_5_to_hf

from .numerics import tolerance


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "draft", "qwen3_5_vl"])
def test_kind_loads_with_mlx_lm_and_renders_chat(tiny_models, kind):
    path = tiny_models.get(kind)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).exists()
    model, tokenizer = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert "<tools>" in ids and "get_weather" in ids and "<tool_response>\nsunny\n</tool_response>" in ids
    assert ids.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    logits = model(mx.array([tokenizer.encode("hello world")]))
    assert logits.shape[-1] == vocab and bool(mx.all(mx.isfinite(logits)))
    # Special tokens are single tokens; markup tokens too.
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "<tool_call>", "<|image_pad|>"):
        assert len(tokenizer.encode(t, add_special_tokens=False)) == 1


def test_factory_is_deterministic(tmp_path):
    a = make_tiny_model("qwen3_5", tmp_path / "a", seed=3)
    b = make_tiny_model("qwen3_5", tmp_path / "b", seed=3)
    c = make_tiny_model("qwen3_5", tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_loaded_weights_equal_generated_weights(tiny_models, kind):
    """Written in HF layout and sanitized back by mlx-lm: the same values, exactly."""
    path = tiny_models.get(kind)
    config = json.loads((path / "config.json").read_text())
    expected = _init_model(kind, config, seed=0)
    model, _ = mlx_lm.load(str(path))
    loaded = dict(tree_flatten(model.parameters()))
    assert set(loaded) == set(expected)
    for k, v in expected.items():
        assert mx.array_equal(loaded[k], v), k


def test_qwen3_5_carries_mtp_head(tiny_models):
    path = tiny_models.get("qwen3_5")
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    weights = mx.load(str(path / "model.safetensors"))
    mtp = {k for k in weights if k.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight"} <= mtp
    assert any(k.startswith("mtp.layers.0.self_attn.") for k in mtp)
    # HF layout on disk: conv1d as (C, 1, K), zero-centred norms.
    conv = [v for k, v in weights.items() if k.endswith("conv1d.weight")][0]
    assert conv.shape[1] == 1
    # The drafter mlx-vlm loads for MTP reads these tensors.
    from mlx_vlm.speculative.drafters import load_drafter

    drafter, kind = load_drafter(str(path), kind="mtp")
    assert kind == "mtp"
    loaded = dict(tree_flatten(drafter.parameters()))
    assert mx.array_equal(loaded["fc.weight"], weights["mtp.fc.weight"])
    assert mx.allclose(loaded["norm.weight"], weights["mtp.norm.weight"] + 1.0)


def test_vlm_kind_loads_with_mlx_vlm(tiny_models):
    import mlx_vlm

    path = tiny_models.get("qwen3_5_vl")
    model, processor = mlx_vlm.load(str(path))
    assert type(processor).__module__.startswith("mlx_vlm")
    # The text backbone mlx-lm loads equals mlx-vlm's language model.
    text_model, tokenizer = mlx_lm.load(str(path))
    ids = mx.array([tokenizer.encode("hello world, this is a test")])
    a = text_model(ids)
    b = model.language_model(ids).logits
    assert mx.allclose(a, b, **tolerance(rtol=1e-5, atol=1e-4))  # mx.allclose's default rtol


def test_draft_shares_the_tokenizer(tiny_models):
    a = tiny_models.get("draft") / "tokenizer.json"
    b = tiny_models.get("llama") / "tokenizer.json"
    assert a.read_bytes() == b.read_bytes()


def test_hf_conversion_round_trip_is_exact():
    w = {"language_model.model.layers.0.input_layernorm.weight": mx.array([0.5, 0.75, 1.3, 1.5])}
    hf = qwen3_5_to_hf(w)
    back = hf["model.language_model.layers.0.input_layernorm.weight"] + 1.0
    assert mx.array_equal(back, w["language_model.model.layers.0.input_layernorm.weight"])
