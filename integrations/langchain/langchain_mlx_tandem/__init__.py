"""LangChain integration for mlx-tandem: ``ChatMLX``, a native in-process MLX chat model."""

try:
    import langchain_core  # noqa: F401
except ImportError as exc:  # the adapter ships in the base wheel; its framework is an extra
    raise ImportError('langchain_mlx_tandem needs langchain-core: pip install "mlx-tandem[langchain]"') from exc

from langchain_mlx_tandem.chat_models import ChatMLX

__all__ = ["ChatMLX"]
