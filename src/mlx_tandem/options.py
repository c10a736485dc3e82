"""Engine options: validated once, hashable so that ``Engine.shared`` can key on them."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional

from .errors import InvalidRequestError

MAX_SPECPREFILL_CHUNK = 65536
MAX_SPECPREFILL_LOOKAHEAD = 64


def check_keep_pct(v, what: str) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
        raise InvalidRequestError(f"{what}={v!r}: must be a number in (0, 1]")


@dataclass(frozen=True)
class EngineOptions:
    #: Most requests decoding together in one forward step.
    max_batch_size: int = 32
    #: Most requests prefilled together in one forward step.
    prefill_batch_size: int = 8
    #: Prompt tokens per prefill chunk; decode steps of other requests run between chunks.
    prefill_step_size: int = 512
    #: Context window; defaults to the model config's max_position_embeddings.
    max_model_len: Optional[int] = None
    #: Requests allowed to wait for a batch slot; beyond that, submissions are refused.
    max_waiting: int = 4096
    #: Bytes the caches of running requests may reserve together; a request waits while its
    #: batch would not fit. None: derived at load, ``memory_fraction`` of the device's memory
    #: less what is in use (weights) and ``prefix_cache_bytes``.
    request_memory_bytes: Optional[int] = None
    #: Share of the device's memory the engine plans to use when it derives the budget above.
    memory_fraction: float = 0.9
    #: When idle and a request arrives, wait this long for more before the first step.
    coalesce_ms: float = 5.0
    #: Show a progress bar while loading.
    show_progress: bool = True
    #: Under tool_choice="auto", hold a call the model opens to the request's tools and their
    #: JSON schemas (a lazy grammar; see tool_call_grammar.py). Off: calls are free text.
    constrain_tool_calls: bool = True
    #: Speculative decoding with the checkpoint's MTP head: "auto" (speculate when the
    #: measured cost says it pays), "on", or "off". Requests can override it.
    mtp: str = "auto"
    #: Draft tokens per speculative step (1-3).
    mtp_depth: int = 2
    #: mlx-vlm's standalone MTP drafter for the model (what ``mlx_vlm.convert --mtp``
    #: writes): a directory or hub id. None: the checkpoint's own head, else a drafter in
    #: ``<model>-mtp`` beside a local model.
    mtp_drafter: Optional[str] = None
    #: Let image parts be fetched from http(s) URLs (off: a prompt must not make the
    #: engine fetch arbitrary URLs; inline data, bytes and local paths always work).
    allow_remote_images: bool = False
    #: Largest image accepted, in pixels (width x height); larger ones fail their request.
    max_image_pixels: int = 4096 * 4096
    #: Bytes of prompt-cache snapshots kept for reuse (system prompts, earlier turns,
    #: finished answers); 0 turns the prefix cache off.
    prefix_cache_bytes: int = 1 << 30
    #: Bytes of the vision lane's snapshots (prompts with images: earlier turns, answers
    #: asked again); None: a quarter of ``prefix_cache_bytes`` on a vision checkpoint. 0 turns
    #: it off, and image prompts then prefill several at a time (lanes/vision_cache.py).
    vision_prefix_cache_bytes: Optional[int] = None
    #: Shortest prefix worth storing or reusing, in tokens.
    prefix_cache_min_tokens: int = 32
    #: A request whose prompt shares a prefix that a running request is about to store (one
    #: system prompt, several requests at once) waits for that snapshot instead of
    #: prefilling the same tokens beside it. Off: each prefills its own copy.
    prefix_cache_wait_for_prefill: bool = True
    #: Also snapshot the conversation through its last assistant message once a second
    #: request shares it (few-shot examples written as messages, one conversation fanned
    #: out to several last questions). Off: only system prompts, turns and answers.
    prefix_cache_history: bool = True
    #: Also snapshot where a prompt stops sharing the tokens of a stored prompt, or of those
    #: in prefill or queued beside it (a hybrid model's cache cannot be cut back: questions
    #: about one document in one message). Off: only the points the chat template marks.
    prefix_cache_shared: bool = True
    #: SpecPrefill draft: a checkpoint with the target's tokenizer (a small model). None
    #: turns SpecPrefill off. Long prompts are then scored by the draft and the target
    #: prefills only their important chunks (lossy: the answer may differ from a full prefill).
    specprefill_draft: Optional[str] = None
    #: Uncached prompt tokens, past the system prompt or shared few-shot examples (always
    #: prefilled whole), from which SpecPrefill applies (requests can force it on/off).
    specprefill_threshold: int = 8192
    #: Share of the prompt's chunks the target prefills (first and last chunks always kept).
    specprefill_keep_pct: float = 0.2
    #: Tokens per chunk that SpecPrefill keeps or drops as a whole (at most 65536).
    specprefill_chunk_size: int = 32
    #: Draft decode steps whose attention scores the prompt (at most 64: they run as one
    #: step of the engine thread, and every other request waits for them).
    specprefill_lookahead: int = 8

    def __post_init__(self):
        for name in ("max_batch_size", "prefill_batch_size", "prefill_step_size", "max_waiting", "max_image_pixels"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidRequestError(f"engine option {name}={v!r}: must be an integer >= 1")
        for name in ("specprefill_threshold", "specprefill_chunk_size", "specprefill_lookahead"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidRequestError(f"engine option {name}={v!r}: must be an integer >= 1")
        # Past these a value only does harm (an audit): a lookahead of 20,000 steps held every
        # other request for 30 s, and one past the memory budget turned SpecPrefill off
        # unseen; a chunk past int64 failed each request deep in numpy.
        for name, top in (("specprefill_chunk_size", MAX_SPECPREFILL_CHUNK),
                          ("specprefill_lookahead", MAX_SPECPREFILL_LOOKAHEAD)):
            if getattr(self, name) > top:
                raise InvalidRequestError(f"engine option {name}={getattr(self, name)!r}: must be at most {top}")
        v = self.request_memory_bytes
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise InvalidRequestError(f"engine option request_memory_bytes={v!r}: must be None or an integer >= 1")
        check_keep_pct(self.memory_fraction, "engine option memory_fraction")
        check_keep_pct(self.specprefill_keep_pct, "engine option specprefill_keep_pct")
        if self.specprefill_draft is not None:
            # A local draft as its resolved path: Engine.shared keys on the options, and two
            # spellings of one directory made two engines.
            object.__setattr__(self, "specprefill_draft", _draft_path(self.specprefill_draft, "specprefill_draft"))
        if self.mtp_drafter is not None:
            object.__setattr__(self, "mtp_drafter", _draft_path(self.mtp_drafter, "mtp_drafter"))
        for name in ("prefix_cache_bytes", "prefix_cache_min_tokens", "vision_prefix_cache_bytes"):
            v = getattr(self, name)
            if v is None and name == "vision_prefix_cache_bytes":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                none = " (or None)" if name == "vision_prefix_cache_bytes" else ""
                raise InvalidRequestError(f"engine option {name}={v!r}: must be an integer >= 0{none}")
        for name in ("constrain_tool_calls", "show_progress", "allow_remote_images", "prefix_cache_wait_for_prefill",
                     "prefix_cache_history", "prefix_cache_shared"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"engine option {name}={getattr(self, name)!r}: must be True or False")
        if not isinstance(self.coalesce_ms, (int, float)) or isinstance(self.coalesce_ms, bool) \
                or not 0 <= self.coalesce_ms <= 1000:
            raise InvalidRequestError(f"engine option coalesce_ms={self.coalesce_ms!r}: must be in [0, 1000]")
        from .spec.policy import normalize_mode

        object.__setattr__(self, "mtp", normalize_mode(self.mtp, what="engine option mtp") or "auto")
        if type(self.mtp_depth) is not int or self.mtp_depth not in (1, 2, 3):  # 2.0 == 2, but range(2.0) fails
            raise InvalidRequestError(f"engine option mtp_depth={self.mtp_depth!r}: must be 1, 2 or 3")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise InvalidRequestError(f"engine option max_model_len={self.max_model_len!r}: must be an integer >= 2")

    @property
    def vision_cache_bytes(self) -> int:
        """``vision_prefix_cache_bytes``, None resolved."""
        v = self.vision_prefix_cache_bytes
        return self.prefix_cache_bytes // 4 if v is None else v

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineOptions":
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise InvalidRequestError(f"unknown engine options {sorted(unknown)}; known: {sorted(known)}")
        return cls(**kwargs)


def _draft_path(model, name: str) -> str:
    """A draft checkpoint as a string: a local directory as its resolved path, else as given."""
    if not isinstance(model, (str, os.PathLike)) or (isinstance(model, str) and not model.strip()):
        # An empty string was the working directory (Path(""))
        raise InvalidRequestError(f"engine option {name}={model!r}: must be a path or hub id")
    from .model_loader import checkpoint_key

    return checkpoint_key(model)
