"""The LlamaIndex conformance suite on MLXTandemLLM, offline: two factory models and the
embedded demo model."""

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


class TestDemoModel(_MLXTandem):
    """The embedded demo model (``MLXTandemLLM()`` with no model): it follows simple tool
    requests, so unforced tool calling is a real test here."""

    def make_llm(self, **kwargs) -> MLXTandemLLM:
        return MLXTandemLLM(engine_options={"show_progress": False}, **kwargs)

    def test_tool_calling_unforced(self):
        super().test_tool_calling_unforced()
