"""MLXTandemLLM: a LlamaIndex function-calling LLM on mlx-tandem's in-process engine.

Every call goes to the shared engine for its model (``Engine.shared``), so concurrent
``achat``/``apredict`` calls (a query engine's ``use_async=True`` fan-out, parallel agents,
a LangChain ``ChatMLX`` on the same model) share each forward step. Construction is cheap:
the model loads on the first call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncGenerator, Generator, Optional, Sequence, Type, Union

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic import StrictBool, StrictStr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictInProgressEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.output_parsers.pydantic import PydanticOutputParser
from llama_index.core.program.utils import FlexibleModel, create_flexible_model
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.types import Model, PydanticProgramMode

from mlx_tandem import Engine, SamplingParams
from mlx_tandem.call_options import model_name_alias, pin_checkpoint, pinned_checkpoint, resolve_call
from mlx_tandem.default_model import DEFAULT_MODEL_NAME
from mlx_tandem.pydantic_schema import json_schema

from ._tools import first_call_only, keep_first_tool_call, kwargs_dict, openai_tool
from ._convert import (StreamAccumulator, in_written_order, to_chat_response, to_completion_response,
                       to_engine_messages)

dispatcher = get_dispatcher(__name__)



# Options that shape the chat template's rendering (set on the LLM: defaults for templated
# calls only), and those that only mean something on a call that carries tools.
_TEMPLATE_OPTIONS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "reasoning", "chat_template_kwargs"})
_TOOL_TURN_OPTIONS = frozenset({"tool_choice", "parallel_tool_calls"})

class _SchemaInstructions(PydanticOutputParser):
    """Core's schema instructions, appended to a message's text as core appends them, with
    the schema's braces as they are: core's own escape for its templates (``{{``) would reach
    the model doubled, since nothing formats these messages again."""

    def format(self, query: str) -> str:
        return query + "\n\n" + self.get_format_string(escape_json=False)


class MLXTandemLLM(FunctionCallingLLM):
    """LlamaIndex LLM running local MLX models in-process, with continuous batching.

    Example:
        .. code-block:: python

            from llama_index.llms.mlx_tandem import MLXTandemLLM

            llm = MLXTandemLLM(model="mlx-community/Qwen3.5-0.8B-4bit", max_tokens=256)
            print(llm.complete("Hello!"))

    ``model`` (or its alias ``model_name``, as llama-index-llms-mlx spells it) is a local
    checkpoint directory or a hub repo id; None runs the embedded default model.
    ``engine_options`` go to ``Engine.shared`` (e.g. ``max_batch_size``). An unknown
    constructor argument is an error, as an unknown call option is: a misspelt option that
    is silently dropped runs the wrong model or budget.
    """

    model_config = ConfigDict(extra="forbid")

    model: Optional[Union[str, Path]] = Field(  # a path is kept as its text
        default=None, description="Checkpoint directory or hub repo id; None = default model.")
    # None in a sampling field: the checkpoint's generation_config.json value, else the
    # engine's default (greedy, no filters).
    temperature: Optional[float] = Field(
        default=None, ge=0.0, description="0 samples greedily; None = the checkpoint's default, else 0.")
    max_tokens: Optional[int] = Field(default=None, gt=0, description="Output budget per call (None = engine default).")
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = Field(
        default=20, description="How many of the latest tokens the repetition penalty looks back on.")
    presence_penalty: Optional[float] = Field(
        default=None, description="OpenAI's presence penalty, in [-2, 2], over the whole answer so far.")
    frequency_penalty: Optional[float] = Field(
        default=None, description="OpenAI's frequency penalty, in [-2, 2], over the whole answer so far.")
    stop: Optional[list[str]] = Field(default=None, description="Stop strings (never emitted).")
    seed: Optional[int] = None
    mtp: Optional[Union[StrictStr, StrictBool]] = Field(
        default=None, description='Speculative decoding with the MTP head: "auto", "on", "off"; None = engine option.')
    specprefill: Optional[bool] = Field(
        default=None, description="SpecPrefill for long prompts: True forces it, False turns it off; None = engine threshold.")
    keep_pct: Optional[float] = Field(
        default=None, description="Share of prompt chunks SpecPrefill keeps, in (0, 1]; None = engine option.")
    logprobs: Optional[bool] = Field(
        default=None, description="Each answer token's log-probability in the response's logprobs (the token "
                                  "drawn first, then the top_logprobs most likely others).")
    top_logprobs: Optional[int] = Field(
        default=None, description="How many of the most likely tokens to list per token, 0 to 20 (needs logprobs).")
    logit_bias: Optional[dict[int, float]] = Field(
        default=None, description="OpenAI's: token id -> bias in [-100, 100] added to its logit (-100 bans it).")
    reasoning: Optional[bool] = Field(
        default=None, description="Thinking on/off through the template's enable_thinking; None keeps its default.")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    context_window: Optional[int] = Field(
        default=None, gt=0, description="Override the context window reported in metadata (default: model config).")
    additional_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Default per-call options, e.g. response_format or tool_choice.")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="Options for Engine.shared.")
    timeout: Optional[float] = Field(
        default=None, description="Seconds per call; the request is cancelled (its slot freed) and "
                                  "mlx_tandem.RequestTimeoutError (a TimeoutError) raised.")

    _pinned: tuple = PrivateAttr(default=(None, None))

    @model_validator(mode="before")
    @classmethod
    def _model_name_alias(cls, data: Any) -> Any:
        # Core's model_dump() adds class_name, which from_dict() drops; dropped here too, so
        # MLXTandemLLM(**llm.model_dump()) builds as core's LLMs (which ignore extras) do.
        if isinstance(data, dict) and data.get("class_name") == cls.class_name():
            data = {k: v for k, v in data.items() if k != "class_name"}
        return model_name_alias(data)

    @model_validator(mode="after")
    def _pin_checkpoint(self) -> "MLXTandemLLM":
        self._pinned = pin_checkpoint(self.model)
        return self

    @classmethod
    def class_name(cls) -> str:
        return "MLXTandemLLM"

    # ------------------------------------------------------------------ identity
    @property
    def model_name(self) -> str:
        return self.model if self.model is not None else DEFAULT_MODEL_NAME

    @property
    def engine(self) -> Engine:
        """The shared engine this LLM runs on (created lazily, loaded on first use)."""
        return Engine.shared(pinned_checkpoint(self.model, self._pinned), **self.engine_options)

    def tokenize(self, text: str) -> list[int]:
        """The model's own token ids of ``text``: set ``Settings.tokenizer = llm.tokenize``.

        LlamaIndex sizes chunks and packs retrieved text into ``metadata.context_window``
        with ``Settings.tokenizer``, tiktoken's cl100k by default. A local model's tokenizer
        can spell the same text in many more tokens (the embedded demo model's in about
        twice as many), so a query engine built on the default overfills the window and the
        call fails with ``ContextLengthError``."""
        return self.engine.encode(text)

    @property
    def metadata(self) -> LLMMetadata:
        # Read from the checkpoint files: asking for metadata never loads the weights.
        return self._metadata(self.engine.model_info())

    def _metadata(self, info) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or info.context_length,
            num_output=self.max_tokens or info.default_max_tokens,
            is_chat_model=True,
            # A caller's own messages_to_prompt renders a raw prompt, which cannot carry
            # tools (_completion_request): core must take its ReAct path, not call with tools.
            is_function_calling_model=info.supports_tools and self.messages_to_prompt is generic_messages_to_prompt,
            model_name=self.model_name,
        )

    def to_payload(self) -> dict[str, Any]:
        """What instrumentation events record (core's default: the metadata). Core calls it
        on the event loop before an async call starts, so it never loads the model: for a
        checkpoint not on disk yet it records what is known without it."""
        info = self.engine.model_info(load=False)
        if info is None:
            return {"class_name": self.class_name(), "model_name": self.model_name, "is_chat_model": True}
        return {"class_name": self.class_name(), **self._metadata(info).model_dump()}

    # ------------------------------------------------------------------ engine plumbing
    def _options(self, kwargs: dict, *, formatted: bool = False) -> tuple[SamplingParams, dict, Optional[float]]:
        """This call's settings: ``additional_kwargs`` are defaults, where they apply. A
        formatted prompt skips the chat template, so the template's options set on the LLM
        do not apply to it; ``tool_choice`` and ``parallel_tool_calls`` set on the LLM are
        defaults for tool turns, so a call without tools (``complete``, a structured
        program) leaves them out instead of failing on them."""
        defaults = dict(self.additional_kwargs)
        if formatted:
            defaults = {k: v for k, v in defaults.items() if k not in _TEMPLATE_OPTIONS}
        merged = {**defaults, **kwargs}
        if not merged.get("tools"):
            merged = {k: v for k, v in merged.items() if k not in _TOOL_TURN_OPTIONS or k in kwargs}
        call = resolve_call(self, merged, owner="MLXTandemLLM")
        return call.params, call.options, call.timeout

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict):
        """(engine messages, raw prompt, params, options, timeout): a chat goes through the
        model's chat template, unless the caller gave its own ``messages_to_prompt``."""
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return self._completion_request(self.messages_to_prompt(messages), True, kwargs)
        params, options, timeout = self._options(kwargs)
        return to_engine_messages(messages), None, params, options, timeout

    def _completion_request(self, prompt: str, formatted: bool, kwargs: dict):
        """A chat model completes a prompt as one user turn, through the chat template (the
        generation prompt included), unless the caller gave its own ``completion_to_prompt``;
        ``formatted=True`` means the prompt is already rendered."""
        if not formatted and self.completion_to_prompt is not default_completion_to_prompt:
            prompt, formatted = self.completion_to_prompt(prompt), True
        params, options, timeout = self._options(kwargs, formatted=formatted)
        if formatted:
            if options.pop("tools", None) or options.get("tool_choice") not in (None, "auto", "none"):
                raise TypeError("tools need a chat; formatted=True continues a raw prompt")
            templated = sorted({"parallel_tool_calls", "reasoning", "chat_template_kwargs"} & set(kwargs))
            if templated:  # they shape the chat template's rendering, which a raw prompt skips
                raise TypeError(f"{templated} need a chat; formatted=True continues a raw prompt")
            options = {k: v for k, v in options.items() if k == "response_format"}
            return None, prompt, params, options, timeout
        return [{"role": "user", "content": prompt}], None, params, options, timeout

    # ------------------------------------------------------------------ chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request = self._chat_request(messages, kwargs)
        return to_chat_response(self._open_sync(*request).collect(), self.model_name)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request = self._chat_request(messages, kwargs)
        stream = await self._open_async(*request)
        return to_chat_response(await stream.collect(), self.model_name)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        one_call = kwargs.get("parallel_tool_calls") is False
        request = self._chat_request(messages, kwargs)

        def gen() -> ChatResponseGen:
            with self._open_sync(*request) as stream:
                acc = StreamAccumulator(self.model_name, stream.request_id, request[2].logprobs)
                for delta in stream:
                    response = acc.chat(delta)
                    if response is not None:
                        yield first_call_only(response) if one_call else response

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        one_call = kwargs.get("parallel_tool_calls") is False
        request = self._chat_request(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            # Opened on the first read, as the sync twin and core's providers open theirs:
            # the stream belongs to the loop that reads it.
            async with await self._open_async(*request) as stream:
                acc = StreamAccumulator(self.model_name, stream.request_id, request[2].logprobs)
                async for delta in stream:
                    response = acc.chat(delta)
                    if response is not None:
                        yield first_call_only(response) if one_call else response

        return gen()

    # ------------------------------------------------------------------ requests
    def _open_sync(self, msgs, prompt, params, options, timeout):
        if msgs is not None:
            return self.engine.open_chat_stream_sync(msgs, params, timeout=timeout, **options)
        return self.engine.open_complete_stream_sync(prompt, params, timeout=timeout, **options)

    async def _open_async(self, msgs, prompt, params, options, timeout):
        if msgs is not None:
            return await self.engine.open_chat_stream(msgs, params, timeout=timeout, **options)
        return await self.engine.open_complete_stream(prompt, params, timeout=timeout, **options)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        request = self._completion_request(prompt, formatted, kwargs)
        return to_completion_response(self._open_sync(*request).collect(), self.model_name)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        request = self._completion_request(prompt, formatted, kwargs)
        stream = await self._open_async(*request)
        return to_completion_response(await stream.collect(), self.model_name)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        request = self._completion_request(prompt, formatted, kwargs)

        def gen() -> CompletionResponseGen:
            with self._open_sync(*request) as stream:
                acc = StreamAccumulator(self.model_name, stream.request_id, request[2].logprobs)
                for delta in stream:
                    response = acc.completion(delta)
                    if response is not None:
                        yield response

        return gen()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        request = self._completion_request(prompt, formatted, kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            async with await self._open_async(*request) as stream:
                acc = StreamAccumulator(self.model_name, stream.request_id, request[2].logprobs)
                async for delta in stream:
                    response = acc.completion(delta)
                    if response is not None:
                        yield response

        return gen()

    # ------------------------------------------------------------------ tools
    # llama-index-core 0.14 (checked on 0.14.25): ``LLM.predict_and_call``, the ReAct path a
    # model that is not function-calling takes (under a caller's ``messages_to_prompt``),
    # builds ``ReActAgent(formatter=kwargs.get("react_chat_formatter"), output_parser=...)``,
    # and the agent refuses None: every such call failed. The agent's own defaults are given.
    def predict_and_call(self, *args: Any, **kwargs: Any):
        return super().predict_and_call(*args, **self._react_defaults(kwargs))

    async def apredict_and_call(self, *args: Any, **kwargs: Any):
        return await super().apredict_and_call(*args, **self._react_defaults(kwargs))

    def _react_defaults(self, kwargs: dict) -> dict:
        if self.metadata.is_function_calling_model:
            return kwargs
        from llama_index.core.agent.react.output_parser import ReActOutputParser
        from llama_index.core.agent.workflow.react_agent import default_formatter

        out = dict(kwargs)
        if out.get("react_chat_formatter") is None:
            out["react_chat_formatter"] = default_formatter()
        if out.get("output_parser") is None:
            out["output_parser"] = ReActOutputParser()
        return out

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: Optional[Union[str, ChatMessage]] = None,
        chat_history: Optional[list[ChatMessage]] = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Optional[Union[str, dict]] = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Chat kwargs for a tool call turn.

        ``tool_required=True`` forces a call (grammar-constrained: valid JSON for one of
        the tools' schemas); ``tool_choice`` ("auto", "none", "required", a tool name)
        overrides it. A forced call is one call unless ``allow_parallel_tool_calls``.
        """
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg)
        out: dict[str, Any] = {"messages": messages, **kwargs}
        if tools:
            out["tools"] = [openai_tool(t) for t in tools]
            # The LLM's default tool_choice (additional_kwargs) holds unless the call asks
            # for one: tool_required or its own tool_choice.
            default = self.additional_kwargs.get("tool_choice", "auto")
            out["tool_choice"] = tool_choice if tool_choice is not None else ("required" if tool_required else default)
            out["parallel_tool_calls"] = allow_parallel_tool_calls
        return out

    def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[Any],
                                           allow_parallel_tool_calls: bool = False, **kwargs: Any) -> ChatResponse:
        if not allow_parallel_tool_calls:
            keep_first_tool_call(response.message)
        return response

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        calls = [ToolSelection(tool_id=b.tool_call_id or f"call_{i}", tool_name=b.tool_name,
                               tool_kwargs=kwargs_dict(b.tool_kwargs))
                 for i, b in enumerate(b for b in response.message.blocks if isinstance(b, ToolCallBlock))]
        # A call that failed to parse but names a tool is returned too, its arguments read
        # leniently (as the OpenAI LLM reads any): the agent runs it, the tool's error goes
        # back to the model, which can correct it. Dropped, it ended the agent's turn with
        # nothing said. Not one cut off by max_tokens: it would run with only the fields
        # written so far (a missing flag taking its default).
        for c in response.message.additional_kwargs.get("invalid_tool_calls") or []:
            if isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"] and c.get("id") \
                    and not c.get("truncated"):
                calls.append(ToolSelection(tool_id=c["id"], tool_name=c["name"],
                                           tool_kwargs=kwargs_dict(c.get("arguments") or "")))
        if not calls and error_on_no_tool_call:
            raise ValueError(f"Expected at least one tool call, but got {len(calls)} tool calls.")
        # In the order the model wrote them (an agent runs them in this order).
        return in_written_order(calls, response.message.additional_kwargs, lambda c: c.tool_id)

    # ------------------------------------------------------------------ structured output
    def _structured_kwargs(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                           llm_kwargs: Optional[dict], prompt_args: dict) -> tuple[list[ChatMessage], dict]:
        messages = self._extend_messages(prompt.format_messages(llm=self, **prompt_args))
        # The grammar holds the answer to the schema; the model is shown it too (its fields'
        # descriptions say what to put there), in core's words and place, as core's
        # programs show it (LLMTextCompletionProgram's parser; FunctionCallingProgram's tool).
        messages = _SchemaInstructions(output_cls).format_messages([m.model_copy(deep=True) for m in messages])
        kwargs = dict(llm_kwargs or {})
        for k in ("tool_choice", "tool_required", "allow_parallel_tool_calls"):
            kwargs.pop(k, None)
        kwargs["tools"] = None  # the LLM's own tools too: the answer is the document
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {
            "name": output_cls.__name__, "schema": json_schema(output_cls)}}
        return messages, kwargs

    def _constrained(self) -> bool:
        # DEFAULT: answer constrained to the schema. FUNCTION and the others keep LlamaIndex's
        # programs (FUNCTION forces a tool call, which is constrained too).
        return self.pydantic_program_mode == PydanticProgramMode.DEFAULT

    @dispatcher.span
    def structured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                           llm_kwargs: Optional[dict[str, Any]] = None, **prompt_args: Any) -> Model:
        """Structured output by constrained decoding: the answer always validates."""
        if not self._constrained():
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages, kwargs = self._structured_kwargs(output_cls, prompt, llm_kwargs, prompt_args)
        result = _parse(output_cls, self.chat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                                  llm_kwargs: Optional[dict[str, Any]] = None, **prompt_args: Any) -> Model:
        if not self._constrained():
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages, kwargs = self._structured_kwargs(output_cls, prompt, llm_kwargs, prompt_args)
        result = _parse(output_cls, await self.achat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    def stream_structured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                                  llm_kwargs: Optional[dict[str, Any]] = None,
                                  **prompt_args: Any) -> Generator[Union[Model, FlexibleModel], None, None]:
        """Partial objects as the JSON streams in (``Flexible<Model>`` while fields are missing),
        ending with a validated ``output_cls`` instance."""
        if not self._constrained():
            yield from super().stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
            return
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages, kwargs = self._structured_kwargs(output_cls, prompt, llm_kwargs, prompt_args)
        partials = _Partials(output_cls)
        last = None
        for response in self.stream_chat(messages, **kwargs):
            obj = partials.update(response)
            if obj is not None:
                dispatcher.event(LLMStructuredPredictInProgressEvent(output=obj))
                yield obj
            last = response
        final = _parse(output_cls, last)
        if partials.last != final:
            yield final
        dispatcher.event(LLMStructuredPredictEndEvent(output=final))

    @dispatcher.span
    async def astream_structured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                                         llm_kwargs: Optional[dict[str, Any]] = None,
                                         **prompt_args: Any) -> AsyncGenerator[Union[Model, FlexibleModel], None]:
        if not self._constrained():
            return await super().astream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages, kwargs = self._structured_kwargs(output_cls, prompt, llm_kwargs, prompt_args)
        responses = await self.astream_chat(messages, **kwargs)

        async def gen() -> AsyncGenerator[Union[Model, FlexibleModel], None]:
            partials = _Partials(output_cls)
            last = None
            async for response in responses:
                obj = partials.update(response)
                if obj is not None:
                    dispatcher.event(LLMStructuredPredictInProgressEvent(output=obj))
                    yield obj
                last = response
            final = _parse(output_cls, last)
            if partials.last != final:
                yield final
            dispatcher.event(LLMStructuredPredictEndEvent(output=final))

        return gen()


# ---------------------------------------------------------------------- helpers
def _parse(output_cls: Type[Model], response: Optional[ChatResponse]) -> Model:
    if response is None:
        raise ValueError(f"the model produced no output for {output_cls.__name__}")
    text = response.message.content or ""
    try:
        return output_cls.model_validate_json(text)
    except ValidationError as exc:
        # Constrained decoding makes this unreachable unless the output budget ran out.
        finish = (response.raw or {}).get("finish_reason")
        raise ValueError(f"structured output for {output_cls.__name__} did not validate "
                         f"(finish_reason={finish!r}): {exc}") from exc


class _Partials:
    """Partial JSON text -> the most complete object it describes, yielded when it grows."""

    def __init__(self, output_cls: Type[BaseModel]):
        self._cls = output_cls
        self._flexible = create_flexible_model(output_cls)
        self.last: Optional[BaseModel] = None

    def update(self, response: ChatResponse) -> Optional[BaseModel]:
        if not response.delta:
            return None
        try:
            data = parse_partial_json(response.message.content or "")
        except (ValueError, TypeError):
            return None
        if not isinstance(data, dict):
            return None
        try:
            obj: BaseModel = self._cls.model_validate(data)
        except ValidationError:
            try:
                obj = self._flexible.model_validate(data)
            except ValidationError:
                return None
        if self.last is not None and obj.model_dump() == self.last.model_dump():
            return None
        self.last = obj
        return obj
