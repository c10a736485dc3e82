"""One adapter call's settings: model-level defaults merged with per-call keyword arguments.

Both adapters (LangChain ``ChatMLX``, LlamaIndex ``MLXTandemLLM``) have the same fields and
accept the same per-call keywords, so the merge lives here once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .errors import InvalidRequestError
from .params import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size",
                   "presence_penalty", "frequency_penalty", "seed", "mtp", "specprefill", "keep_pct",
                   "logprobs", "top_logprobs", "logit_bias")
CHAT_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "reasoning")


@dataclass(frozen=True)
class CallSettings:
    params: SamplingParams
    options: dict  # keyword options for Engine.chat / open_chat_stream
    timeout: Optional[float]


def merge_stops(*lists: Optional[Sequence[str]]) -> list[str]:
    """The union of stop lists, in order; a lone string is one stop (as OpenAI's ``stop``
    and SamplingParams take it), never its characters."""
    out: list[str] = []
    for stops in lists:
        if stops is not None and not isinstance(stops, str) and (
                isinstance(stops, Mapping) or not isinstance(stops, Iterable)):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {type(stops).__name__}")
        for s in [stops] if isinstance(stops, str) else stops or []:
            if s not in out:  # SamplingParams checks each is a non-empty string
                out.append(s)
    return out


def resolve_call(defaults: Any, kwargs: dict, *, owner: str, stop: Optional[Sequence[str]] = None) -> CallSettings:
    """Merge ``defaults`` (an object with the adapters' field names) with ``kwargs``.

    Per-call values win; stop strings are the union; template kwargs are merged. Any keyword
    left over raises TypeError naming ``owner``: a misspelt option is never ignored.
    """
    kwargs = dict(kwargs)
    params: dict[str, Any] = {k: kwargs.pop(k, getattr(defaults, k)) for k in SAMPLING_FIELDS}
    # None is the default (SamplingParams'), as LangChain's and LlamaIndex's providers read it.
    params = {k: v for k, v in params.items() if v is not None}
    params["stop"] = merge_stops(defaults.stop, stop, kwargs.pop("stop", None))
    max_tokens = kwargs.pop("max_tokens", defaults.max_tokens)
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    options = {k: kwargs.pop(k) for k in CHAT_OPTIONS if k in kwargs}
    options.setdefault("reasoning", defaults.reasoning)
    extra_template_kwargs = kwargs.pop("chat_template_kwargs", None) or {}
    if not isinstance(extra_template_kwargs, Mapping):
        raise InvalidRequestError(
            f"chat_template_kwargs must be a dict, got {type(extra_template_kwargs).__name__}")
    template_kwargs = {**defaults.chat_template_kwargs, **extra_template_kwargs}
    if template_kwargs:
        options["template_kwargs"] = template_kwargs
    timeout = kwargs.pop("timeout", defaults.timeout)
    if kwargs:
        raise TypeError(f"{owner} got unexpected keyword arguments {sorted(kwargs)}")
    return CallSettings(SamplingParams(**params), options, timeout)


def pin_checkpoint(model: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """``(model, its checkpoint now)``: an adapter fixes a relative directory when it is made,
    as ``Engine`` does. Its engine is made on the first call, and a relative path then
    followed the working directory to another model (a review)."""
    from .model_loader import checkpoint_key

    return model, (None if model is None else checkpoint_key(model))


def pinned_checkpoint(model: Optional[str], pinned: tuple[Optional[str], Optional[str]]) -> Optional[str]:
    """What to give ``Engine.shared``: the pinned checkpoint, unless ``model`` was changed since."""
    given, key = pinned
    return key if model is not None and model == given else model


def model_name_alias(fields: Any) -> Any:
    """Constructor input with ``model_name`` read as ``model``, before validation, and a
    path object as its text (``Engine`` takes a ``pathlib.Path``; the adapters' string
    field refused one with a pydantic error).

    ``model_name`` is how LangChain (ChatOpenAI's alias) and llama-index-llms-mlx spell the
    model; on both adapters it is a read-only property, so it cannot be a field alias.
    """
    if not isinstance(fields, dict):
        return fields
    fields = {k: os.fspath(v) if k in ("model", "model_name") and isinstance(v, os.PathLike) else v
              for k, v in fields.items()}
    if "model_name" not in fields:
        return fields
    name = fields.pop("model_name")
    if fields.get("model") not in (None, name):
        raise ValueError(f"model={fields['model']!r} and model_name={name!r} disagree; pass one")
    fields["model"] = name
    return fields
