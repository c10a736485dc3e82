"""The LlamaIndex conformance suite on MLXTandemLLM, offline, on two factory models."""

from __future__ import annotations

from llama_index.llms.mlx_tandem import MLXTandemLLM
from mlx_tandem.errors import UnsupportedContentError

from .conformance import LLMConformanceTests
from .conftest import PATHS


class _MLXTandem(LLMConformanceTests):
    kind = ""
    unsupported_content_error = UnsupportedContentError

    def make_llm(self, **kwargs) -> MLXTandemLLM:
        return MLXTandemLLM(model=PATHS[self.kind], engine_options={"show_progress": False}, **kwargs)


class TestQwen35(_MLXTandem):
    """Hybrid attention + GatedDeltaNet model, thinking template, Qwen tool calls."""

    kind = "qwen3_5"


class TestLlama(_MLXTandem):
    """Plain attention model with the same template family."""

    kind = "llama"
