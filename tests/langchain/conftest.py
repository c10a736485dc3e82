"""Factory-model paths for the LangChain tests (the standard suites read them from class properties)."""

from __future__ import annotations

import pytest

PATHS: dict[str, str] = {}


@pytest.fixture(scope="session", autouse=True)
def _langchain_model_paths(qwen3_5_path, llama_path):
    PATHS["qwen3_5"] = str(qwen3_5_path)
    PATHS["llama"] = str(llama_path)
    return PATHS
