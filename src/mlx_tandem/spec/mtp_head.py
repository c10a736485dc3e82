"""The checkpoint's multi-token-prediction head, as an mlx module over mlx-lm layers.

Qwen3.5 / Qwen3-Next checkpoints ship ``mtp.*`` weights: from the backbone's final
(normed) hidden state at position t and the embedding of token t+1, one or more
full-attention decoder layers predict token t+2 through the backbone's own ``lm_head``.

Why not mlx-vlm's ``Qwen3_5MTPDraftModel``: its layers are mlx-vlm's (m-RoPE position ids,
mlx-vlm cache classes) and it keeps one batch-wide cache inside the drafter object, which
cannot follow rows that join and leave a continuous batch. Here the head is built from
mlx-lm's ``qwen3_5.DecoderLayer`` (the same class the backbone uses), so its KV cache is an
mlx-lm ``BatchKVCache`` that merges, filters and extends with the rest of the row's cache.
The parameter names are the HF ones, so the checkpoint loads with ``strict=True``; the
weight conventions (which norms are zero-centred) follow mlx-vlm 0.7.10's MTP sanitize.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3_5 import DecoderLayer

from ..errors import ModelLoadError

logger = logging.getLogger(__name__)

#: Key prefixes an MTP head is stored under: HF checkpoints use ``mtp.``; VLM conversions
#: nest it under the language model.
MTP_PREFIXES = ("mtp.", "language_model.mtp.", "model.language_model.mtp.", "model.mtp.")

#: RMSNorm weights that HF Qwen3.5 stores zero-centred (the model uses 1 + w).
MTP_NORM_SUFFIXES = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
    "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
)


#: Tensor names of a quantized head: mlx's affine (``.scales``, ``.biases``), fused experts'
#: (``gate_up_proj_scales``), FP8 (``weight_scale_inv``) and NVFP4 (``weight_scale_2``,
#: ``weight_global_scale``) checkpoints.
QUANTIZED_SUFFIXES = (".scales", ".biases", "_scales", "weight_scale_inv", "weight_scale_2", "weight_global_scale")


def is_quantized(keys) -> bool:
    return any(k.endswith(QUANTIZED_SUFFIXES) for k in keys)


class MTPHeadError(ModelLoadError):
    """The checkpoint's MTP head is missing pieces, has wrong shapes, or cannot be used."""


def is_zero_centred_norm(key: str, value) -> bool:
    return key.endswith(MTP_NORM_SUFFIXES) and value.ndim == 1


