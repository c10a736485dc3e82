"""Engine: the public facade. Async-first API with sync twins; never touches mlx itself.

Front-end work (validation, message normalization, chat rendering, tokenization; see
request_builder.py) runs on the caller's thread; the request then goes to the EngineCore's
owner thread, and results come back through a per-request sink.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from .core import EngineCore
from .fork_guard import inherited_engine_error
from .default_model import DEFAULT_MODEL_NAME, default_model_path, names_default
from .errors import EngineClosedError, InvalidRequestError, ModelLoadError, own_copy
from .model_info import ModelInfo, local_checkpoint, read_model_info
from .model_loader import LoadedModel, checkpoint_key
from .off_loop import run_off_loop
from .options import EngineOptions
from .outputs import RequestOutput, StreamDelta
from .params import SamplingParams
from .request_builder import RequestBuilder
from .stats import EngineStats
from .streams import AsyncStream, SyncStream
from .teardown import close_at_exit
from .request import AsyncSink, Request, SyncSink

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
        self._front: Optional[RequestBuilder] = None  # made at load
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
        if self._front is not None:
            return
        # Once, under the lock: callers making their first call together must end with one
        # renderer and a grammar compiler that share its tokenizer lock.
        with self._lock:
            if self._front is None:
                self._front = RequestBuilder(loaded, self.options)

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
        self.loaded
        return self._front.context_length

    @property
    def chat_format(self) -> ChatFormat:
        """Reasoning markers and tool-call syntax of the model's chat template."""
        self.loaded
        return self._front.format

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
        self.loaded  # the front end is made at load
        return self._front.build(spec, sink)

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
        return self._front.renderer.encode(text)

    def apply_chat_template(self, messages: ChatMessages, *, tools=None, tool_choice=None, parallel_tool_calls=None,
                            response_format=None, reasoning=None, template_kwargs=None, **unknown: Any) -> list[int]:
        """The prompt token ids the engine would use for this chat, each image expanded to the
        tokens it takes (the vision lane's processor, on the owner thread). It takes
        ``chat``'s options but ``request_id``, checked as ``chat`` checks them, so one dict of
        options serves both (``parallel_tool_calls`` never changes the prompt)."""
        if unknown:
            raise InvalidRequestError(f"unknown apply_chat_template options {sorted(unknown)}")
        self.start_sync()
        front = self._front
        chat = front.render_chat(messages, tools=tools, tool_choice=tool_choice, response_format=response_format,
                                 reasoning=reasoning, parallel_tool_calls=parallel_tool_calls,
                                 template_kwargs=template_kwargs)
        if not chat.has_media:
            return chat.ids
        images = front.load_images(chat.messages, chat.turns)
        from .lanes.vision import expand_images

        vlm, processor = self.loaded.vlm, self.loaded.processor
        return self.run_on_owner_thread(lambda: expand_images(vlm, processor, images, chat.text)[0])

