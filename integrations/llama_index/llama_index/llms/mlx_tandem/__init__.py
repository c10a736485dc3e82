"""LlamaIndex integration for mlx-tandem: ``MLXTandemLLM``."""

from llama_index.llms.mlx_tandem.base import MLXTandemLLM

__all__ = ["MLXTandemLLM"]
