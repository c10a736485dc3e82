"""Sampling parameters: plain, validated data. No mlx here; samplers are built on the owner thread."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .errors import InvalidRequestError

# A logits processor as mlx-lm defines it: (token_ids so far, logits) -> logits.
LogitsProcessor = Callable[[Any, Any], Any]

#: Temperatures below this sample greedily, as vLLM's do: logits divided by a temperature
#: near 1e-38 overflow float32, and the "sample" became a random pick (measured).
GREEDY_BELOW = 1e-5
#: A top_p under this keeps the top token alone, as any top_p under 1/vocab does; raised to it,
#: since mlx-lm's ``apply_top_p`` compares ``top_p`` times the total in float32, and where that
#: rounded to 0 it masked every token and drew at random (measured at 1e-46).
TOP_P_FLOOR = 1e-9
#: Beyond these the scaled logits overflow or vanish in float32 (NaN, then always the last id).
MAX_TEMPERATURE = 1e6
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
#: A repetition_context_size past this (longer than any context) is lowered to it.
MAX_CONTEXT_SIZE = 2**31 - 1
#: The most alternatives ``top_logprobs`` returns per token (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: The sampling fields a checkpoint's generation_config.json may recommend (the ones vLLM
#: reads from it), and their values when neither the request nor the checkpoint sets them.
MODEL_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _as_tuple(value: Any, name: str) -> tuple:
    if value is None:
        return ()
    try:
        return tuple(value)
    except TypeError:
        raise InvalidRequestError(f"SamplingParams.{name}={value!r}: must be a sequence") from None


def _bias_pairs(bias) -> Optional[tuple[tuple[int, Any], ...]]:
    """``logit_bias`` as sorted (token id, bias) pairs; None or {} is None."""
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise InvalidRequestError(f"SamplingParams.logit_bias={bias!r}: must map token ids to biases") from None
    out = {}
    for k, v in pairs:
        if isinstance(k, str) and k.strip().isascii() and k.strip().isdigit():  # not "²" or "٣"
            k = int(k)
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise InvalidRequestError(f"SamplingParams.logit_bias: {k!r} is not a token id (an integer >= 0)")
        out[k] = v
    return tuple(sorted(out.items())) or None


def is_finite_number(v) -> bool:
    """A real int or float that converts to a finite float (``math.isfinite`` raised
    ``OverflowError``, not a typed error, on an int like ``10**400``)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature 0 (or under 1e-5) means greedy; it is at most 1e6, and ``repetition_penalty``
    within [1e-6, 1e6] (float32 overflows beyond); a ``top_p`` under 1e-9 is 1e-9 (the top
    token alone either way). ``stop`` strings are matched on the decoded text, across
    token boundaries, and never emitted. ``seed`` makes sampling reproducible per request:
    the draws depend on the seed only, whatever else shares the batch (the logits they read
    can move in the last bits with the batch size: docs/design.md, "Backends and numerics").
    ``logits_processors`` run on the engine thread.
    """

    max_tokens: int = 256
    #: None in these five: the checkpoint's ``generation_config.json`` value where it has one,
    #: else the value in ``MODEL_DEFAULTS`` (greedy, no filters), filled in by the engine
    #: when it takes the request (``with_defaults``).
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    #: OpenAI's additive penalties, over the whole answer so far and never the prompt, as
    #: OpenAI and vLLM apply them: ``presence_penalty`` once for a token the answer holds,
    #: ``frequency_penalty`` per occurrence; each in [-2, 2] (0, or None, disables it).
    #: ``repetition_context_size`` is the repetition penalty's window only (mlx-lm's).
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    #: A string or a sequence of them; kept as a tuple.
    stop: Union[str, Sequence[str]] = ()
    seed: Optional[int] = None
    #: Speculative decoding for this request: "auto" | "on" | "off" (True/False accepted);
    #: None follows the engine's ``mtp`` option.
    mtp: Union[str, bool, None] = None
    #: SpecPrefill for this request: True forces it (the engine needs a draft), False turns
    #: it off, None applies it to prompts past the engine's threshold.
    specprefill: Optional[bool] = None
    #: Share of prompt chunks SpecPrefill keeps for this request (None: the engine's).
    keep_pct: Optional[float] = None
    #: Per answer token, its log-probability (``RequestOutput.logprobs``), and the
    #: ``top_logprobs`` most likely tokens at its place (0 to 20, as OpenAI's; they need
    #: ``logprobs``). Log-softmax of the logits after the logits processors (a grammar's
    #: mask, the penalties, your own) and the token bans, before temperature and the
    #: top-p/top-k/min-p filters: what the sampler draws from, the same at any temperature
    #: and with MTP on or off.
    logprobs: bool = False
    top_logprobs: int = 0
    #: OpenAI's ``logit_bias``: token id -> a bias in [-100, 100] added to its logit before
    #: the other processors (-100 all but bans a token, 100 all but forces it). A dict (its
    #: keys may be strings of digits, as JSON spells them), kept as sorted (id, bias) pairs.
    #: Ids are checked against the model's vocabulary when the request is made.
    logit_bias: Union[Mapping[Union[int, str], float], Sequence[tuple[int, float]], None] = None
    logits_processors: Sequence[LogitsProcessor] = field(default=(), compare=False)  # kept as a tuple

    def __post_init__(self):
        for name in ("presence_penalty", "frequency_penalty"):  # None is "off", as OpenAI reads null
            if getattr(self, name) is None:
                object.__setattr__(self, name, 0.0)
        # Accept a single string or any sequence for stop; a list for processors.
        if isinstance(self.stop, (Mapping, bytes, bytearray, memoryview)):  # bytes: read as ints, the error named (120,)
            raise InvalidRequestError(f"SamplingParams.stop={self.stop!r}: must be a string or a list of strings")
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "logits_processors", _as_tuple(self.logits_processors, "logits_processors"))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        from .spec.policy import normalize_mode

        object.__setattr__(self, "mtp", normalize_mode(self.mtp, what="SamplingParams.mtp"))
        self.validate()
        if self.temperature is not None and 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_p is not None and self.top_p < TOP_P_FLOOR:
            object.__setattr__(self, "top_p", TOP_P_FLOOR)
        if self.repetition_context_size > MAX_CONTEXT_SIZE:
            # Longer than any context means the whole context; mlx slices take 32-bit
            # indices, and a larger one failed the step of every request in the batch.
            object.__setattr__(self, "repetition_context_size", MAX_CONTEXT_SIZE)

    def validate(self) -> None:
        def bad(name, why):
            raise InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            v = getattr(self, name)
            if v is not None and not is_finite_number(v):
                bad(name, "must be a finite number")
        if self.temperature is not None and not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}]")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.min_p is not None and not 0 <= self.min_p < 1:
            bad("min_p", "must be in [0, 1)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 0):
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        low, high = REPETITION_PENALTY_RANGE
        if self.repetition_penalty is not None and not low <= self.repetition_penalty <= high:
            bad("repetition_penalty", f"must be in [{low:g}, {high:g}] (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_finite_number(v) or not -2 <= v <= 2:
                bad(name, "must be a number in [-2, 2] (0 disables it), as OpenAI's")
        if (not isinstance(self.repetition_context_size, int) or isinstance(self.repetition_context_size, bool)
                or self.repetition_context_size < 1):
            bad("repetition_context_size", "must be an integer >= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not _is_unicode(s) for s in self.stop):  # decoded text never holds one: it could never match
            bad("stop", "must be valid Unicode (a lone surrogate such as '\\ud800' is not)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**64):
            bad("seed", "must be an integer in [0, 2**64) or None")  # mx.random.key takes a uint64
        if self.specprefill is not None and not isinstance(self.specprefill, bool):
            bad("specprefill", "must be True, False or None")
        if self.keep_pct is not None:
            from .options import check_keep_pct

            check_keep_pct(self.keep_pct, "SamplingParams.keep_pct")
        if self.logit_bias is not None and any(not is_finite_number(b) or not -100 <= b <= 100
                                               for _, b in self.logit_bias):
            bad("logit_bias", "biases must be numbers in [-100, 100], as OpenAI's")
        if not isinstance(self.logprobs, bool):
            bad("logprobs", "must be True or False")
        if (not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool)
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            bad("top_logprobs", "needs logprobs=True (as OpenAI's)")
        if any(not callable(p) for p in self.logits_processors):
            bad("logits_processors", "must be callables (tokens, logits) -> logits")

    @property
    def greedy(self) -> bool:
        return not self.temperature  # None samples as the built-in default: greedy

    @property
    def unset(self) -> frozenset:
        """The fields of ``MODEL_DEFAULTS`` this request left to the checkpoint (None)."""
        return frozenset(k for k in MODEL_DEFAULTS if getattr(self, k) is None)

    def with_updates(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    def with_defaults(self, defaults: Mapping[str, Any] = MappingProxyType({})) -> "SamplingParams":
        """Every field left unset filled: the checkpoint's value (``defaults``, from
        ``model_info.sampling_defaults_of``) where it has one, else the built-in one. A
        value the request gave, 0 included, wins. The engine does this when it takes a
        request; the samplers do it for params that reach them unfilled."""
        unset = self.unset
        if not unset:
            return self
        return replace(self, **{k: defaults.get(k, MODEL_DEFAULTS[k]) for k in unset})

    @classmethod
    def coerce(cls, params: "SamplingParams | Mapping[str, Any] | None", **overrides) -> "SamplingParams":
        """Accept SamplingParams, a dict of its fields, or None; apply keyword overrides."""
        if params is None:
            params = cls()
        elif isinstance(params, Mapping):
            unknown = set(params) - set(cls.__dataclass_fields__)
            if unknown:
                raise InvalidRequestError(f"unknown sampling parameters: {sorted(unknown)}")
            params = cls(**params)
        elif not isinstance(params, cls):
            raise InvalidRequestError(f"expected SamplingParams or dict, got {type(params).__name__}")
        overrides = {k: v for k, v in overrides.items() if v is not None}
        return params.with_updates(**overrides) if overrides else params

