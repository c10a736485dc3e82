"""Tiny, deterministic, offline checkpoints in Hugging Face layout.

``make_tiny_model(kind, path)`` writes config.json, model.safetensors and the tokenizer
files of a random-weight model that ``mlx_lm.load`` (and ``mlx_vlm.load`` for the VLM kind)
loads with HF_HUB_OFFLINE=1. Weights are written the way upstream checkpoints store them
(e.g. Qwen3.5's conv1d layout and zero-centred norms), so loaders' sanitize paths are
exercised exactly as with a real checkpoint.
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from .. import _platform  # noqa: F401  - before mlx
from .tokenizer import write_tokenizer

KINDS = ("llama", "qwen3_5", "qwen3_5_vl", "draft")

_LLAMA_DEFAULTS = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2)
_DRAFT_DEFAULTS = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                       num_attention_heads=2, num_key_value_heads=1)
_QWEN3_5_DEFAULTS = dict(
    hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    full_attention_interval=2,
)
# Qwen3.5 (like Qwen3-Next) stores these RMSNorm weights zero-centred (the model uses 1 + w).
_QWEN_ZERO_CENTRED_NORMS = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight", ".norm.weight",
    ".q_norm.weight", ".k_norm.weight", ".pre_fc_norm_embedding.weight", ".pre_fc_norm_hidden.weight",
)


def make_tiny_model(kind: str, path: str | Path, *, seed: int = 0, mtp_layers: int = 1,
                    vocab_size: int = 2048, max_position_embeddings: int = 4096,
                    dtype: str = "float32", **sizes: Any) -> Path:
    """Write a complete checkpoint directory for ``kind`` at ``path`` and return it.

    ``sizes`` override the architecture's dimensions (hidden_size, num_hidden_layers, ...).
    The directory is written to a temporary sibling and renamed, so a reader never sees a
    half-written checkpoint.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        ids = write_tokenizer(tmp, vocab_size=vocab_size, model_max_length=max_position_embeddings)
        writer = _WRITERS[kind]
        writer(tmp, ids, seed=seed, mtp_layers=mtp_layers, dtype=dtype,
               max_position_embeddings=max_position_embeddings, sizes=sizes)
        (tmp / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
             "pad_token_id": ids["<|endoftext|>"]}, indent=2))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# --------------------------------------------------------------------------- helpers
def _init_model(module_name: str, config: dict, seed: int):
    """Instantiate mlx-lm's model class for ``config`` with seeded random weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    mx.random.seed(seed)
    arch = importlib.import_module(f"mlx_lm.models.{module_name}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Norm weights start at 1; jitter them so a loader that mishandles norms is caught.
    flat = dict(tree_flatten(model.parameters()))
    for k, v in flat.items():
        if k.endswith("norm.weight") and v.ndim == 1:
            flat[k] = v + 0.1 * mx.random.normal(v.shape)
    model.load_weights(list(flat.items()))
    mx.eval(model.parameters())
    return model, dict(tree_flatten(model.parameters()))


def _save(path: Path, weights: dict, dtype: str) -> None:
    import mlx.core as mx

    dt = getattr(mx, dtype)
    weights = {k: v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})


def _write_config(path: Path, config: dict) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _sizes(defaults: dict, sizes: dict) -> dict:
    unknown = set(sizes) - set(defaults) - {"tie_word_embeddings", "rope_theta", "rms_norm_eps"}
    if unknown:
        raise ValueError(f"unknown size arguments {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **sizes}


# --------------------------------------------------------------------------- llama / draft
def _write_llama(path: Path, ids: dict, *, seed, dtype, max_position_embeddings, sizes,
                 defaults=_LLAMA_DEFAULTS, **_):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": ids["__vocab_size__"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": None,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "torch_dtype": dtype,
        **_sizes(defaults, sizes),
    }
    _, weights = _init_model("llama", config, seed)
    _write_config(path, config)
    _save(path, weights, dtype)


def _write_draft(path: Path, ids: dict, **kw):
    _write_llama(path, ids, defaults=_DRAFT_DEFAULTS, **kw)


# --------------------------------------------------------------------------- qwen3_5
def qwen3_5_text_config(ids: dict, *, mtp_layers: int, max_position_embeddings: int, sizes: dict) -> dict:
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": ids["__vocab_size__"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                            "mrope_interleaved": True},
        "mtp_num_hidden_layers": mtp_layers,
        "eos_token_id": ids["<|im_end|>"],
        **_sizes(_QWEN3_5_DEFAULTS, sizes),
    }


def qwen3_5_to_hf(weights: dict, prefix: str = "model.language_model.") -> dict:
    """Invert mlx-lm's Qwen3.5 sanitize: HF keys, (C, 1, K) conv1d, zero-centred norms."""
    out = {}
    for k, v in weights.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)
        if any(k.endswith(s) for s in _QWEN_ZERO_CENTRED_NORMS) and v.ndim == 1 and "linear_attn" not in k:
            v = v - 1.0
        if k.startswith("language_model.model."):
            k = prefix + k[len("language_model.model."):]
        elif k.startswith("language_model.lm_head."):
            k = "lm_head." + k[len("language_model.lm_head."):]
        out[k] = v
    return out


