"""Engine: the public facade. Async-first API with sync twins; never touches mlx itself.

Front-end work (validation, message normalization, chat rendering, tokenization) runs on
the caller's thread; the request then goes to the EngineCore's owner thread, and results
come back through a per-request sink.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Literal, Mapping, Optional, Sequence, Union, overload

from . import _platform
from .call_spec import CallSpec, deadline_of
from .chat_format import ChatFormat
from .chat_output import ChatOutputParser
from .chat_plan import plan_chat
from .closing import GrammarProcessor
from .constraints import GrammarCompiler, TokenBan, after_reasoning, response_format_constraint
from .tool_call_grammar import LazyToolCallGrammar
from .core import EngineCore
from .fork_guard import inherited_engine_error
from .default_model import DEFAULT_MODEL_NAME, default_model_path, names_default
from .detokenizer import CallMarkers
from .errors import (ConstraintError, ContextLengthError, EngineClosedError, InvalidRequestError, ModelLoadError,
                     UnsupportedContentError, own_copy)
from .media import load_images, media_markers, refuse_media_markers
from .messages import has_media, validate_messages
from .model_info import ModelInfo, local_checkpoint, read_model_info
from .model_loader import LoadedModel, checkpoint_key
from .off_loop import run_off_loop
from .options import EngineOptions
from .outputs import RequestOutput, StreamDelta
from .params import SamplingParams
from .prompt import PromptRenderer, raw_prompt_ids
from .stats import EngineStats
from .streams import AsyncStream, SyncStream
from .teardown import close_at_exit
from .request import AsyncSink, Request, SyncSink, new_request_id

logger = logging.getLogger(__name__)

#: What the chat methods take: OpenAI-style message dicts (TypedDicts too), and sampling
#: parameters as ``SamplingParams`` or a dict of its fields.
ChatMessages = Sequence[Mapping[str, Any]]
ParamsLike = Union[SamplingParams, Mapping[str, Any], None]


def _load_result(core: EngineCore) -> LoadedModel:
    """The loaded model, once loaded. A failed load raises the caller's own copy of its
    error: raised as the one object the core keeps, it gathered the caller's frames (an
    Engine's ``start_sync``), and the core, which the Engine's finalizer holds, then kept
    that Engine alive after the caller dropped it (a review)."""
    error = core.ready.exception()
    if error is not None:
        raise own_copy(error)
    return core.ready.result()


def _model_key(model: Optional[str | Path]) -> str:
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ModelLoadError(
            f"model must be a checkpoint path or hub id (a string or a path), got {type(model).__name__}")
    if isinstance(model, str) and not model.strip():  # Path("") is the working directory
        raise ModelLoadError("model must be a checkpoint path or hub id, got an empty string")
    if model is None or names_default(model):
        return "<default>"
    key = checkpoint_key(model)
    # The default model's own directory (what model_info().path reports) is the default: a
    # caller passing it back got a second engine and a second copy of the weights.
    default = default_model_path(build=False)
    return "<default>" if default is not None and key == str(default.resolve()) else key


class Engine:
    """One model, one owner thread, continuous batching for every caller in the process.

    ``Engine(model)`` is cheap: the model loads on first use or on ``await engine.start()``.
    ``model`` is a checkpoint directory or hub repo id; None means the embedded default model.
    """

    _shared: dict[tuple, "Engine"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, model: Optional[str | Path] = None, **options: Any):
        key = _model_key(model)  # a model argument of the wrong type fails here, typed
        self.options = EngineOptions.from_kwargs(**options)
        # A local directory is fixed now, as its resolved path (what Engine.shared keys on):
        # resolved at load, a relative path followed the working directory to another model.
        default = model is None or names_default(model)
        self._model_arg = None if default else key if key != "<default>" else checkpoint_key(model)
        self._model_name = DEFAULT_MODEL_NAME if default else os.fspath(model)
        self._core: Optional[EngineCore] = None
        self._renderer: Optional[PromptRenderer] = None
        self._format: Optional[ChatFormat] = None
        self._grammar: Optional[GrammarCompiler] = None
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def shared(cls, model: Optional[str | Path] = None, **options: Any) -> "Engine":
        """The process-wide engine for (model, options): adapters share weights through this."""
        opts = EngineOptions.from_kwargs(**options)
        # A display option does not make another engine (the weights loaded twice): the
        # first caller's progress bar setting holds.
        key = (_model_key(model), dataclasses.replace(opts, show_progress=True))
        with cls._shared_lock:
            engine = cls._shared.get(key)
            if engine is None or engine.closed:
                engine = cls(model, **options)
                cls._shared[key] = engine
            return engine

    def _ensure_core(self) -> EngineCore:
        core = self._core
        if core is not None and core.forked():  # before the lock, which a parent thread may hold
            raise inherited_engine_error()
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            if self._core is None:
                core = EngineCore(self._model_arg, self.options)
                core.start()
                self._core = core
                close_at_exit(core)
                # An engine nobody holds any more (not even a stream) is closed: its thread
                # and weights would otherwise live until exit. No join here: the garbage
                # collector may run this on any thread, the owner's included.
                weakref.finalize(self, core.shutdown, 0).atexit = False
            return self._core

    def _on_ready(self, loaded: LoadedModel) -> None:
        if self._renderer is not None:
            return
        # Once, under the lock: callers making their first call together must end with one
        # renderer and a grammar compiler that share its tokenizer lock.
        with self._lock:
            if self._renderer is None:
                self._format = ChatFormat.from_tokenizer(loaded.tokenizer)
                renderer = PromptRenderer(loaded.tokenizer, short_call_ids=self._format.tool_format == "mistral")
                self._grammar = GrammarCompiler(
                    loaded.tokenizer._tokenizer, loaded.vocab_size, loaded.eos_token_ids, lock=renderer.lock)
                self._renderer = renderer

    async def start(self) -> "Engine":
        """Load the model (on the engine thread) if it is not loaded yet."""
        core = self._ensure_core()
        ready = asyncio.wrap_future(core.ready)
        await asyncio.wait([ready])
        ready.exception()  # read here: _load_result raises the caller's own copy
        self._on_ready(_load_result(core))
        return self

    def start_sync(self) -> "Engine":
        self._on_ready(_load_result(self._ensure_core()))
        return self

    async def close(self) -> None:
        await run_off_loop(self.close_sync)

    def close_sync(self) -> None:
        with self._lock:
            self._closed = True
            core = self._core
        if core is not None:
            core.shutdown()
        with Engine._shared_lock:
            for key, engine in list(Engine._shared.items()):
                if engine is self:
                    del Engine._shared[key]

    async def __aenter__(self) -> "Engine":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __enter__(self) -> "Engine":
        return self.start_sync()

    def __exit__(self, *exc) -> None:
        self.close_sync()

    @property
    def closed(self) -> bool:
        """Closed by the caller, or its engine thread ended (a failed load, a crashed loop):
        ``Engine.shared`` then makes a new engine rather than hand out a dead one."""
        core = self._core
        return self._closed or (core is not None and core.closed)

    # ------------------------------------------------------------------ information
    @property
    def loaded(self) -> LoadedModel:
        loaded = _load_result(self._ensure_core())
        self._on_ready(loaded)
        return loaded

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int:
        return self.options.max_model_len or self.loaded.context_length

    @property
    def chat_format(self) -> ChatFormat:
        """Reasoning markers and tool-call syntax of the model's chat template."""
        self.loaded
        return self._format

    @functools.cached_property
    def _think_ids(self) -> Optional[tuple[int, int]]:
        """The reasoning markers' token ids where each is one token (the lazy call grammar
        follows reasoning by them), else None."""
        fmt = self._format
        if not fmt.has_thinking:
            return None
        start, end = (self._renderer.encode(m) for m in (fmt.think_start, fmt.think_end))
        return (start[0], end[0]) if len(start) == len(end) == 1 else None

    @functools.cached_property
    def _call_start_id(self) -> Optional[int]:
        """The special token that is the tool-call start marker, if it is one (see
        ``CallMarkers.call_start_id``)."""
        start = self._format.tool_call_start
        return self._grammar.marker_id(start) if start else None

    @functools.cached_property
    def _media_markers(self) -> tuple[str, ...]:
        return media_markers(self.loaded.processor)

    @property
    def owner_thread(self) -> threading.Thread:
        return self._ensure_core().owner_thread

    @overload
    def model_info(self, *, load: Literal[True] = ...) -> ModelInfo: ...
    @overload
    def model_info(self, *, load: bool) -> Optional[ModelInfo]: ...

    def model_info(self, *, load: bool = True) -> Optional[ModelInfo]:
        """Context window, default output budget, tool and reasoning support.

        Read from the checkpoint files when the model is not loaded yet (no weights are
        loaded for this); from the loaded tokenizer's chat format once it is. A checkpoint
        not on disk yet is fetched/built and loaded, unless ``load=False`` (then None).
        """
        name = self._model_name
        core = self._core
        failed = core is not None and core.ready.done() and core.ready.exception() is not None
        if core is None or not core.ready.done() or failed:
            path = local_checkpoint(self._model_arg)
            if path is not None:
                return read_model_info(path, name=name, max_model_len=self.options.max_model_len)
            if not load:
                return None  # not on disk (a failed load too: load=False never raises its error)
        loaded = self.loaded  # not on disk yet: load (builds/downloads on the owner thread)
        fmt = self.chat_format
        info = read_model_info(loaded.path, name=name, max_model_len=self.options.max_model_len)
        return dataclasses.replace(
            info, context_length=self.context_length, supports_tools=fmt.has_tool_calling,
            supports_reasoning=fmt.has_thinking, supports_images=loaded.supports_images,
            sampling_defaults=dict(loaded.sampling_defaults))  # what requests get, read at load

    def stats(self) -> dict[str, Any]:
        """Counters and rates: requests, running, waiting, max batch size seen, tokens/s, ..."""
        core = self._core
        # Same keys before the first request (all zero) as after.
        out = (core.stats if core is not None else EngineStats()).snapshot()
        out.update(
            # The default model's name until it loads ("None" was the text of no argument).
            model=str(core.model_path or self._model_name) if core is not None else self._model_name,
            loaded=bool(core is not None and core.ready.done() and not core.ready.exception() and not self.closed),
            blas=_platform.active_blas(),
            max_batch_size_option=self.options.max_batch_size,
        )
        return out

    def run_on_owner_thread(self, fn) -> Any:
        """Run ``fn()`` on the engine thread and return its result (blocking).

        The one sanctioned way for extensions and tests to touch mlx state.
        """
        return self._ensure_core().call(fn).result()

    # ------------------------------------------------------------------ front end
    def _make_request(self, spec: CallSpec, sink) -> tuple[Request, Optional[ChatOutputParser]]:
        if spec.request_id is not None and not isinstance(spec.request_id, str):
            raise InvalidRequestError(f"request_id must be a string, got {type(spec.request_id).__name__}")
        # Fields the request left unset sample as the checkpoint recommends (model_info.py).
        params = SamplingParams.coerce(spec.params).with_defaults(self.loaded.sampling_defaults)
        if params.top_k >= self.loaded.vocab_size:
            # Keeps every token, as top_k=0 does (mlx-lm's top-k needs k < vocab, and its
            # failure inside a compiled sampler would fail the whole batch's step).
            params = params.with_updates(top_k=0)
        if params.logit_bias and params.logit_bias[-1][0] >= self.loaded.vocab_size:
            raise InvalidRequestError(f"logit_bias: token id {params.logit_bias[-1][0]} is not in this model's "
                                      f"vocabulary [0, {self.loaded.vocab_size})")
        renderer = self._renderer
        parser = None
        processors: list = []
        lane, media, cache_points, stop_exempt = "text", None, [], None
        starts_in_reasoning = False
        if spec.messages is not None:
            messages = validate_messages(spec.messages)
            if has_media(messages):
                # Routing: media goes to the vision lane, everything else to the text lane
                # (MTP and the caches live there). Images are decoded below, on this thread,
                # so a bad image fails this call before anything is queued.
                self._check_media(messages, spec.tools)
                lane = "vision"
            plan = plan_chat(
                self._format, tools=spec.tools, tool_choice=spec.tool_choice,
                response_format=spec.response_format, reasoning=spec.reasoning,
                parallel_tool_calls=spec.parallel_tool_calls, template_kwargs=spec.template_kwargs,
                marker=self._grammar.marker, encode=renderer.encode,
                constrain_calls=self.options.constrain_tool_calls)
            text, prompt_ids, turns = renderer.render_chat(
                messages, tools=plan.tools, template_kwargs=plan.template_kwargs)
            opts = self.options
            if lane == "vision":
                media = {"images": self._load_images(messages, turns), "text": text}
            caching = opts.vision_cache_bytes if lane == "vision" else opts.prefix_cache_bytes
            if caching or (lane == "text" and opts.specprefill_draft is not None):
                # The prefix caches' snapshot points; SpecPrefill keeps the system prompt dense.
                cache_points = renderer.cache_points(
                    messages, prompt_ids, tools=plan.tools, template_kwargs=plan.template_kwargs, turns=turns,
                    history=None if opts.prefix_cache_history and caching else False)
            fmt = self._format
            starts_in_reasoning = fmt.opens_in_reasoning(text, renderer.continued_text(
                messages, text, tools=plan.tools, template_kwargs=plan.template_kwargs, turns=turns))
            call_start_id = self._call_start_id if plan.parse_tool_calls else None
            parser = ChatOutputParser(
                fmt, tools=plan.tools, parse_tool_calls=plan.parse_tool_calls,
                forced_json_calls=plan.forced_json_calls, forced_call=plan.forced_call,
                max_tool_calls=plan.max_tool_calls, starts_in_reasoning=starts_in_reasoning, verbatim=plan.verbatim,
                call_start_by_token=call_start_id is not None)
            if plan.banned_token_ids:
                processors.append(TokenBan(plan.banned_token_ids))
            constraint = plan.constraint
            if plan.reason_first:
                if self._think_ids is None:
                    raise ConstraintError(
                        "reasoning=True with a response_format or a forced tool call needs reasoning markers "
                        f"that are one token each; {fmt.think_start!r} and {fmt.think_end!r} are not")
                # The answer's grammar alone first: one that matches no string compiles, and
                # nested after a reasoning it would end the answer empty, with "stop". (The
                # second compile costs about 0.5 ms for a JSON schema on CPU, measured.)
                self._grammar.compile(constraint)
                constraint = after_reasoning(constraint, self._think_ids, opened=starts_in_reasoning)
            open_call = plan.open_call
            if plan.parse_tool_calls and fmt.tool_call_start:  # Mistral's calls have no end marker
                thinks = fmt.has_thinking
                stop_exempt = CallMarkers(fmt.tool_call_start, fmt.tool_call_end,
                                          fmt.think_start if thinks else "", fmt.think_end if thinks else "",
                                          starts_in_reasoning, json_body=parser.json_body, call_start_id=call_start_id)
        else:
            prompt = spec.prompt
            constraint = open_call = None
            if spec.response_format is not None:
                constraint = response_format_constraint(spec.response_format)
            if prompt is None:
                raise InvalidRequestError("give messages or a prompt")
            prompt_ids = raw_prompt_ids(prompt, renderer.encode, self.loaded.vocab_size)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        if params.specprefill:
            if self.options.specprefill_draft is None:
                raise InvalidRequestError("specprefill=True needs a draft model: set the engine option "
                                          "specprefill_draft")
            if lane != "text":
                raise InvalidRequestError("SpecPrefill applies to text requests; this one carries images")
        ctx = self.context_length
        if len(prompt_ids) >= ctx:
            # An image request is refused before the vision lane expands its images (one
            # placeholder each here): it can only grow, and the count says it is a floor.
            counted = "tokens before its images are expanded" if media is not None else "tokens"
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} {counted}; the context window is {ctx} "
                "(leave room for at least one generated token)",
                prompt_tokens=len(prompt_ids), max_context=ctx)
        req = Request(
            request_id=spec.request_id or new_request_id(),
            prompt_ids=prompt_ids,
            params=params,
            sink=sink,
            lane=lane,
        )
        if media is not None:
            req.extra["media"] = media
        req.cache_points = cache_points
        req.stop_exempt = stop_exempt  # stop strings end the text, never cut a tool call
        # Generation stops at the context window: finish_reason "length".
        req.max_tokens = min(params.max_tokens, ctx - len(prompt_ids))
        if constraint is not None:
            grammar = self._grammar
            processors.append(GrammarProcessor(
                grammar.compile(constraint), tiers=grammar.tiers(), eos_token_ids=grammar.eos_token_ids,
                max_tokens=req.max_tokens, vocab_size=grammar.vocab_size, hints=grammar.hint_ids(constraint),
                text_markup=constraint.text_markup))
            req.extra["constrained"] = constraint.description
        if open_call is not None:
            grammar = self._grammar
            # Compiled here, so a bad tool schema fails this call; each call it opens gets a copy.
            pristine = grammar.compile(open_call)
            processors.append(LazyToolCallGrammar(
                pristine.deep_copy, start_id=plan.call_start_id, tiers=grammar.tiers(),
                eos_token_ids=grammar.eos_token_ids, max_tokens=req.max_tokens,
                vocab_size=grammar.vocab_size, hints=grammar.hint_ids(open_call),
                think_ids=self._think_ids, starts_in_reasoning=starts_in_reasoning,
                text_markup=open_call.text_markup))
        req.processors = processors
        return req, parser

    def _not_on_owner_thread(self) -> None:
        """A request made on the engine's own thread (from a logits processor, say) would
        wait for output only that thread can make: refuse it rather than hang for good."""
        core = self._core
        if core is not None and threading.current_thread() is core.owner_thread:
            raise InvalidRequestError(
                "a request cannot be made from the engine's own thread (inside a logits processor or "
                "run_on_owner_thread): it would wait for itself")

    async def _astream(self, spec: CallSpec) -> "AsyncStream":
        self._not_on_owner_thread()
        await self.start()
        sink = AsyncSink(asyncio.get_running_loop())
        # Off the event loop: templating a long prompt, compiling a grammar and decoding (or
        # fetching) images take milliseconds to seconds, and every other stream on this loop
        # would wait for them. No mlx here (the owner thread makes the arrays).
        req, parser = await run_off_loop(self._make_request, spec, sink)
        stream = self._bind_stream(AsyncStream(self._core, req, sink, parser))  # as in _sstream
        self._core.submit(req)
        return stream

    async def _relay(self, spec: CallSpec) -> AsyncIterator[StreamDelta]:
        stream = await self._astream(spec)
        async with stream:
            async for delta in stream:
                yield delta

    def _sstream(self, spec: CallSpec) -> "SyncStream":
        self._not_on_owner_thread()
        self.start_sync()
        sink = SyncSink()
        req, parser = self._make_request(spec, sink)
        # The stream first: a KeyboardInterrupt right after the submit (Ctrl-C in a sync
        # call) unwinds this frame, and the stream's finalizer aborts the request. Submitted
        # first, it was left generating with no reader, holding its slot.
        stream = self._bind_stream(SyncStream(self._core, req, sink, parser))
        self._core.submit(req)
        return stream

    def _bind_stream(self, stream):
        # A stream keeps its engine alive: an engine nobody holds is closed (see _ensure_core).
        stream.engine = self
        return stream

    # ------------------------------------------------------------------ chat API
    async def chat(self, messages: ChatMessages, params: ParamsLike = None,
                   **options: Any) -> RequestOutput:
        """Answer a chat.

        ``messages`` are OpenAI-style dicts. Keyword options: ``tools`` (OpenAI function
        schemas), ``tool_choice`` ("auto", "none", "required"/"any", a tool name),
        ``parallel_tool_calls`` (a forced call is one call unless True), ``response_format`` ({"type": "json_object"},
        {"type": "json_schema", "json_schema": {"schema": ...}}, lark/regex), ``reasoning``
        (thinking on/off; None = the template's default), ``template_kwargs`` (extra chat
        template variables), ``request_id``.
        """
        stream = await self._astream(CallSpec.chat(messages, params, options))
        return await stream.collect()

    async def stream_chat(self, messages: ChatMessages, params: ParamsLike = None,
                          **options: Any) -> AsyncIterator[StreamDelta]:
        """Stream a chat answer as StreamDeltas. Closing or cancelling it aborts the request."""
        async for delta in self._relay(CallSpec.chat(messages, params, options)):
            yield delta

    async def open_chat_stream(self, messages: ChatMessages, params: ParamsLike = None, *,
                               timeout: Optional[float] = None, **options: Any) -> "AsyncStream":
        """Submit a chat now and return its stream handle (iterate it, ``collect()`` it or ``cancel()`` it).

        With ``timeout`` (seconds, for the whole request) the stream cancels the request and
        raises RequestTimeoutError (a TimeoutError) when the deadline passes.
        """
        deadline = deadline_of(timeout)  # checked before the request is submitted
        stream = await self._astream(CallSpec.chat(messages, params, options))
        stream.deadline = deadline
        return stream

    def open_chat_stream_sync(self, messages: ChatMessages, params: ParamsLike = None, *,
                              timeout: Optional[float] = None, **options: Any) -> "SyncStream":
        """Submit a chat now; return its blocking stream handle.

        With ``timeout`` (seconds, for the whole request) the stream cancels the request and
        raises RequestTimeoutError (a TimeoutError) when the deadline passes.
        """
        deadline = deadline_of(timeout)  # checked before the request is submitted
        stream = self._sstream(CallSpec.chat(messages, params, options))
        stream.deadline = deadline
        return stream

    def chat_sync(self, messages: ChatMessages, params: ParamsLike = None,
                  **options: Any) -> RequestOutput:
        return self._sstream(CallSpec.chat(messages, params, options)).collect()

    def stream_chat_sync(self, messages: ChatMessages, params: ParamsLike = None,
                         **options: Any) -> Iterator[StreamDelta]:
        stream = self._sstream(CallSpec.chat(messages, params, options))
        with stream:
            yield from stream

    # ------------------------------------------------------------------ raw prompt API
    # ``options``: response_format and request_id (checked by CallSpec.complete: an unknown
    # name is an InvalidRequestError, as for chats).
    async def complete(self, prompt: str | Sequence[int], params: ParamsLike = None, **options: Any) -> RequestOutput:
        """Continue a raw prompt (text or token ids), no chat template."""
        stream = await self._astream(CallSpec.complete(prompt, params, options))
        return await stream.collect()

    async def stream_complete(self, prompt: str | Sequence[int], params: ParamsLike = None,
                              **options: Any) -> AsyncIterator[StreamDelta]:
        async for delta in self._relay(CallSpec.complete(prompt, params, options)):
            yield delta

    def complete_sync(self, prompt: str | Sequence[int], params: ParamsLike = None, **options: Any) -> RequestOutput:
        return self._sstream(CallSpec.complete(prompt, params, options)).collect()

    def stream_complete_sync(self, prompt: str | Sequence[int], params: ParamsLike = None,
                             **options: Any) -> Iterator[StreamDelta]:
        stream = self._sstream(CallSpec.complete(prompt, params, options))
        with stream:
            yield from stream

    async def open_complete_stream(self, prompt: str | Sequence[int], params: ParamsLike = None, *,
                                   timeout: Optional[float] = None, **options: Any) -> "AsyncStream":
        """Submit a raw prompt now and return its stream handle (``timeout`` as for chats)."""
        deadline = deadline_of(timeout)  # checked before the request is submitted
        stream = await self._astream(CallSpec.complete(prompt, params, options))
        stream.deadline = deadline
        return stream

    def open_complete_stream_sync(self, prompt: str | Sequence[int], params: ParamsLike = None, *,
                                  timeout: Optional[float] = None, **options: Any) -> "SyncStream":
        """Submit a raw prompt now; return its blocking stream handle (``timeout`` as for chats)."""
        deadline = deadline_of(timeout)  # checked before the request is submitted
        stream = self._sstream(CallSpec.complete(prompt, params, options))
        stream.deadline = deadline
        return stream

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` under the model's tokenizer, no special tokens added.

        Safe from any thread: the tokenizer is shared with the engine's renderer under its lock.
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"encode takes a string, got {type(text).__name__}")
        self.start_sync()
        return self._renderer.encode(text)

    def apply_chat_template(self, messages: ChatMessages, *, tools=None, tool_choice=None,
                            response_format=None, reasoning=None, template_kwargs=None, **unknown: Any) -> list[int]:
        """The prompt token ids the engine would use for this chat, each image expanded to the
        tokens it takes (the vision lane's processor, on the owner thread)."""
        if unknown:
            raise InvalidRequestError(f"unknown apply_chat_template options {sorted(unknown)}")
        self.start_sync()
        messages = validate_messages(messages)
        plan = plan_chat(
            self._format, tools=tools, tool_choice=tool_choice, response_format=response_format,
            reasoning=reasoning, parallel_tool_calls=None, template_kwargs=template_kwargs,
            marker=self._grammar.marker, encode=self._renderer.encode)
        media = has_media(messages)
        if media:
            self._check_media(messages, tools)
        text, ids, turns = self._renderer.render_chat(messages, tools=plan.tools,
                                                      template_kwargs=plan.template_kwargs)
        if not media:
            return ids
        images = self._load_images(messages, turns)
        from .lanes.vision import expand_images

        vlm, processor = self.loaded.vlm, self.loaded.processor
        return self.run_on_owner_thread(lambda: expand_images(vlm, processor, images, text)[0])

    def _check_media(self, messages: list, tools) -> None:
        """Media this model can take, before the chat is rendered."""
        if not self.loaded.supports_images:
            raise UnsupportedContentError(
                f"{self.loaded.path.name} is a text-only model; this request carries an image, "
                "video or audio part")
        refuse_media_markers(messages, tools, self._media_markers)

    def _load_images(self, messages: list, turns) -> list:
        """A request's images in the order its rendered prompt shows them (``turns``: what
        the history was normalized with), read and checked on the caller's thread (PIL
        only), so a bad image fails its call before anything is queued."""
        return load_images(messages, allow_remote=self.options.allow_remote_images,
                           max_pixels=self.options.max_image_pixels, turns=turns)
