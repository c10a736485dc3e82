"""The embedded default model: what ``Engine()``, ``ChatMLX()`` and ``MLXTandemLLM()`` run
when no model is given.

It ships inside the package (``mlx_tandem/models/<name>/``, fp16 safetensors, ~24 MB): a
small Qwen3.5-style hybrid (GatedDeltaNet + attention) with a trained MTP head, trained
offline by ``scripts/train_demo_model.py`` on the dialogues of ``scripts/demo_data.py``
(stdlib Q&A, arithmetic, unit conversion, tool use). See docs/demo_model.md for what it can
and cannot do. Nothing is downloaded.

If the packaged files are missing (a source tree without them), a random-weight factory
model is built in the user's cache instead, with a warning: the engine still works, the
words are noise.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tandem-demo-qwen3_5-v6"
_FALLBACK_NAME = "tandem-default-qwen3_5-random-v1"
_FALLBACK_SIZES = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=32, linear_value_head_dim=32)

_lock = threading.Lock()


def names_default(model) -> bool:
    """``model`` is the name the default model reports (``model_name``, usage metadata) and
    no directory of that name is there: it means the default, so a reported name can be
    passed back as ``model``."""
    return isinstance(model, str) and model == DEFAULT_MODEL_NAME and not Path(model).exists()


def packaged_model_path() -> Path:
    return Path(__file__).resolve().parent / "models" / DEFAULT_MODEL_NAME


def is_packaged() -> bool:
    p = packaged_model_path()
    return (p / "config.json").is_file() and (p / "model.safetensors").is_file()


#: True when the default model is the random fallback (the demo says so plainly).
IS_RANDOM = not is_packaged()


def cache_dir() -> Path:
    root = os.environ.get("MLX_TANDEM_HOME")
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-tandem"


def default_model_path(build: bool = True) -> Path | None:
    """The default checkpoint directory: the packaged demo model, else the random fallback
    (built once, atomically, when ``build``)."""
    if is_packaged():
        return packaged_model_path()
    path = cache_dir() / "models" / _FALLBACK_NAME
    if (path / "config.json").exists():
        return path
    if not build:
        return None
    with _lock:
        if not (path / "config.json").exists():
            from .testing.factory import make_tiny_model

            logger.warning("the packaged demo model is missing; building a random-weight model at %s", path)
            make_tiny_model("qwen3_5", path, seed=0, **_FALLBACK_SIZES)
    return path
