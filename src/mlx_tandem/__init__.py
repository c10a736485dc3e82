"""mlx-tandem: one in-process MLX inference engine, fast under concurrency."""

from . import _platform  # noqa: F401  - must run before anything imports mlx

from .engine import AsyncStream, Engine, SyncStream
from .errors import (
    ConstraintError,
    ContextLengthError,
    EngineClosedError,
    EngineStepError,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
    RequestTimeoutError,
    RequestTooLargeError,
    TandemError,
    TemplateError,
    UnsupportedContentError,
)
from .messages import normalize_messages
from .options import EngineOptions
from .outputs import RequestOutput, StreamDelta, Usage
from .params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "AsyncStream",
    "ConstraintError",
    "ContextLengthError",
    "Engine",
    "EngineClosedError",
    "EngineOptions",
    "EngineStepError",
    "InvalidRequestError",
    "ModelLoadError",
    "QueueFullError",
    "RequestOutput",
    "RequestTimeoutError",
    "RequestTooLargeError",
    "SamplingParams",
    "StreamDelta",
    "SyncStream",
    "TandemError",
    "TemplateError",
    "UnsupportedContentError",
    "Usage",
    "normalize_messages",
]
