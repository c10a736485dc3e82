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
from typing import Any, Callable, Sequence

from .. import _platform  # noqa: F401  - before mlx
from .tokenizer import write_tokenizer

KINDS = ("llama", "qwen3_5", "qwen3_5_vl", "qwen3_5_moe_vl", "draft")

_LLAMA_DEFAULTS = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2)
_DRAFT_DEFAULTS = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                       num_attention_heads=2, num_key_value_heads=1)
_QWEN3_5_DEFAULTS = dict(
    hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    full_attention_interval=2,
)
# Qwen3.5 (like Qwen3-Next) stores these RMSNorm weights zero-centred (the model uses 1 + w).
# (linear_attn.norm, a gated RMSNorm, is not; nor are vision LayerNorms.)
_QWEN_ZERO_CENTRED_NORMS = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
    ".q_norm.weight", ".k_norm.weight",
)


def make_tiny_model(kind: str, path: str | Path, *, seed: int = 0, mtp_layers: int = 1,
                    vocab_size: int = 2048, max_position_embeddings: int = 4096,
                    dtype: str = "float32", tokenizer_texts: Sequence[str] = (),
                    word_consistent_tokenizer: bool = False, **sizes: Any) -> Path:
    """Write a complete checkpoint directory for ``kind`` at ``path`` and return it.

    ``sizes`` override the architecture's dimensions (hidden_size, num_hidden_layers, ...).
    ``tokenizer_texts`` are trained on beside the stdlib corpus, and
    ``word_consistent_tokenizer`` learns merges within words only (the demo-model trainer's
    ``--word-consistent-tokenizer``; see ``tokenizer.WORD_CONSISTENT_TRAIN_REGEX``).
    The directory is written to a temporary sibling and renamed, so a reader never sees a
    half-written checkpoint.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        ids = write_tokenizer(tmp, vocab_size=vocab_size, model_max_length=max_position_embeddings,
                              extra_texts=tokenizer_texts, word_consistent=word_consistent_tokenizer)
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
def randomize_vectors(params: dict) -> dict:
    """Jitter 1-D parameters (norms, biases, A_log, dt_bias), deterministically.

    Matrices keep mlx's default init. Norm weights stay in [0.5, 1.5] so storing them
    zero-centred is exact ((w - 1) + 1 == w), and a loader that mishandles norms is caught.
    Uses the global mx.random state: seed it first.
    """
    import mlx.core as mx

    out = {}
    for k in sorted(params):
        v = params[k]
        if v.ndim == 1:
            if k.endswith("A_log"):
                v = mx.log(mx.random.uniform(1.0, 16.0, v.shape))
            elif k.endswith("weight") or k.endswith("dt_bias"):
                v = mx.clip(1.0 + 0.1 * mx.random.normal(v.shape), 0.5, 1.5)
            else:
                v = 0.02 * mx.random.normal(v.shape)
        out[k] = v
    mx.eval(out)
    return out


def _init_model(module_name: str, config: dict, seed: int) -> dict:
    """Seeded random parameters of mlx-lm's model class for ``config`` (mlx layout)."""
    import copy

    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    arch = importlib.import_module(f"mlx_lm.models.{module_name}")
    model = arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(config)))
    return randomize_vectors(dict(tree_flatten(model.parameters())))


