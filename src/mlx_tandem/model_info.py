"""What a model can do, read from its checkpoint files without loading the weights.

Adapters need this at construction time (LlamaIndex's ``metadata``, LangChain's
``profile``): a query engine sizes its prompts from the context window before the first
call, and loading a model just to answer that would defeat lazy loading. Once the engine
has loaded the model, the loaded tokenizer's answer (mlx-lm's own inference of the tool
parser and think markers) replaces the file heuristics.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import InvalidRequestError, ModelLoadError
from .params import MODEL_DEFAULTS, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Optional[Path]
    model_type: str
    context_length: int
    default_max_tokens: int
    supports_tools: bool
    supports_reasoning: bool
    #: Images reach the model (a vision checkpoint: requests with images take the vision lane).
    supports_images: bool = False
    #: What the checkpoint's generation_config.json recommends (``sampling_defaults_of``):
    #: a request that leaves these fields unset samples with them.
    sampling_defaults: Optional[dict] = field(default=None, hash=False, compare=False)


def context_length_of(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    return 4096


def local_checkpoint(model: Optional[str | Path]) -> Optional[Path]:
    """The checkpoint directory if it is already on disk (no download, no build)."""
    if model is None:
        from .default_model import default_model_path

        return default_model_path(build=False)
    try:
        path = Path(model).expanduser()
    except RuntimeError:  # "~nosuchuser/...": no such home directory, so not on disk
        return None
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:
        return None


def _template_text(path: Path) -> str:
    text = ""
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        f = path / name
        if f.is_file():
            text += f.read_text(errors="ignore")
    return text


def sampling_defaults_of(path: Path, *, warn: bool = True) -> dict:
    """The sampling values the checkpoint's ``generation_config.json`` recommends, for the
    fields a request leaves unset (``SamplingParams.with_defaults``).

    As vLLM reads it (``generation_config="auto"``, its default): temperature, top_p,
    top_k, min_p and repetition_penalty where the file sets them. Qwen3 and Qwen3.5 ship
    temperature 0.6, top_p 0.95, top_k 20 and warn that greedy decoding repeats itself in
    thinking mode; a request, or an adapter field, that sets a value keeps it (0 is
    greedy). ``"do_sample": false`` means greedy, as transformers reads it, so nothing is
    taken. ``top_k`` -1 (vLLM's "off") is 0, and a whole float is an int. A value
    SamplingParams refuses is left out, with a warning (the loader's, once) if ``warn``.
    """
    f = path / "generation_config.json"
    try:
        config = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, UnicodeDecodeError, ValueError):
        config = {}
    if not isinstance(config, dict) or config.get("do_sample") in (False, 0):
        return {}
    out = {}
    for key in MODEL_DEFAULTS:
        value = config.get(key)
        if value is None:
            continue
        if key == "top_k" and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = 0 if value == -1 else int(value) if float(value).is_integer() else value
        try:
            SamplingParams(**{key: value})
        except InvalidRequestError as exc:
            if warn:
                logger.warning("%s: %s is not used: %s", f, key, exc)
            continue
        out[key] = value
    return out


def read_model_info(path: Path, *, name: str, max_model_len: Optional[int] = None) -> ModelInfo:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # as the loader would refuse it
        raise ModelLoadError(f"{path} is not a checkpoint directory: its config.json cannot be read "
                             f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a checkpoint directory: its config.json is not an object")
    template = _template_text(path)
    return ModelInfo(
        name=name,
        path=path,
        model_type=config.get("model_type", "unknown"),
        context_length=max_model_len or context_length_of(config),
        default_max_tokens=SamplingParams().max_tokens,
        # The same cue mlx-lm uses to pick a tool parser: the template renders tools and
        # wraps calls in a marker.
        supports_tools="tools" in template and "tool_call" in template,
        supports_reasoning="<think>" in template or "enable_thinking" in template,
        supports_images=isinstance(config.get("vision_config"), dict),
        sampling_defaults=sampling_defaults_of(path, warn=False),
    )
