"""The vision lane: continuous batching of requests with images over mlx-vlm's BatchGenerator.

Requests without media never come here; they run on the text lane, on a text model that
shares this VLM's arrays. Here each request's images go through the checkpoint's processor
(image-pad expansion, pixel values, m-RoPE positions) and the VLM's embedding step when it
is admitted; mlx-vlm's generator then prefills and decodes the rows together. With a
VisionPrefixCache (vision_cache.py), a prompt that extends an earlier one with the same
images starts from its snapshot.

mlx-vlm 0.7.10's generator takes one sampler for the whole batch. Per-request sampling is
therefore a last logits processor that draws from the request's own sampler and leaves only
the drawn token finite, so the generator's argmax returns it. Owner thread only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterable, Optional, Sequence

import mlx.core as mx

from ..errors import ContextLengthError, InvalidRequestError
from ..request import Request
from ..samplers import make_request_processors, make_request_sampler
from .base import LaneStepStats, RowIds, TokenEvent, attach_logprobs, fail_errored
from .vision_cache import VisionPrefixCache, expanded_points, media_end

logger = logging.getLogger(__name__)


class _SampleAsProcessor:
    """A request's sampler as a logits processor: keeps only the drawn token."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __call__(self, tokens, logits):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tok = self.sampler(logprobs).reshape(-1, 1)
        keep = mx.arange(logits.shape[-1])[None] == tok
        return mx.where(keep, mx.zeros_like(logits), mx.array(-float("inf"), logits.dtype))


class _Distributions:
    """The last processor before the draw, for a row that asked for logprobs: keeps the
    distribution each token is drawn from (mlx-vlm's generator hands its responses no
    per-row one, since the draw runs inside the processors), oldest first."""

    def __init__(self, top: int):
        self.top = top
        self.pending: deque = deque()

    def __call__(self, tokens, logits):
        logits32 = logits.astype(mx.float32)  # a bf16 checkpoint's log-softmax rounded by up to 0.06 (review h167)
        self.pending.append((logits32 - mx.logsumexp(logits32, axis=-1, keepdims=True)).reshape(-1))
        return logits

    def take(self):
        return self.pending.popleft() if self.pending else None


class _WholePrompt:
    """A row's logits processors, given the whole prompt in their token context. mlx-vlm
    passes a restored row only the rest of its prompt: ``restored`` (set when the cache
    restores the row, before its first forward) puts the restored tokens back in front, so
    a repetition penalty, the answer penalties and a user's processor see what they see
    without the cache (found by a review: a restored row's repetition penalty changed)."""

    def __init__(self, processors: list):
        self.processors = processors
        self.restored: Optional[mx.array] = None

    def __call__(self, tokens, logits):
        if self.restored is not None:
            tokens = mx.concatenate([self.restored, mx.array(tokens, dtype=mx.int32)])
        for p in self.processors:
            logits = p(tokens, logits)
        return logits


def expand_images(vlm, processor, images: list, text: str):
    """The prompt's ids with each image expanded to its tokens, and the processor's outputs
    the embedding step needs. Owner thread: the processor returns mlx arrays."""
    from mlx_vlm.utils import prepare_inputs

    try:
        inputs = prepare_inputs(processor, images=images, prompts=[text],
                                image_token_index=getattr(vlm.config, "image_token_index", None),
                                add_special_tokens=False)
    except Exception as exc:  # noqa: BLE001 - the processor's errors are this request's
        raise InvalidRequestError(f"the image processor rejected this request: {exc}") from exc
    return inputs["input_ids"][0].tolist(), inputs


