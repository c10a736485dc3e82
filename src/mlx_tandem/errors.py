"""The one exception hierarchy of mlx-tandem. Every error a caller can see is a TandemError."""

from __future__ import annotations

import copy


class TandemError(Exception):
    """Base class of every error raised by mlx-tandem."""


class InvalidRequestError(TandemError, ValueError):
    """The request itself is wrong: bad parameters, bad messages, bad content."""


class TemplateError(InvalidRequestError):
    """The chat template could not render these messages."""


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit in the model's context window. ``prompt_tokens``: its
    tokens; for a request with images refused before they were expanded (its text alone
    already too long), the tokens without the images' own, a floor (the message says so)."""

    def __init__(self, message: str, *, prompt_tokens: int, max_context: int):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


class RequestTooLargeError(InvalidRequestError):
    """The request's cache (its prompt plus ``max_tokens``) alone exceeds the engine's
    memory budget for running requests, so it could never be admitted. Lower ``max_tokens``
    or raise the engine option ``request_memory_bytes``."""


class UnsupportedContentError(InvalidRequestError):
    """The request carries content this model cannot take (e.g. an image on a text model)."""


class ConstraintError(InvalidRequestError):
    """A grammar, JSON schema, tool choice or response format is invalid or cannot be enforced."""


class ModelLoadError(TandemError):
    """The model could not be loaded."""


class EngineClosedError(TandemError):
    """The engine was closed before or while the request ran."""


class QueueFullError(TandemError):
    """Every batch slot is taken and ``max_waiting`` requests already wait: the engine is
    overloaded, the request is fine. Retry later (or raise ``max_waiting``)."""


class RequestTimeoutError(TandemError, TimeoutError):
    """The request ran past its ``timeout``: it was cancelled and its batch slot freed. Also a
    built-in ``TimeoutError``, so ``except TimeoutError`` catches it as well."""


class EngineStepError(TandemError):
    """A forward step failed unexpectedly; the requests in it were failed, the engine recovered."""


def own_copy(exc: BaseException) -> BaseException:
    """One caller's own copy of an error that fails several requests at once (a failed step,
    a closed engine, a failed load). Raised as one object in several callers, it gathered
    each caller's frames in one traceback: every caller's locals stayed reachable from
    every other's error. The copy keeps the type, message, attributes and cause."""
    try:
        new = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an __init__ that takes keywords only
        new = BaseException.__new__(type(exc))
        new.args = exc.args
        new.__dict__.update(vars(exc))
    new.__cause__, new.__context__ = exc.__cause__, exc.__context__
    new.__suppress_context__ = exc.__suppress_context__
    new.__traceback__ = None
    return new
