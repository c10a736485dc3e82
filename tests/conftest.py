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


# Under pytest-xdist (make test) each file runs whole on one worker, handed out in collection
# order (the Makefile's --no-loadscope-reorder turns off xdist's own reordering, which hands
# out the files with the most tests first). These files take minutes (subprocess training
# runs; the notebooks, one of which runs the quick benchmarks) but hold few tests, so they
# were handed out last and a run ended on one of them with the other worker idle. They go
# first; every other file keeps its place and its tests' order.
_LONG_FILES = ("tests/training/test_train_script.py", "tests/test_notebooks.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return _LONG_FILES.index(path) if path in _LONG_FILES else len(_LONG_FILES)

    items.sort(key=rank)  # stable