def mtp_weights(text_config: dict, seed: int) -> dict:
    """A Qwen3.5 multi-token-prediction head in HF layout (``mtp.*``), random weights.

    fc: Linear(2h -> h) over [norm(embedding of t+1); norm(hidden at t)], then
    ``mtp_num_hidden_layers`` full-attention decoder layers, then a final norm; the
    backbone's lm_head produces the logits.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

    mx.random.seed(seed + 1)
    args = TextModelArgs.from_dict({**text_config, "full_attention_interval": 1})
    h = args.hidden_size
    head = {
        "fc.weight": nn.Linear(2 * h, h, bias=False).weight,
        "pre_fc_norm_embedding.weight": mx.ones((h,)) + 0.1 * mx.random.normal((h,)),
        "pre_fc_norm_hidden.weight": mx.ones((h,)) + 0.1 * mx.random.normal((h,)),
        "norm.weight": mx.ones((h,)) + 0.1 * mx.random.normal((h,)),
    }
    for i in range(text_config["mtp_num_hidden_layers"]):
        layer = DecoderLayer(args, layer_idx=args.full_attention_interval - 1)
        for k, v in tree_flatten(layer.parameters()):
            head[f"layers.{i}.{k}"] = v
    out = {}
    for k, v in head.items():
        if any(("." + k).endswith(s) for s in _QWEN_ZERO_CENTRED_NORMS) and v.ndim == 1:
            v = v - 1.0
        out["mtp." + k] = v
    mx.eval(out)
    return out


def _write_qwen3_5(path: Path, ids: dict, *, seed, mtp_layers, dtype, max_position_embeddings, sizes, **_):
    text_config = qwen3_5_text_config(ids, mtp_layers=mtp_layers,
                                      max_position_embeddings=max_position_embeddings, sizes=sizes)
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": False,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "torch_dtype": dtype,
    }
    _, weights = _init_model("qwen3_5", config, seed)
    hf = qwen3_5_to_hf(weights)
    if mtp_layers > 0:
        hf.update(mtp_weights(text_config, seed))
    _write_config(path, config)
    _save(path, hf, dtype)


def _write_qwen3_5_vl(path: Path, ids: dict, **kw):
    from .vlm_factory import write_qwen3_5_vl

    write_qwen3_5_vl(path, ids, **kw)


_WRITERS: dict[str, Callable] = {
    "llama": _write_llama,
    "draft": _write_draft,
    "qwen3_5": _write_qwen3_5,
    "qwen3_5_vl": _write_qwen3_5_vl,
}
