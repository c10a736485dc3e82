"""LangChain integration for mlx-tandem: ``ChatMLX``, a native in-process MLX chat model."""

from langchain_mlx_tandem.chat_models import ChatMLX

__all__ = ["ChatMLX"]
