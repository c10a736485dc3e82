"""ChatMLX: a LangChain chat model on mlx-tandem's in-process engine.

Every call goes to the shared engine for its model (``Engine.shared``), so concurrent
``ainvoke``/``astream``/``abatch`` calls, from LangChain and LlamaIndex alike, share each
forward step. Construction is cheap: the model loads on the first call.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Optional, Sequence, TypeVar, Union, overload

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.utils import convert_to_messages
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableGenerator, RunnableMap
from langchain_core.runnables.utils import AddableDict
from langchain_core.tools import BaseTool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      field_validator, model_validator)

from mlx_tandem import Engine
from mlx_tandem.call_options import (merge_stops, model_name_alias, pin_checkpoint, pinned_checkpoint,
                                     resolve_call)
from mlx_tandem.default_model import DEFAULT_MODEL_NAME
from mlx_tandem.errors import InvalidRequestError, TemplateError
from mlx_tandem.model_loader import checkpoint_key

from ._choices import choice_params, fits_queue, result_of
from ._convert import PROVIDER, ChunkBuilder, WrittenBlocks, to_ai_message, to_engine_messages
from ._parsers import WholeJsonKeyToolsParser, WholeJsonParser, WholePydanticParser, WholePydanticToolsParser
from ._schemas import openai_tool, response_format_for, structured_tool

_Model = TypeVar("_Model", bound=BaseModel)


class ChatMLX(BaseChatModel):
    """Chat model running local MLX models in-process, with continuous batching.

    Example:
        .. code-block:: python

            from langchain_mlx_tandem import ChatMLX

            llm = ChatMLX(model="mlx-community/Qwen3.5-0.8B-4bit", max_tokens=256)
            llm.invoke("Hello!")

    ``model`` (or its alias ``model_name``) is a local checkpoint directory or a hub repo id;
    None runs the embedded default model. ``engine_options`` go to ``Engine.shared`` (e.g.
    ``max_batch_size``). An unknown constructor argument is an error, as an unknown call
    option is: there is no provider API to pass it on to, and a misspelt option that is
    silently dropped runs the wrong model or budget.
    """

    model: Optional[Union[str, Path]] = None  # a path is kept as its text
    # None in a sampling field is the checkpoint's recommendation (its generation_config.json)
    # where it has one, else the engine's default (greedy, no filters), as ChatOpenAI leaves
    # an unset value to its server.
    temperature: Optional[float] = None
    max_tokens: Optional[int] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: Optional[int] = 20
    """How many of the latest tokens the repetition penalty looks back on."""
    presence_penalty: Optional[float] = None
    """OpenAI's presence penalty, in [-2, 2], over the whole answer so far (never the prompt)."""
    frequency_penalty: Optional[float] = None
    """OpenAI's frequency penalty, in [-2, 2], over the whole answer so far (never the prompt)."""
    # One string or a list (kept as a list). ``stop_sequences`` is accepted too; a
    # validation alias keeps ``stop`` the constructor's name for type checkers.
    stop: Optional[Union[list[str], str]] = Field(default=None,
                                                  validation_alias=AliasChoices("stop", "stop_sequences"))
    seed: Optional[int] = None
    mtp: Optional[Union[StrictStr, StrictBool]] = None  # strict: 1 is not True (per call it is refused too)
    """Speculative decoding with the model's MTP head: "auto", "on", "off"; None = engine option."""
    specprefill: Optional[bool] = None
    """SpecPrefill for long prompts: True forces it, False turns it off; None = engine threshold."""
    keep_pct: Optional[float] = None
    """Share of prompt chunks SpecPrefill keeps, in (0, 1]; None = engine option."""
    logprobs: Optional[bool] = None
    """Each answer token's log-probability in ``response_metadata["logprobs"]["content"]``,
    as ChatOpenAI's (streamed chunks carry their own tokens')."""
    top_logprobs: Optional[int] = None
    """How many of the most likely tokens to list at each place, 0 to 20 (needs ``logprobs``)."""
    logit_bias: Optional[dict[int, float]] = None
    """OpenAI's: token id -> bias in [-100, 100] added to its logit (-100 bans it)."""
    n: Optional[StrictInt] = Field(default=None, ge=1)  # strict: "3" and True are refused, as per call
    """Answers per prompt, as ChatOpenAI's ``n`` (None is 1): decoded side by side in the
    engine's batch, each a generation of the result (``invoke`` returns the first,
    ``generate`` all). With a ``seed``, answer i draws with seed + i. Answers come whole,
    never streamed."""
    streaming: bool = False
    stream_usage: bool = True
    """Usage on a stream's last chunk, as ChatOpenAI's ``stream_usage``; False leaves it out
    (also per call: ``stream(..., stream_usage=False)``). Non-streamed calls always have it."""
    reasoning: Optional[bool] = None
    """Thinking on/off through the template's ``enable_thinking``; None keeps its default."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    engine_options: dict[str, Any] = Field(default_factory=dict)
    timeout: Optional[float] = None
    """Seconds per call; the request is cancelled (its slot freed) and
    mlx_tandem.RequestTimeoutError (a TimeoutError) raised."""
    max_retries: int = 0
    """Accepted for LangChain compatibility; local inference has no transient failures to retry."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    checkpoint_pin: Optional[tuple[Optional[str], Optional[str]]] = Field(default=None, exclude=True, repr=False)
    """Set by the model itself: ``(model, the checkpoint it named when made)``. A relative
    path is fixed when the model is made; LangChain rebuilds a model from its fields
    (``configurable_fields``), and a pin kept out of them was read again in the working
    directory of the call, another model (review h151). Not to be given."""

    @model_validator(mode="before")
    @classmethod
    def _model_name_alias(cls, data: Any) -> Any:
        return model_name_alias(data)

    @model_validator(mode="after")
    def _pin_checkpoint(self) -> "ChatMLX":
        pin = self.checkpoint_pin
        if not (isinstance(pin, tuple) and pin[0] is not None and pin[0] == self.model):
            self.checkpoint_pin = pin_checkpoint(self.model)  # a rebuilt copy keeps its original's
        return self

    @property
    def _pinned(self) -> tuple:
        return self.checkpoint_pin or (None, None)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # as per call, and as ChatOpenAI takes it

    # ------------------------------------------------------------------ identity
    @property
    def _llm_type(self) -> str:
        return "mlx-tandem-chat"

    @property
    def model_name(self) -> str:
        return self.model if self.model is not None else DEFAULT_MODEL_NAME

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "repetition_context_size": self.repetition_context_size,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "mtp": self.mtp,
            "specprefill": self.specprefill,
            "keep_pct": self.keep_pct,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "logit_bias": self.logit_bias,
            "n": self.n,
            "reasoning": self.reasoning,
            # LangChain's LLM cache keys on these params (and the call's own stop, which it
            # adds under "stop"): every field that changes the answer must be here.
            "stop_sequences": self.stop,
            "chat_template_kwargs": self.chat_template_kwargs,
            "engine_options": self.engine_options,
            # The checkpoint the engine runs: "model" is the text given, and one relative
            # path made in two directories is two models (an audit: one's cached answers
            # came back for the other). And v0 and v1 answers are different messages.
            "checkpoint": self._checkpoint(self.model),
            "output_version": self.output_version,
        }

    def _get_llm_string(self, stop: Optional[list[str]] = None, **kwargs: Any) -> str:
        # A per-call model keys on its checkpoint too.
        if isinstance(kwargs.get("model"), (str, os.PathLike)):
            kwargs = {**kwargs, "model": self._checkpoint(kwargs["model"])}
        return super()._get_llm_string(stop=stop, **kwargs)

    def _checkpoint(self, model: Any) -> Optional[str]:
        """The checkpoint a call naming ``model`` runs, as ``_engine_for`` picks its engine:
        this model's pinned one when it names this model, else its own (a relative path read
        now, as ``Engine.shared`` reads it; so is a ``model`` reassigned since the pin)."""
        run = pinned_checkpoint(self.model, self._pinned) if model == self.model else model
        return None if run is None else checkpoint_key(run)

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = merge_stops(self.stop, stop)
        if stops:
            params["ls_stop"] = stops
        return params

    def _resolve_model_profile(self):
        return _profile(self.engine)

    # ------------------------------------------------------------------ engine plumbing
    @property
    def engine(self) -> Engine:
        """The shared engine this model runs on (created lazily, loaded on first use)."""
        return Engine.shared(pinned_checkpoint(self.model, self._pinned), **self.engine_options)

    def _engine_for(self, kwargs: dict) -> tuple[Engine, str]:
        override = kwargs.pop("model", None)
        if override is None or override == self.model:
            return self.engine, self.model_name
        return Engine.shared(override, **self.engine_options), str(override)

    def _request(self, messages: list[BaseMessage], stop: Optional[list[str]], kwargs: dict):
        kwargs = dict(kwargs)
        kwargs.pop("ls_structured_output_format", None)
        kwargs.pop("stream", None)  # core's per-call streaming switch, already acted on
        _stream_usage(kwargs.pop("stream_usage", None), True)  # read by _stream/_astream; invoke always has usage
        engine, model_name = self._engine_for(kwargs)
        call = resolve_call(self, kwargs, owner="ChatMLX", stop=stop)
        return engine, model_name, to_engine_messages(messages), call.params, call.options, call.timeout

    # ------------------------------------------------------------------ token counting
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids under the model's own tokenizer (core's default is GPT-2's)."""
        return self.engine.encode(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Optional[Sequence] = None) -> int:
        """Prompt tokens the engine would use for ``messages`` (and ``tools``): the chat
        template rendered, generation prompt included, so ``trim_messages(token_counter=llm)``
        trims to what the model sees. A partial history that the template refuses (e.g. no
        user turn, which Qwen templates reject) is counted message by message instead."""
        messages = convert_to_messages(messages)
        if not messages:
            return 0
        formatted = [openai_tool(t, None) for t in tools] if tools else None
        try:
            return len(self.engine.apply_chat_template(
                to_engine_messages(messages), tools=formatted, reasoning=self.reasoning,
                template_kwargs=self.chat_template_kwargs or None))
        except TemplateError:
            return super().get_num_tokens_from_messages(messages, tools)

    # ------------------------------------------------------------------ generation
    def _combine_llm_outputs(self, llm_outputs: list[Optional[dict]]) -> dict:
        """``generate()`` over several prompts: token usage summed, as ChatOpenAI does. Under
        ``streaming=True`` core builds each result from the chunks with no ``llm_output``; the
        usage is then on each message's ``usage_metadata`` only."""
        totals: dict[str, Any] = {}
        for output in llm_outputs:
            _add_usage(totals, (output or {}).get("token_usage") or {})
        model_name = next((o["model_name"] for o in llm_outputs if o and o.get("model_name")),
                          self.model_name)
        combined: dict[str, Any] = {"model_name": model_name}
        if totals:
            combined["token_usage"] = totals
        return combined

    def _choices(self, kwargs: dict) -> int:
        """``n`` for this call (a per-call ``n`` wins), taken out of ``kwargs``."""
        n = kwargs.pop("n", None)
        n = self.n if n is None else n
        if n is None:
            return 1
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n={n!r}: must be an integer >= 1")
        return n

    def _several(self, kwargs: dict) -> bool:
        return (kwargs.get("n") if kwargs.get("n") is not None else self.n or 1) != 1

    # Several answers are several generations of one result, which a stream of one message's
    # chunks cannot carry: such a call takes the whole path (core's stream() then yields the
    # first answer whole, as invoke returns it). langchain-core 1.8 asks _streaming_disabled
    # on both of its invoke paths (v1 callbacks, and the v2 protocol of LangGraph's v2
    # handler); _should_stream covers the v1 path of earlier versions. stream_events v3
    # (beta) asks neither and calls _stream, which refuses n > 1 (_one_answer): decoding n
    # answers to stream one would spend the others for nothing.
    def _streaming_disabled(self, **kwargs: Any) -> bool:
        return self._several(kwargs) or super()._streaming_disabled(**kwargs)

    def _should_stream(self, *, async_api: bool, run_manager=None, **kwargs: Any) -> bool:
        if self._several(kwargs):
            return False
        return super()._should_stream(async_api=async_api, run_manager=run_manager, **kwargs)

    def _one_answer(self, kwargs: dict) -> None:
        """A stream is one answer: ``n`` (per call too) must be 1, and leaves ``kwargs``."""
        if self._choices(kwargs) != 1:
            raise InvalidRequestError("n > 1 gives several answers, which are never streamed: invoke or generate")

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        kwargs = dict(kwargs)
        n = self._choices(kwargs)
        if self.streaming and n == 1:
            written = WrittenBlocks()
            return _collect(self._chunks(messages, stop, run_manager, kwargs, written), self._blocks(written))
        engine, model_name, msgs, params, options, timeout = self._request(messages, stop, kwargs)
        fits_queue(engine, n)
        streams = []
        try:
            # All submitted before any is read: the answers decode in one batch.
            for p in choice_params(params, n):
                streams.append(engine.open_chat_stream_sync(msgs, p, timeout=timeout, **options))
            return result_of(*(self._message(s.collect(), model_name) for s in streams))
        finally:
            for s in streams:
                s.cancel()  # those left running when one failed to open or to finish

    async def _agenerate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        kwargs = dict(kwargs)
        n = self._choices(kwargs)
        if self.streaming and n == 1:
            written = WrittenBlocks()
            chunks = [c async for c in self._achunks(messages, stop, run_manager, kwargs, written)]
            return _collect(iter(chunks), self._blocks(written))
        engine, model_name, msgs, params, options, timeout = self._request(messages, stop, kwargs)
        fits_queue(engine, n)
        streams = []
        try:
            for p in choice_params(params, n):
                streams.append(await engine.open_chat_stream(msgs, p, timeout=timeout, **options))
            outs = await asyncio.gather(*(s.collect() for s in streams))
        finally:
            for s in streams:
                s.cancel()
        return result_of(*(self._message(out, model_name) for out in outs))

    def _blocks(self, written: WrittenBlocks) -> Optional[list]:
        """Under ``output_version="v1"``, the answer's content: its blocks in the order
        written, as a stream's chunks bring them (core's blocks of the joined text put all
        text before the calls); else None, the text."""
        return written.blocks if self.output_version == "v1" else None

    def _message(self, out, model_name: str) -> AIMessage:
        return to_ai_message(out, model_name, WrittenBlocks.of(out) if self.output_version == "v1" else None)

    def _stream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        yield from self._chunks(messages, stop, run_manager, kwargs)

    def _chunks(self, messages: list[BaseMessage], stop: Optional[list[str]], run_manager,
                kwargs: dict, written: Optional[WrittenBlocks] = None) -> Iterator[ChatGenerationChunk]:
        """The stream's chunks; ``written`` gathers their v1 blocks in the order written."""
        self._one_answer(kwargs)
        usage = _stream_usage(kwargs.pop("stream_usage", None), self.stream_usage)
        engine, model_name, msgs, params, options, timeout = self._request(messages, stop, kwargs)
        builder = ChunkBuilder(model_name, usage=usage, written=written)
        with engine.open_chat_stream_sync(msgs, params, timeout=timeout, **options) as stream:
            for delta in stream:
                for message in builder.chunks(delta):
                    chunk = ChatGenerationChunk(message=message, generation_info=_chunk_info(message))
                    if run_manager is not None:
                        run_manager.on_llm_new_token(message.text, chunk=chunk)
                    yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in self._achunks(messages, stop, run_manager, kwargs):
            yield chunk

    async def _achunks(self, messages: list[BaseMessage], stop: Optional[list[str]], run_manager,
                       kwargs: dict, written: Optional[WrittenBlocks] = None) -> AsyncIterator[ChatGenerationChunk]:
        self._one_answer(kwargs)
        usage = _stream_usage(kwargs.pop("stream_usage", None), self.stream_usage)
        engine, model_name, msgs, params, options, timeout = self._request(messages, stop, kwargs)
        builder = ChunkBuilder(model_name, usage=usage, written=written)
        async with await engine.open_chat_stream(msgs, params, timeout=timeout, **options) as stream:
            async for delta in stream:
                for message in builder.chunks(delta):
                    chunk = ChatGenerationChunk(message=message, generation_info=_chunk_info(message))
                    if run_manager is not None:
                        await run_manager.on_llm_new_token(message.text, chunk=chunk)
                    yield chunk

    # ------------------------------------------------------------------ tools and structured output
    def bind_tools(
        self,
        tools: Sequence[Union[dict[str, Any], type, Callable, BaseTool]],
        *,
        tool_choice: Optional[Union[dict, str, bool]] = None,
        parallel_tool_calls: Optional[bool] = None,
        strict: Optional[bool] = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (OpenAI function schemas, Pydantic models, functions, BaseTools).

        ``tool_choice``: "auto" (default), "none", "any"/"required"/True (force a call of
        some tool), or a tool name / ``{"type": "function", "function": {"name": ...}}``.
        Forced calls are grammar-constrained: valid JSON matching the tool's schema.
        """
        formatted = [openai_tool(t, strict) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    # For type checkers: a Pydantic class without include_raw gives instances of that class.
    @overload
    def with_structured_output(
        self,
        schema: type[_Model],
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: Literal[False] = False,
        strict: Optional[bool] = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, _Model]: ...

    @overload
    def with_structured_output(
        self,
        schema: Optional[Union[dict, type]] = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: Optional[bool] = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Union[dict, Any]]: ...

    def with_structured_output(
        self,
        schema: Optional[Union[dict, type]] = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: Optional[bool] = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Union[dict, Any]]:
        """Structured output enforced by constrained decoding: the result always validates.

        ``json_schema`` (default) constrains the answer to the schema; ``function_calling``
        forces a call of a tool built from the schema; ``json_mode`` constrains to a JSON
        object, and to the schema too when one is given.
        """
        if kwargs:
            raise ValueError(f"unexpected arguments {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            if schema is None:
                raise ValueError("method='function_calling' needs a schema")
            tool = structured_tool(schema, strict)
            name = tool["function"]["name"]
            llm = self.bind_tools([tool if isinstance(schema, dict) else schema], tool_choice=name,
                                  parallel_tool_calls=False, strict=strict,
                                  ls_structured_output_format={"kwargs": {"method": method, "strict": strict},
                                                               "schema": tool})
            parser: Runnable = (WholePydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                                else WholeJsonKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if schema is None and method == "json_schema":
                raise ValueError("method='json_schema' needs a schema")
            if schema is None:
                response_format: dict = {"type": "json_object"}
                ls_schema = None
            else:
                response_format = response_format_for(schema, strict)
                ls_schema = response_format["json_schema"]["schema"]
            llm = self.bind(response_format=response_format,
                            ls_structured_output_format={"kwargs": {"method": method, "strict": strict},
                                                         "schema": ls_schema})
            parser = WholePydanticParser(pydantic_object=schema) if is_pydantic else WholeJsonParser()
        else:
            raise ValueError(f"unknown method {method!r}; use 'json_schema', 'function_calling' or 'json_mode'")
        if not include_raw:
            return llm | parser

        return RunnableMap(raw=llm) | _raw_then_parsed(parser)


# ---------------------------------------------------------------------- helpers
def _raw_then_parsed(parser: Runnable) -> Runnable:
    """``include_raw=True``: the raw chunks as they come, then ``parsed`` and
    ``parsing_error`` from the whole message. Not core's fallback chain: a stream's parse
    error comes at its end, past the point where the fallback can take over, so a stream
    and ``invoke`` must both end on the same dict (``parsed=None`` and the error)."""

    def parsed(raw: Any) -> AddableDict:
        try:
            return AddableDict(parsed=parser.invoke(raw), parsing_error=None)
        except Exception as exc:  # noqa: BLE001 - reported as ChatOpenAI reports it
            return AddableDict(parsed=None, parsing_error=exc)

    def transform(chunks: Iterator[dict]) -> Iterator[AddableDict]:
        raw = None
        for chunk in chunks:
            if "raw" in chunk:
                raw = chunk["raw"] if raw is None else raw + chunk["raw"]
                yield AddableDict(raw=chunk["raw"])
        yield parsed(raw)

    async def atransform(chunks: AsyncIterator[dict]) -> AsyncIterator[AddableDict]:
        raw = None
        async for chunk in chunks:
            if "raw" in chunk:
                raw = chunk["raw"] if raw is None else raw + chunk["raw"]
                yield AddableDict(raw=chunk["raw"])
        yield parsed(raw)

    return RunnableGenerator(transform, atransform, name="parse_structured_output")


def _add_usage(totals: dict, usage: dict) -> None:
    """Add OpenAI-shaped token usage into ``totals``, details dicts key by key."""
    for key, value in usage.items():
        if isinstance(value, dict):
            _add_usage(totals.setdefault(key, {}), value)
        else:
            totals[key] = totals.get(key, 0) + value


def _stream_usage(per_call: Optional[bool], default: bool) -> bool:
    """``stream_usage`` per call; None is the model's setting (ChatOpenAI's reading). Not a
    bool is an error: ``"false"`` was truthy and gave usage."""
    if per_call is not None and not isinstance(per_call, bool):
        raise InvalidRequestError(f"stream_usage={per_call!r}: must be True, False or None")
    return default if per_call is None else per_call


def _collect(chunks: Iterator[ChatGenerationChunk], blocks: Optional[list] = None) -> ChatResult:
    """The chunks added up, as one answer; its content ``blocks`` where given (v1)."""
    full: Optional[ChatGenerationChunk] = None
    for c in chunks:
        full = c if full is None else full + c
    if full is None:
        raise RuntimeError("the stream produced no chunks")
    msg = full.message
    message = AIMessage(
        content=msg.content if blocks is None else blocks, additional_kwargs=msg.additional_kwargs,
        tool_calls=msg.tool_calls,
        invalid_tool_calls=msg.invalid_tool_calls, usage_metadata=msg.usage_metadata,
        response_metadata=msg.response_metadata, id=msg.id)
    return result_of(message)


def _chunk_info(message: AIMessageChunk) -> Optional[dict[str, Any]]:
    """``generation_info`` of a stream's chunks, as ChatOpenAI fills it: the last carries the
    finish reason and the model name (``LLMResult.generations`` of a streamed call read it),
    and each its tokens' logprobs, which adding the chunks concatenates."""
    info: dict[str, Any] = {}
    if "logprobs" in message.response_metadata:
        info["logprobs"] = message.response_metadata["logprobs"]
    finish = message.response_metadata.get("finish_reason")
    if finish is not None:
        info.update(finish_reason=finish, model_name=message.response_metadata.get("model_name"))
    return info or None


def _profile(engine: Engine) -> dict:
    """Model profile from the checkpoint (read from disk: resolving it never loads weights)."""
    profile: dict[str, Any] = {"text_inputs": True, "text_outputs": True, "tool_calling": True,
                               "tool_choice": True, "tool_call_streaming": True, "structured_output": True}
    info = engine.model_info(load=False)
    if info is None:
        return profile
    profile.update(max_input_tokens=info.context_length, tool_calling=info.supports_tools,
                   tool_choice=info.supports_tools, reasoning_output=info.supports_reasoning,
                   image_inputs=info.supports_images,
                   # a tool's result may carry images too (they go the vision path as a user's do)
                   image_tool_message=info.supports_images,
                   image_url_inputs=info.supports_images and engine.options.allow_remote_images)
    return profile
