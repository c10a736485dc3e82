"""Model loading for the text lane. Called only on the owner thread.

Uses mlx-lm's loader (model classes, sanitize, tokenizer wrapper with the right streaming
detokenizer) and applies the platform dtype policy (float32 on CPU).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from . import _platform
from .errors import ModelLoadError
from .model_info import context_length_of, sampling_defaults_of

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    path: Path
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    eos_token_ids: list[int]
    context_length: int
    vocab_size: int
    model_type: str
    dtype: str
    #: Vision checkpoints: mlx-vlm's model and processor. ``model`` is then the text model
    #: built on the VLM's own arrays (zero copies).
    vlm: Any = None
    processor: Any = None
    #: generation_config.json's sampling values, for requests that leave them unset.
    sampling_defaults: dict = field(default_factory=dict)

    @property
    def supports_images(self) -> bool:
        return self.vlm is not None


def checkpoint_key(model: str | os.PathLike) -> str:
    """One spelling per checkpoint: a local path as its resolved path, a hub id as given.

    Engine.shared keys engines (and their SpecPrefill drafts) on it: two spellings of one
    directory made two engines and loaded the weights twice.
    """
    try:
        path = Path(os.fspath(model)).expanduser()
    except RuntimeError:  # "~user/..." with no such user: a hub id, or a path that is not there
        return str(model)
    return str(path.resolve()) if path.exists() else str(model)


def resolve_model_path(model: Optional[str | os.PathLike]) -> Path:
    """A local checkpoint directory for ``model``: None -> the embedded default model."""
    if model is None:
        from .default_model import default_model_path

        return default_model_path()
    try:
        path = Path(model).expanduser()
    except RuntimeError as exc:  # "~nosuchuser/...": no such home directory
        raise ModelLoadError(f"cannot resolve {model!s}: {exc}") from None
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise ModelLoadError(f"{path} is a file; expected a checkpoint directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model)))
    except Exception as exc:
        raise ModelLoadError(
            f"model {str(model)!r} is neither a local directory nor an available hub repo "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _eos_ids(tokenizer, config: dict) -> list[int]:
    ids = set(tokenizer.eos_token_ids)
    for cfg in (config, config.get("text_config") or {}):
        eos = cfg.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return sorted(ids)


def is_vision_checkpoint(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config.get("vision_config"), dict)


def text_model_from_vlm(vlm, config: dict):
    """mlx-lm's text model for a VLM checkpoint, holding the VLM's own arrays.

    mlx-vlm's language model and mlx-lm's model class for the same ``model_type`` (e.g.
    qwen3_5) use the same parameter names, so ``load_weights(strict=True)`` with the VLM's
    arrays makes every backbone parameter the same ``mx.array`` object: no copy, no extra
    memory. A checkpoint whose names do not line up is a load error, not a silent copy.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    shared = [("language_model." + k, v) for k, v in tree_flatten(vlm.language_model.parameters())]
    _quantize_like(model, vlm, {k for k, _ in shared})
    try:
        model.load_weights(shared, strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"cannot build a text model on this VLM's weights: {exc}") from exc
    model.eval()
    return model


def _quantize_like(model, vlm, names: set[str]) -> None:
    """Quantize the text model's layers as mlx-vlm quantized the VLM's (a quantized
    checkpoint, e.g. 4-bit), each with that layer's own bits, group size and mode, so the
    packed weights, scales and biases are shared as they are."""
    import mlx.nn as nn

    vlm_modules = dict(vlm.named_modules())

    def quantized_as(path: str, module):
        source = vlm_modules.get(path)
        if f"{path}.scales" not in names or source is None or not hasattr(module, "to_quantized"):
            return False
        return {"group_size": source.group_size, "bits": source.bits, "mode": getattr(source, "mode", "affine")}

    nn.quantize(model, class_predicate=quantized_as)


