"""The embedded default model: what ``Engine()`` with no model argument runs.

Until a trained model ships with the package, this is a random-weight ``qwen3_5`` factory
model written on first use into the user's cache directory (its words are noise; it
exercises the real engine paths: hybrid caches, batching, streaming).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tandem-default-qwen3_5-random-v1"
DEFAULT_MODEL_SIZES = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           linear_num_value_heads=4, linear_num_key_heads=2,
                           linear_key_head_dim=32, linear_value_head_dim=32)
IS_RANDOM = True  # the demo says so plainly

_lock = threading.Lock()


def cache_dir() -> Path:
    root = os.environ.get("MLX_TANDEM_HOME")
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-tandem"


def default_model_path() -> Path:
    """The default checkpoint directory, built (once, atomically) if missing."""
    path = cache_dir() / "models" / DEFAULT_MODEL_NAME
    with _lock:
        if not (path / "config.json").exists():
            from .testing.factory import make_tiny_model

            logger.info("building the default model at %s (first use)", path)
            make_tiny_model("qwen3_5", path, seed=0, **DEFAULT_MODEL_SIZES)
    return path
