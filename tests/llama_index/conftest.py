"""Factory-model paths for the LlamaIndex tests."""

from __future__ import annotations

import pytest

PATHS: dict[str, str] = {}


@pytest.fixture(scope="session", autouse=True)
def _llama_index_model_paths(qwen3_5_path, llama_path):
    PATHS["qwen3_5"] = str(qwen3_5_path)
    PATHS["llama"] = str(llama_path)
    return PATHS