def _save(path: Path, weights: dict, dtype: str) -> None:
    import mlx.core as mx

    dt = getattr(mx, dtype)
    weights = {k: v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.eval(weights)
    # "pt": these are HF-layout tensors. "mlx" would tell mlx-vlm's MTP splitter that the
    # norms are already shifted (mlx-vlm 0.7.10), and it would load them wrong.
    mx.save_safetensors(str(path / "model.safetensors"), dict(sorted(weights.items())),
                        metadata={"format": "pt"})


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
    # ``sliding_window``: even layers are sliding-window attention (mlx-lm's llama reads
    # ``layer_types``; their caches are RotatingKVCaches, as gemma3's and gpt_oss's are).
    sizes = dict(sizes)
    window = sizes.pop("sliding_window", None)
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
    if window is not None:
        config["sliding_window"] = int(window)
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
    weights = _init_model("llama", config, seed)
    _write_config(path, config)
    _save(path, weights, dtype)


def _write_draft(path: Path, ids: dict, **kw):
    _write_llama(path, ids, defaults=_DRAFT_DEFAULTS, **kw)


# --------------------------------------------------------------------------- qwen3_5
def qwen3_5_text_config(ids: dict, *, mtp_layers: int, max_position_embeddings: int, sizes: dict) -> dict:
    dims = _sizes(_QWEN3_5_DEFAULTS, sizes)
    n, interval = dims["num_hidden_layers"], dims["full_attention_interval"]
    rotary = int(dims["head_dim"] * 0.25)
    if rotary % 2 or dims["linear_conv_kernel_dim"] < 2:
        raise ValueError("head_dim * 0.25 must be even and linear_conv_kernel_dim >= 2")
    half = rotary // 2
    return {
        "model_type": "qwen3_5_text",
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)],
        "hidden_act": "silu",
        "attn_output_gate": True,
        "vocab_size": ids["__vocab_size__"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "max_position_embeddings": max_position_embeddings,
        # mrope_section sums to rotary_dim / 2 = head_dim * partial_rotary_factor / 2.
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25,
                            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
                            "mrope_interleaved": True},
        "mtp_num_hidden_layers": mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        **dims,
    }


def qwen3_5_to_hf(weights: dict, prefix: str = "model.language_model.") -> dict:
    """Invert mlx-lm's Qwen3.5 sanitize: HF keys, (C, 1, K) conv1d, zero-centred norms."""
    out = {}
    for k, v in weights.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)
        if k.startswith("language_model.") and v.ndim == 1 and "linear_attn" not in k \
                and any(k.endswith(s) for s in _QWEN_ZERO_CENTRED_NORMS):
            v = v - 1.0
        if k.startswith("language_model.model."):
            k = prefix + k[len("language_model.model."):]
        elif k.startswith("language_model.lm_head."):
            k = "lm_head." + k[len("language_model.lm_head."):]
        out[k] = v
    return out


def mtp_weights(text_config: dict, seed: int) -> dict:
    """A Qwen3.5 multi-token-prediction head in HF layout (``mtp.*``), random weights.

    Built from mlx-vlm's own MTP drafter class, so the keys and shapes are exactly what
    ``mlx_vlm``'s ``load_drafter(kind="mtp")`` reads: fc over [norm(embed(t+1)); norm(h_t)],
    ``mtp_num_hidden_layers`` full-attention layers, a final norm (norms zero-centred).
    """
    import copy

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Model as MTPModel
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig as MTPConfig

    mx.random.seed(seed + 1)
    draft = MTPModel(MTPConfig.from_dict(
        {"model_type": "qwen3_5_mtp", "text_config": copy.deepcopy(text_config)}))
    from ..spec.mtp_head import is_zero_centred_norm

    params = randomize_vectors(dict(tree_flatten(draft.parameters())))
    out = {}
    for k, v in params.items():
        out["mtp." + k] = v - 1.0 if is_zero_centred_norm(k, v) else v
    mx.eval(out)
    return out


def _write_qwen3_5(path: Path, ids: dict, *, seed, mtp_layers, dtype, max_position_embeddings, sizes, **_):
    text_config = qwen3_5_text_config(ids, mtp_layers=mtp_layers,
                                      max_position_embeddings=max_position_embeddings, sizes=sizes)
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": ids["__vocab_size__"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": False,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "torch_dtype": dtype,
    }
    hf = qwen3_5_to_hf(_init_model("qwen3_5", config, seed))
    if mtp_layers > 0:
        hf.update(mtp_weights(text_config, seed))
    _write_config(path, config)
    _save(path, hf, dtype)


def _write_qwen3_5_vl(path: Path, ids: dict, **kw):
    from .vlm_factory import write_qwen3_5_vl

    write_qwen3_5_vl(path, ids, **kw)


def _write_qwen3_5_moe_vl(path: Path, ids: dict, **kw):
    from .vlm_factory import write_qwen3_5_vl

    write_qwen3_5_vl(path, ids, moe=True, **kw)


_WRITERS: dict[str, Callable] = {
    "llama": _write_llama,
    "draft": _write_draft,
    "qwen3_5": _write_qwen3_5,
    "qwen3_5_vl": _write_qwen3_5_vl,
    "qwen3_5_moe_vl": _write_qwen3_5_moe_vl,
}
