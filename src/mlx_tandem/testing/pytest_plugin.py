"""Pytest fixtures: each factory model kind is built once per session, offline."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class TinyModels:
    """Builds factory checkpoints lazily, once each, under one session directory."""

    def __init__(self, root):
        self.root = root
        self._paths = {}

    def get(self, kind: str, **kwargs):
        key = (kind, tuple(sorted(kwargs.items())))
        if key not in self._paths:
            from .factory import make_tiny_model

            name = kind + "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()))
            self._paths[key] = make_tiny_model(kind, self.root / name, **kwargs)
        return self._paths[key]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def llama_path(tiny_models):
    return tiny_models.get("llama")


@pytest.fixture(scope="session")
def qwen3_5_path(tiny_models):
    return tiny_models.get("qwen3_5")


@pytest.fixture(scope="session")
def draft_path(tiny_models):
    return tiny_models.get("draft")


@pytest.fixture(scope="session")
def qwen3_5_vl_path(tiny_models):
    return tiny_models.get("qwen3_5_vl")


@pytest.fixture(scope="session")
def qwen3_5_moe_vl_path(tiny_models):
    return tiny_models.get("qwen3_5_moe_vl")


def _distilled(tmp_path_factory, kind: str):
    """A factory model of ``kind`` with its MTP head self-distilled, made once per test run.

    Distilling takes about a minute of CPU, so parallel workers (pytest-xdist) share one
    copy: the first makes it under their common temporary root while the others wait on a
    lock, and the directory appears whole (made beside it, then renamed) or not at all.
    """
    from filelock import FileLock  # dev extra; huggingface_hub depends on it too

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's basetemp sits in the run's shared one
    path = root / f"{kind}-mtp-distilled"
    with FileLock(str(path) + ".lock"):
        if not (path / "config.json").exists():
            import shutil

            from .factory import make_tiny_model
            from .mtp_distill import distill_mtp_head

            partial = root / f"{kind}-mtp-distilled.partial"
            shutil.rmtree(partial, ignore_errors=True)
            make_tiny_model(kind, partial, seed=0, mtp_layers=1)
            distill_mtp_head(partial, n_prompts=64, max_tokens=40, steps=250)
            partial.rename(path)
    return path


@pytest.fixture(scope="session")
def qwen3_5_mtp_path(tmp_path_factory):
    """A qwen3_5 factory model whose MTP head is self-distilled on the backbone's greedy
    continuations of ``mtp_distill.default_prompts(64)``: drafts for those prompts are
    mostly accepted, drafts for other prompts mostly rejected."""
    return _distilled(tmp_path_factory, "qwen3_5")


@pytest.fixture(scope="session")
def qwen3_5_moe_mtp_path(tmp_path_factory):
    """The mixture-of-experts factory VLM (experts fused as Qwen3.5-MoE checkpoints store
    them, the MTP head's too), its head self-distilled as ``qwen3_5_mtp_path``'s is."""
    return _distilled(tmp_path_factory, "qwen3_5_moe_vl")
