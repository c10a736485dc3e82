"""LlamaIndex integration for mlx-tandem: ``MLXTandemLLM``."""

try:
    import llama_index.core  # noqa: F401
except ImportError as exc:  # the adapter ships in the base wheel; its framework is an extra
    raise ImportError(
        'llama_index.llms.mlx_tandem needs llama-index-core: pip install "mlx-tandem[llama-index]"') from exc

from llama_index.llms.mlx_tandem.base import MLXTandemLLM

__all__ = ["MLXTandemLLM"]