class MTPHead(nn.Module):
    """fc([norm(embed(t+1)); norm(h_t)]) -> full-attention layer(s) -> norm."""

    def __init__(self, text_args, num_layers: int):
        super().__init__()
        hidden = text_args.hidden_size
        eps = text_args.rms_norm_eps
        # Every MTP layer is a full-attention layer: interval 1 makes DecoderLayer pick attention.
        layer_args = dataclasses.replace(text_args, full_attention_interval=1)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.layers = [DecoderLayer(layer_args, layer_idx=0) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, token_embeddings: mx.array, hidden: mx.array, cache=None) -> mx.array:
        h = mx.concatenate(
            [self.pre_fc_norm_embedding(token_embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1)
        h = self.fc(h)
        cache = cache if cache is not None else [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask=create_attention_mask(h, c), cache=c)
        return self.norm(h)


def _checkpoint_files(path: Path) -> list[tuple[dict, str]]:
    """Each safetensors file's arrays and the ``format`` its metadata names ("" if none)."""
    files = []
    for f in sorted(path.glob("*.safetensors")):
        arrays, metadata = mx.load(str(f), return_metadata=True)
        files.append((arrays, (metadata or {}).get("format") or ""))
    return files


def _hf_layout(weights) -> bool:
    # The same test mlx-lm's qwen3_5 sanitize uses: HF checkpoints keep conv1d as (C, 1, K).
    return any("conv1d.weight" in k and v.ndim == 3 and v.shape[-1] != 1 for k, v in weights)


def _head_is_zero_centred(head_files: list[tuple[dict, str]]) -> bool:
    """Are the head's norms stored as HF stores them (zero-centred: the model uses 1 + w)?

    Decided by the files that hold the head, as mlx-vlm 0.7.10 decides for its drafters
    (``mtp_split._is_mlx_safetensors``): mlx's converters write ``"format": "mlx"`` with the
    norms already shifted; anything else is HF's. Not by the backbone: a head added back
    beside a converted (quantized) backbone is usually HF's own tensors in a file of their
    own, and reading it by the backbone's layout loaded every norm off by one, so the head
    drafted nothing. A file without a format that holds the backbone's conv1d too is read
    by its layout (mlx-lm's qwen3_5 test), since it was written with the backbone.
    """
    formats = {fmt for _, fmt in head_files if fmt}
    if formats:
        return formats != {"mlx"}
    conv = [(k, v) for arrays, _ in head_files for k, v in arrays.items() if "conv1d.weight" in k]
    return _hf_layout(conv) if conv else True


_PER_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _switch_layout(weights: dict) -> dict:
    """The head's MoE experts as mlx-lm's ``SwitchGLU`` holds them (``mlp.switch_mlp.*``).

    A mixture-of-experts checkpoint (Qwen3.5-MoE, Qwen3.6-35B-A3B) stores its MTP layer's
    experts as the backbone's: fused, ``experts.gate_up_proj`` (E, 2I, H) and
    ``experts.down_proj``; Qwen3-Next one tensor per expert and projection. mlx-lm 0.32's
    and mlx-vlm 0.7.10's model sanitizes convert only the backbone's layers, and mlx-vlm's
    own MTP drafter converts its head as done here (with mlx-vlm's helpers for the fused
    form). Without it the head did not load (``mtp="auto"`` decoded plainly, "on" failed).
    """
    from mlx_vlm.models.switch_layers import move_expert_projection, split_expert_projection

    for key in [k for k in weights if k.endswith(".experts.gate_up_proj")]:
        prefix = key[: -len(".experts.gate_up_proj")]
        split_expert_projection(weights, key, [f"{prefix}.switch_mlp.gate_proj", f"{prefix}.switch_mlp.up_proj"])
        move_expert_projection(weights, f"{prefix}.experts.down_proj", f"{prefix}.switch_mlp.down_proj")
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in weights:
        if m := _PER_EXPERT.fullmatch(key):
            groups.setdefault((m[1], m[3]), {})[int(m[2])] = key
    for (prefix, proj), keys in groups.items():
        if sorted(keys) != list(range(len(keys))):
            raise MTPHeadError(f"MTP experts of {prefix} are not numbered 0..{len(keys) - 1}")
        weights[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([weights.pop(keys[e]) for e in sorted(keys)])
    return weights


#: mlx-vlm's Qwen3.5 MTP drafter: the ``model_type`` its splitter writes (0.7.10).
DRAFTER_MODEL_TYPE = "qwen3_5_mtp"


def is_drafter(path: Path) -> bool:
    """Whether ``path`` holds mlx-vlm's standalone Qwen3.5 MTP drafter.

    ``mlx_vlm.convert --mtp`` (0.7.10) leaves ``mtp.*`` out of the converted model, as every
    converter does, and writes the head on its own: the tensors without their ``mtp.``
    prefix, the norms shifted, a mixture of experts' experts as ``switch_mlp`` (its
    ``Qwen3_5MTPDraftModel.sanitize``), ``"format": "mlx"``, and a config of ``model_type``
    "qwen3_5_mtp".
    """
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == DRAFTER_MODEL_TYPE


def drafter_beside(path: Path) -> Optional[Path]:
    """mlx-vlm's drafter for the converted model at ``path``, if where ``convert --mtp``
    puts it by default: ``<mlx-path>-mtp``. (Elsewhere, ``--mtp-output`` or a hub repo: the
    engine option ``mtp_drafter`` names it.)"""
    drafter = path.parent / f"{path.name}-mtp"
    return drafter if is_drafter(drafter) else None


def load_mtp_head(path: Path, text_model, config: dict, dtype=None,
                  drafter: Optional[Path] = None) -> Optional[MTPHead]:
    """The MTP head of the checkpoint at ``path``, or None when it has none.

    The head is read from mlx-vlm's drafter ``drafter`` when given (the caller checked
    ``is_drafter``), else from the checkpoint, else from a drafter beside it.

    Raises MTPHeadError when the config declares a head whose weights are missing or do not
    fit, and for quantized heads (upstream found quantized MTP heads accept ~0% of drafts;
    we would rather refuse than silently draft garbage).
    """
    text_config = config.get("text_config") or config
    declared = int(text_config.get("mtp_num_hidden_layers") or 0)
    files = [] if drafter is not None else _checkpoint_files(path)
    found: dict[str, mx.array] = {}
    head_files = []
    for arrays, fmt in files:
        holds_head = False
        for key, value in arrays.items():
            prefix = next((p for p in MTP_PREFIXES if key.startswith(p)), None)
            if prefix is not None:
                found[key[len(prefix):]] = value
                holds_head = True
        if holds_head:
            head_files.append((arrays, fmt))
    where = path
    if not found and (drafter := drafter or drafter_beside(path)) is not None:
        # Every tensor of a drafter's files is the head's, under the head's own names.
        head_files = _checkpoint_files(drafter)
        found = {key: value for arrays, _ in head_files for key, value in arrays.items()}
        where = drafter
        if not found:
            raise MTPHeadError(f"{drafter}: the MTP drafter holds no weights")
        logger.info("MTP head read from mlx-vlm's drafter: %s", drafter)
    if not found:
        if declared:
            raise MTPHeadError(f"{path}: config declares mtp_num_hidden_layers={declared} but the "
                               "checkpoint has no mtp.* weights (converters such as mlx_lm.convert leave them "
                               "out; `mlx-tandem-add-mtp-head ORIGINAL_DIR CONVERTED_DIR` puts the "
                               "original's head back; the drafter mlx_vlm.convert --mtp writes is read "
                               "from `<model>-mtp` beside a local model, or where the engine option "
                               "mtp_drafter names it)")
        return None
    if is_quantized(found):
        raise MTPHeadError(f"{where}: the MTP head is quantized; dequantize it (quantized heads "
                           "accept almost no drafts), or put the original's head back with "
                           "`mlx-tandem-add-mtp-head ORIGINAL_DIR CONVERTED_DIR`")
    layer_ids = {int(k.split(".")[1]) for k in found if k.startswith("layers.")}
    num_layers = declared or (max(layer_ids) + 1 if layer_ids else 0)
    if num_layers < 1 or layer_ids != set(range(num_layers)):
        raise MTPHeadError(f"{where}: MTP layers {sorted(layer_ids)} do not match "
                           f"mtp_num_hidden_layers={declared}")
    zero_centred = _head_is_zero_centred(head_files)
    del files
    if zero_centred:
        found = {k: (v + 1.0 if is_zero_centred_norm(k, v) else v) for k, v in found.items()}
    head = MTPHead(text_model.args, num_layers)
    try:
        found = _switch_layout(found)
        head.load_weights(list(found.items()), strict=True)
    except ValueError as exc:
        raise MTPHeadError(f"{where}: the MTP head does not fit this model: {exc}") from exc
    if dtype is not None:
        head.set_dtype(dtype)
    mx.eval(head.parameters())
    head.eval()
    return head