def _load_vision(path: Path):
    import mlx.core as mx
    from mlx_lm.utils import load_config
    from mlx_vlm import load as load_vlm

    vlm, processor = load_vlm(str(path))
    dtype = _platform.compute_dtype()
    if dtype is not None:
        vlm.set_dtype(dtype)
    mx.eval(vlm.parameters())
    # mlx-lm's reading, as the text path's load_model reads it: generation_config.json's
    # eos_token_id list wins (Qwen-VL checkpoints list <|endoftext|> there only, and the
    # VLM ran past it to max_tokens where the same checkpoint served as text stopped).
    config = load_config(path)
    model = text_model_from_vlm(vlm, config)
    if getattr(vlm, "vision_tower", True) is None:
        # mlx-vlm 0.7.10 loads a checkpoint without its vision tower's weights with only a
        # warning, and every image request then failed inside the tower as a bad request.
        # Its language model is whole: serve text, and say why images are refused.
        logger.warning("%s has no vision tower weights: loaded for text only (image requests "
                       "are refused with UnsupportedContentError)", path)
        return None, None, model, config
    return vlm, processor, model, config


def _check_tokenizer(path: Path, tokenizer) -> None:
    """Refuse a tokenizer that reads text as nothing. Without tokenizer.json (a partial
    copy of a checkpoint), transformers 5 builds one of the special tokens alone, without
    a word of warning: every prompt's text encoded to no tokens, and the model answered
    the template's markers."""
    if not tokenizer._tokenizer.encode("Hello, world.", add_special_tokens=False):
        raise ModelLoadError(f"the tokenizer of {path} encodes text to no tokens: its vocabulary file "
                             "(tokenizer.json, or vocab.json and merges.txt) is missing or broken")


def load_text_model(path: Path, *, show_progress: bool = True) -> LoadedModel:
    from tqdm.auto import tqdm
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, load_tokenizer

    # ``disable`` only when told: passed at all, it would override tqdm's own switch, the
    # TQDM_DISABLE environment variable that CI and notebooks set.
    bar = tqdm(total=3, desc=f"Loading {path.name}", unit="step", leave=False,
               **({} if show_progress else {"disable": True}))
    vlm = processor = None
    try:
        bar.set_postfix_str("weights")
        if is_vision_checkpoint(path):
            vlm, processor, model, config = _load_vision(path)
        else:
            model, config = load_model(path)
        bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        _check_tokenizer(path, tokenizer)
        # The engine checks prompts against the context window itself (ContextLengthError);
        # transformers' own check only printed a warning of "indexing errors" that never come.
        tokenizer._tokenizer.model_max_length = sys.maxsize
        bar.update()
        bar.set_postfix_str("dtype")
        dtype = _platform.compute_dtype()
        if dtype is not None and vlm is None:  # a VLM was converted before its text model was built
            model.set_dtype(dtype)
            mx.eval(model.parameters())
        bar.update()
        vocab_size = _vocab_size(model, config)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not load {path}: {type(exc).__name__}: {exc}") from exc
    finally:
        bar.close()
    params = [p for _, p in tree_flatten(model.parameters())]
    loaded = LoadedModel(
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=config,
        eos_token_ids=_eos_ids(tokenizer, config),
        context_length=context_length_of(config),
        vocab_size=vocab_size,
        model_type=config.get("model_type", "unknown"),
        dtype=_compute_dtype(params),
        vlm=vlm,
        processor=processor,
        sampling_defaults=sampling_defaults_of(path),
    )
    logger.info("loaded %s (%s, %s%s, context %d, BLAS %s)", path, loaded.model_type, loaded.dtype,
                _quantization_label(config), loaded.context_length, _platform.active_blas())
    if loaded.sampling_defaults:
        logger.info("sampling defaults from generation_config.json: %s (a request's own values win)",
                    ", ".join(f"{k}={v}" for k, v in loaded.sampling_defaults.items()))
    return loaded


