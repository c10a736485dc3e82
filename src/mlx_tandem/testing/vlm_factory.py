"""The ``qwen3_5_vl`` factory kind: a Qwen3.5 vision-language checkpoint for mlx-vlm.

Same text backbone and MTP head as ``qwen3_5``, plus a tiny vision tower and the
processor files mlx-vlm's Qwen3-VL processor reads. Loadable by ``mlx_vlm.load`` (both
lanes) and ``mlx_lm.load`` (text lane; it drops the vision keys).

``qwen3_5_moe_vl`` is the mixture-of-experts variant (Qwen3.5-MoE, Qwen3.6-35B-A3B): every
layer's MLP, the MTP head's too, is a router over experts plus a shared expert, stored as
those checkpoints store it (``experts.gate_up_proj`` fused, ``experts.down_proj``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from .factory import _save, _sizes, _write_config, mtp_weights, qwen3_5_text_config, randomize_vectors

_VISION_DEFAULTS = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2)
_LM_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                    "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


def qwen3_5_vl_config(ids: dict, *, mtp_layers: int, max_position_embeddings: int, sizes: dict,
                      dtype: str) -> dict:
    vision_sizes = {k[len("vision_"):]: v for k, v in sizes.items() if k.startswith("vision_")}
    text_sizes = {k: v for k, v in sizes.items() if not k.startswith("vision_")}
    text = qwen3_5_text_config(ids, mtp_layers=mtp_layers,
                               max_position_embeddings=max_position_embeddings, sizes=text_sizes)
    vision = {
        "model_type": "qwen3_5",
        **_sizes(_VISION_DEFAULTS, vision_sizes),
        "out_hidden_size": text["hidden_size"],
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "in_channels": 3,
        "num_position_embeddings": 64,  # a perfect square (an 8x8 grid of learned positions)
        "hidden_act": "gelu_pytorch_tanh",
        "deepstack_visual_indexes": [],  # mlx-vlm's qwen3_5 requires it empty
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        # Explicit: without it mlx-vlm appends the real Qwen <|im_end|> id (248046).
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "tie_word_embeddings": False,
        "vocab_size": ids["__vocab_size__"],
        "dtype": dtype,
    }


def _write_processor_files(path: Path) -> None:
    image = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        # Pixel budget (min_pixels / max_pixels): keeps test images to a few tokens.
        "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
    }
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    video.update(video_processor_type="Qwen3VLVideoProcessor", fps=2, min_frames=2, max_frames=8,
                 size={"shortest_edge": 32 * 32 * 2, "longest_edge": 128 * 128 * 8})
    for name, obj in (("preprocessor_config.json", image), ("video_preprocessor_config.json", video),
                      ("processor_config.json", {"processor_class": "Qwen3VLProcessor"})):
        (path / name).write_text(json.dumps(obj, indent=2))


def _vlm_to_hf(params: dict) -> dict:
    """Invert mlx-vlm's qwen3_5 sanitize (language model and vision tower)."""
    hf = {}
    for k, v in params.items():
        if k.startswith("language_model.model."):
            hk = "model.language_model." + k[len("language_model.model."):]
        elif k == "language_model.lm_head.weight":
            hk = "lm_head.weight"
        elif k.startswith("vision_tower."):
            hk = "model.visual." + k[len("vision_tower."):]
        else:
            raise KeyError(f"unexpected parameter {k}")
        if k.endswith("conv1d.weight"):  # mlx (C, K, 1) -> torch (C, 1, K)
            v = v.swapaxes(1, 2)
        if k.endswith("patch_embed.proj.weight"):  # mlx (O, T, H, W, C) -> torch (O, C, T, H, W)
            v = v.transpose(0, 4, 1, 2, 3)
        if k.startswith("language_model.") and any(k.endswith(s) for s in _LM_ZERO_CENTRED):
            v = v - 1.0
        hf[hk] = v
    return hf


_MOE_DEFAULTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=32)


def qwen3_5_moe_vl_config(ids: dict, *, sizes: dict, **kw) -> dict:
    moe = _sizes(_MOE_DEFAULTS, {k: v for k, v in sizes.items() if k in _MOE_DEFAULTS})
    config = qwen3_5_vl_config(ids, sizes={k: v for k, v in sizes.items() if k not in _MOE_DEFAULTS}, **kw)
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
    config["vision_config"]["model_type"] = "qwen3_5_moe"
    text = config["text_config"]
    del text["intermediate_size"]  # every MLP is a mixture of experts
    text.update(model_type="qwen3_5_moe_text", decoder_sparse_step=1, mlp_only_layers=[],
                router_aux_loss_coef=0.001, **moe)
    return config


def fused_experts(weights: dict) -> dict:
    """mlx's ``switch_mlp.{gate,up,down}_proj`` as Qwen3.5-MoE checkpoints store them:
    ``experts.gate_up_proj`` (gate rows, then up rows) and ``experts.down_proj``."""
    import mlx.core as mx

    out = {}
    for k, v in weights.items():
        if k.endswith(".switch_mlp.gate_proj.weight"):
            prefix = k[: -len(".switch_mlp.gate_proj.weight")]
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate(
                [v, weights[f"{prefix}.switch_mlp.up_proj.weight"]], axis=-2)
            out[f"{prefix}.experts.down_proj"] = weights[f"{prefix}.switch_mlp.down_proj.weight"]
        elif ".switch_mlp." not in k:
            out[k] = v
    return out


def write_qwen3_5_vl(path: Path, ids: dict, *, seed, mtp_layers, dtype, max_position_embeddings, sizes,
                     moe: bool = False, **_):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    make_config = qwen3_5_moe_vl_config if moe else qwen3_5_vl_config
    config = make_config(ids, mtp_layers=mtp_layers, max_position_embeddings=max_position_embeddings,
                         sizes=sizes, dtype=dtype)
    mx.random.seed(seed)
    cfg = copy.deepcopy(config)  # mlx-vlm's configs rewrite rope_parameters in place
    arch, _ = get_model_and_args(cfg)
    model_config = update_module_configs(arch.ModelConfig.from_dict(cfg), arch, cfg, ["text", "vision"])
    params = randomize_vectors(dict(tree_flatten(arch.Model(model_config).parameters())))
    hf = _vlm_to_hf(params)
    if mtp_layers > 0:
        hf.update(mtp_weights(config["text_config"], seed))
    if moe:
        hf = fused_experts(hf)
    _write_config(path, config)
    _write_processor_files(path)
    _save(path, hf, dtype)