class VisionLane:
    name = "vision"

    def __init__(self, vlm, processor, *, eos_token_ids: Sequence[int], max_batch_size: int,
                 prefill_batch_size: int, prefill_step_size: int, context_length: int,
                 prefix_cache: Optional[VisionPrefixCache] = None):
        from mlx_vlm.apc import multimodal_token_ids_from_config

        self.vlm = vlm
        self.processor = processor
        self._eos = set(int(t) for t in eos_token_ids)
        self._context_length = context_length
        self.prefix_cache = prefix_cache
        self._media_ids = multimodal_token_ids_from_config(vlm.config)
        self._prefilling: dict[int, Request] = {}  # uid -> its request, until its first token
        self._contexts: dict[int, _WholePrompt] = {}  # uid -> its processors, until then too
        self._dists: dict[int, _Distributions] = {}  # uid -> rows that asked for logprobs
        if prefix_cache is not None:
            prefix_cache.on_restore = self._on_restore
        # mlx-vlm 0.7.10 starts a prefill only when completion_batch_size minus the decoding
        # rows is at least prefill_batch_size, so with completion == max_batch_size a new image
        # request waited for the batch to drain. The core already caps this lane's rows at
        # max_batch_size, so the generator's own cap is raised to admit whenever a row is free.
        prefill = self._prefill_batch_size = min(prefill_batch_size, max_batch_size)
        self._opts = dict(completion_batch_size=max_batch_size + prefill - 1, prefill_batch_size=prefill,
                          prefill_step_size=prefill_step_size, compute_logprobs=False)
        self._gen = self._new_generator()
        self._rows = RowIds()
        self._errors: list[tuple[str, BaseException]] = []
        self._counters = (0, 0.0, 0)
        self._staged: Optional[tuple[str, dict]] = None  # prepare's processor outputs, for add

    def _new_generator(self):
        from mlx_vlm.generate.ar import BatchGenerator

        cache = self.prefix_cache
        gen = BatchGenerator(self.vlm.language_model, self.processor, stop_tokens=self._eos,
                             apc_manager=cache.manager if cache is not None else None, **self._opts)
        if cache is not None and not cache.attach(gen):
            gen.close()
            cache.close()
            self.prefix_cache = None
            return self._new_generator()
        return gen

    @property
    def num_active(self) -> int:
        return len(self._rows)

    def has_work(self) -> bool:
        return bool(self._rows)

    def defer(self, request: Request) -> bool:  # no prefix cache here: nothing to wait for
        return False

    def prepare(self, request: Request) -> None:
        """Expand the images so admission measures the real prompt. The processor's outputs
        wait here for ``add``, which comes next unless the request does not fit and waits;
        only the encoder is expensive, and it runs once, in ``add``."""
        media = request.extra["media"]
        if media.get("expanded"):
            return
        ids, inputs = expand_images(self.vlm, self.processor, media["images"], media["text"])
        # Refused before the encoder runs: an oversized image costs no encoder pass that
        # every other row of the lane would wait for.
        if len(ids) >= self._context_length:
            raise ContextLengthError(
                f"with its images the prompt has {len(ids)} tokens; the context window is "
                f"{self._context_length}", prompt_tokens=len(ids), max_context=self._context_length)
        if self.prefix_cache is not None and request.cache_points:
            request.cache_points = [(n, "turn") for n in expanded_points(
                request.prompt_ids, ids, [n for n, _ in request.cache_points], self._media_ids)]
        request.prompt_ids = ids  # usage and admission count the expanded image tokens
        request.max_tokens = min(request.max_tokens, self._context_length - len(ids))
        media["expanded"] = True
        self._staged = (request.request_id, inputs)

    def _embed(self, inputs, features_key: Optional[str] = None) -> dict:
        """The vision encoder's pass: the prompt's embeddings and the model's extra inputs
        (the images' features kept from an earlier request where the cache has them)."""
        ids = inputs["input_ids"]
        data = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        kept = self.prefix_cache.embedding_kwargs(features_key) if features_key is not None else {}
        emb = self.vlm.get_input_embeddings(ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"),
                                            **data, **kept)
        return {**data, **{k: v for k, v in emb.to_dict().items() if v is not None}}

    def add(self, request: Request, waiting: Iterable[Request] = ()) -> None:
        self.prepare(request)
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == request.request_id:
            inputs = staged[1]
        else:  # it waited for memory: the processor again (cheap), never the encoder twice
            media = request.extra["media"]
            _, inputs = expand_images(self.vlm, self.processor, media["images"], media["text"])
        ids = request.prompt_ids
        key = features_key = None
        if self.prefix_cache is not None:
            key, features_key = self.prefix_cache.keys(inputs)
        kwargs = self._embed(inputs, features_key)
        if key is not None:
            kwargs["_apc_semantic_hash"] = key
            points = [n for n, _ in request.cache_points]
            end = media_end(ids, self._media_ids)
            if 0 < end < len(ids) - 1 and self.prefix_cache.seen_before(key):
                points.append(end)  # questions about these images part here (vision_cache.py)
            self.prefix_cache.expect(ids, points)
        for p in request.processors:  # grammars plan their closing within the real budget
            if hasattr(p, "cap_budget"):
                p.cap_budget(request.max_tokens)
        rid = request.request_id
        processors = make_request_processors(
            request.params, on_error=lambda exc, rid=rid: self._errors.append((rid, exc)),
            extra=request.processors, prompt_tokens=len(ids))
        sampler = make_request_sampler(request.params)
        dists = _Distributions(request.params.top_logprobs) if request.params.logprobs else None
        if dists is not None:
            processors.append(dists)
        if sampler is not None:
            processors.append(_SampleAsProcessor(sampler))
        whole = _WholePrompt(processors) if processors and self.prefix_cache is not None else None
        (uid,) = self._gen.insert([ids], [request.max_tokens], prompt_kwargs=[kwargs],
                                  logits_processors=[[whole] if whole is not None else processors])
        self._rows.add(uid, rid)
        self._prefilling[uid] = request
        if dists is not None:
            self._dists[uid] = dists
        if whole is not None:
            self._contexts[uid] = whole
        if key is not None:
            self.prefix_cache.track(uid, key)

    def _on_restore(self, uid: int, tokens: int) -> None:
        """mlx-vlm restores the row's first ``tokens`` prompt tokens: its token context will
        hold only the rest of the prompt (_WholePrompt)."""
        whole, request = self._contexts.get(uid), self._prefilling.get(uid)
        if whole is not None and request is not None:
            whole.restored = mx.array(request.prompt_ids[:tokens], dtype=mx.int32)

    def _prefilled(self, uid: int) -> None:
        """The row's prompt is in: its restored length is known, its points are stored."""
        self._contexts.pop(uid, None)
        request = self._prefilling.pop(uid, None)
        cache = self.prefix_cache
        if request is None or cache is None:
            return
        request.cached_tokens = cache.restored.pop(uid, 0)
        ids = request.prompt_ids
        if not any(r.prompt_ids == ids for r in self._prefilling.values()):
            cache.forget(ids)

    def discard_tokens(self, n: int) -> None:  # no speculation here: nothing counts drafts
        pass

    def scoring_tokens(self, request_id: str) -> tuple[int, int]:  # no SpecPrefill on images
        return 0, 0

    def prefill_plainly(self, request: Request) -> bool:  # never given SpecPrefill
        return False

    def remove(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            uid = self._rows.pop(rid)
            if uid is not None:
                self._dists.pop(uid, None)
                self._gen.remove(uid)
                self._prefilled(uid)
                if self.prefix_cache is not None:
                    self.prefix_cache.untrack(uid)

    def step(self) -> tuple[list[TokenEvent], LaneStepStats]:
        cache = self.prefix_cache
        if cache is not None:  # a prompt that may be restored prefills alone (vision_cache.py)
            waiting = [s[0] for s in self._gen.unprocessed_prompts]  # not yet picked, in queue order
            self._gen.prefill_batch_size = cache.prefill_batch_size(waiting, self._prefill_batch_size)
        tic = time.perf_counter()
        _, responses = self._gen.next()
        elapsed = time.perf_counter() - tic
        events: dict[str, TokenEvent] = {}
        asked: list = []  # rows that asked for logprobs (base.attach_logprobs)
        for r in responses:
            rid = self._rows.request_id(r.uid)
            if rid is None:
                continue
            if r.uid in self._prefilling:
                self._prefilled(r.uid)
            ev = events.setdefault(rid, TokenEvent(rid, []))
            ev.tokens.append(int(r.token))
            dists = self._dists.get(r.uid)
            if dists is not None:
                asked.append((ev, dists.take(), int(r.token), dists.top, ()))  # bans: processors here
            if r.finish_reason is not None:
                ev.finish_reason = "stop" if r.finish_reason == "stop" else "length"
                self._rows.pop(rid)
                self._dists.pop(r.uid, None)
                if cache is not None:  # what it stores on finishing is in the cache now
                    cache.untrack(r.uid)
        attach_logprobs(asked)
        out = list(events.values())
        out = fail_errored(out, self._errors, self.remove)
        s = self._gen.stats()
        p_tok, p_time, g_tok = self._counters
        self._counters = (s.prompt_tokens, s.prompt_time, s.generation_tokens)
        prompt_time = s.prompt_time - p_time
        return out, LaneStepStats(prompt_tokens=s.prompt_tokens - p_tok, prompt_time=prompt_time,
                                  generation_tokens=s.generation_tokens - g_tok,
                                  decode_time=max(0.0, elapsed - prompt_time),
                                  batch_size=len({r.uid for r in responses}))

    def vision_prefix_cache_stats(self) -> dict | None:
        return self.prefix_cache.snapshot() if self.prefix_cache is not None else None

    def reset(self) -> list[str]:
        dropped = self._rows.clear()
        self._errors.clear()
        self._staged = None
        self._prefilling.clear()
        self._contexts.clear()
        self._dists.clear()
        if self.prefix_cache is not None:  # a step failed: keep no snapshot it may have half-made
            self.prefix_cache.close()
        self._gen.close()
        self._gen = self._new_generator()
        self._counters = (0, 0.0, 0)
        return dropped

    def close(self) -> None:
        self._gen.close()
        if self.prefix_cache is not None:
            self.prefix_cache.close()
        # A closed lane keeps nothing: the frames of a failed step that a caller's error
        # still holds (the engine loop's own) may name it after the engine closed.
        vars(self).clear()