def _vocab_size(model, config: dict) -> int:
    """The vocabulary size from the config, else from the model's own arguments: a config
    without one that mlx-lm fills with the architecture's default loaded, then failed with
    a bare TypeError."""
    text_config = config.get("text_config")
    for v in (config.get("vocab_size"), text_config.get("vocab_size") if isinstance(text_config, dict) else None,
              getattr(getattr(model, "args", None), "vocab_size", None),
              getattr(getattr(getattr(model, "language_model", None), "args", None), "vocab_size", None)):
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    raise ModelLoadError("config.json gives no vocab_size, and the model's arguments none either")


def _compute_dtype(params: list) -> str:
    """The dtype the model computes in: its first floating-point parameter's (a quantized
    model's first parameter is a packed uint32 weight)."""
    import mlx.core as mx

    return next((str(p.dtype) for p in params if mx.issubdtype(p.dtype, mx.floating)), "unknown")


def _quantization_label(config: dict) -> str:
    """", 4-bit affine, group 64" for a quantized checkpoint (mlx-lm's and mlx-vlm's
    ``quantization`` entry; "mixed" where some layers have their own bits), else ""."""
    q = config.get("quantization") or (config.get("text_config") or {}).get("quantization")
    if not isinstance(q, dict) or "bits" not in q:
        return ""
    mixed = " mixed" if any(isinstance(v, dict) for v in q.values()) else ""
    return f", {q['bits']}-bit {q.get('mode', 'affine')}{mixed}, group {q.get('group_size', '?')}"


def load_mtp_head(loaded: LoadedModel, mode: str, drafter: Optional[str] = None):
    """The checkpoint's MTP head for speculative decoding, or None.

    mode "off" skips it. A head that is missing or unusable is an error under "on" and a
    logged fallback to plain decoding under "auto"; never silent. ``drafter`` (the engine
    option ``mtp_drafter``) names mlx-vlm's drafter to read the head from instead; one that
    is not there, is no drafter or does not fit the model is an error under either mode: it
    was asked for by name.
    """
    if mode == "off":
        return None
    from .spec.mtp_head import MTPHeadError, is_drafter, load_mtp_head as _load
    from .spec.verify import supports_verify

    drafter_path = None
    if drafter is not None:
        drafter_path = resolve_model_path(drafter)
        if not is_drafter(drafter_path):
            raise ModelLoadError(f"mtp_drafter {drafter_path}: not an MTP drafter (its config.json "
                                 "needs model_type \"qwen3_5_mtp\", as mlx_vlm.convert --mtp writes it)")
    lm = getattr(loaded.model, "language_model", None)
    try:
        if lm is None or not hasattr(lm, "args"):
            if drafter_path is not None:
                raise MTPHeadError(f"{loaded.model_type}: an MTP drafter was given, but this model "
                                   "has no text backbone a head can draft for")
            head = None
        else:
            head = _load(loaded.path, lm, loaded.config, dtype=_platform.compute_dtype(), drafter=drafter_path)
        if head is not None and not supports_verify(lm):
            raise MTPHeadError(f"{loaded.model_type}: speculative verification is not supported "
                               "for this architecture")
    except MTPHeadError as exc:
        if drafter_path is not None:  # asked for by name: a drafter for another model is a mistake
            raise MTPHeadError(f"{exc} (leave the engine option mtp_drafter out to decode without it)") from exc
        if mode == "on":
            raise MTPHeadError(f"{exc} (mtp='auto' decodes plainly instead)") from exc
        logger.warning("MTP disabled, decoding plainly: %s", exc)
        return None
    if head is None:
        if mode == "on":
            raise MTPHeadError(f"{loaded.path}: mtp='on' but the checkpoint has no MTP head")
        logger.info("%s has no MTP head; decoding without speculation", loaded.path.name)
    else:
        logger.info("MTP head loaded: %d layer(s)", len(head.layers))
    return head
