"""Shared fixtures: factory models (built once per session) and one engine per kind."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

import mlx_tandem  # noqa: E402,F401  - loads OpenBLAS before anything imports mlx
from mlx_tandem import Engine  # noqa: E402

pytest_plugins = ["mlx_tandem.testing.pytest_plugin"]

KINDS = ["llama", "qwen3_5"]


@pytest.fixture(scope="session")
async def llama_engine(llama_path):
    engine = Engine(llama_path, show_progress=False)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture(scope="session")
async def qwen3_5_engine(qwen3_5_path):
    engine = Engine(qwen3_5_path, show_progress=False)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def engine(kind, request):
    return request.getfixturevalue(f"{kind}_engine")


@pytest.fixture
def model_path(kind, request):
    return request.getfixturevalue(f"{kind}_path")
