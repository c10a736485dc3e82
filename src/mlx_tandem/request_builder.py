"""The engine's front end: one call's inputs made into a Request, on the caller's thread.

Validation, message normalization, chat rendering, tokenization, grammar compilation and
image decoding all happen here, before anything is queued, so a bad call fails as its own
typed error and the engine thread only ever sees requests it can run. Nothing here touches
mlx (docs/design.md, "One owner thread").
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

from .call_spec import CallSpec
from .chat_format import ChatFormat
from .chat_output import ChatOutputParser
from .chat_plan import ChatPlan, plan_chat
from .closing import GrammarProcessor
from .constraints import GrammarCompiler, TokenBan, after_reasoning, response_format_constraint
from .detokenizer import CallMarkers
from .errors import ConstraintError, ContextLengthError, InvalidRequestError, UnsupportedContentError
from .media import load_images, media_markers, refuse_media_markers
from .messages import has_media, validate_messages
from .model_loader import LoadedModel
from .options import EngineOptions
from .params import SamplingParams
from .prompt import PromptRenderer, raw_prompt_ids
from .request import Request, new_request_id
from .tool_call_grammar import LazyToolCallGrammar


class RenderedChat(NamedTuple):
    messages: list  # validated and normalized (messages.py)
    has_media: bool
    plan: ChatPlan
    text: str
    ids: list[int]
    turns: Any  # how the history was normalized: what cache points and images are read against


class RequestBuilder:
    """The loaded model's chat format, prompt renderer and grammar compiler, and what makes
    a ``Request`` of a ``CallSpec`` with them. Made once per engine, when the model loads;
    the renderer and the compiler share the tokenizer's lock, so any thread may build."""

    def __init__(self, loaded: LoadedModel, options: EngineOptions):
        self.loaded, self.options = loaded, options
        self.format = ChatFormat.from_tokenizer(loaded.tokenizer)
        self.renderer = PromptRenderer(loaded.tokenizer, short_call_ids=self.format.tool_format == "mistral")
        self.grammar = GrammarCompiler(
            loaded.tokenizer._tokenizer, loaded.vocab_size, loaded.eos_token_ids, lock=self.renderer.lock)
        self.context_length: int = options.max_model_len or loaded.context_length

    @functools.cached_property
    def think_ids(self) -> Optional[tuple[int, int]]:
        """The reasoning markers' token ids where each is one token (the lazy call grammar
        follows reasoning by them), else None."""
        fmt = self.format
        if not fmt.has_thinking:
            return None
        start, end = (self.renderer.encode(m) for m in (fmt.think_start, fmt.think_end))
        return (start[0], end[0]) if len(start) == len(end) == 1 else None

    @functools.cached_property
    def call_start_id(self) -> Optional[int]:
        """The special token that is the tool-call start marker, if it is one (see
        ``CallMarkers.call_start_id``)."""
        start = self.format.tool_call_start
        return self.grammar.marker_id(start) if start else None

    @functools.cached_property
    def media_markers(self) -> tuple[str, ...]:
        return media_markers(self.loaded.processor)

    def build(self, spec: CallSpec, sink) -> tuple[Request, Optional[ChatOutputParser]]:
        """The request for the engine thread, with its logits processors, and the parser of
        its output (None for a raw prompt); raises the call's typed error instead."""
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
        renderer = self.renderer
        parser = None
        processors: list = []
        lane, media, cache_points, stop_exempt = "text", None, [], None
        starts_in_reasoning = False
        if spec.messages is not None:
            chat = self.render_chat(
                spec.messages, tools=spec.tools, tool_choice=spec.tool_choice,
                response_format=spec.response_format, reasoning=spec.reasoning,
                parallel_tool_calls=spec.parallel_tool_calls, template_kwargs=spec.template_kwargs)
            messages, plan, text, prompt_ids, turns = chat.messages, chat.plan, chat.text, chat.ids, chat.turns
            if chat.has_media:
                # Routing: media goes to the vision lane, everything else to the text lane
                # (MTP and the caches live there). Images are decoded below, on this thread,
                # so a bad image fails this call before anything is queued.
                lane = "vision"
            opts = self.options
            if lane == "vision":
                media = {"images": self.load_images(messages, turns), "text": text}
            caching = opts.vision_cache_bytes if lane == "vision" else opts.prefix_cache_bytes
            if caching or (lane == "text" and opts.specprefill_draft is not None):
                # The prefix caches' snapshot points; SpecPrefill keeps the system prompt dense.
                cache_points = renderer.cache_points(
                    messages, prompt_ids, tools=plan.tools, template_kwargs=plan.template_kwargs, turns=turns,
                    history=None if opts.prefix_cache_history and caching else False)
            fmt = self.format
            starts_in_reasoning = fmt.opens_in_reasoning(text, renderer.continued_text(
                messages, text, tools=plan.tools, template_kwargs=plan.template_kwargs, turns=turns))
            call_start_id = self.call_start_id if plan.parse_tool_calls else None
            parser = ChatOutputParser(
                fmt, tools=plan.tools, parse_tool_calls=plan.parse_tool_calls,
                forced_json_calls=plan.forced_json_calls, forced_call=plan.forced_call,
                max_tool_calls=plan.max_tool_calls, starts_in_reasoning=starts_in_reasoning, verbatim=plan.verbatim,
                call_start_by_token=call_start_id is not None)
            if plan.banned_token_ids:
                processors.append(TokenBan(plan.banned_token_ids))
            constraint = plan.constraint
            if plan.reason_first:
                if self.think_ids is None:
                    raise ConstraintError(
                        "reasoning=True with a response_format or a forced tool call needs reasoning markers "
                        f"that are one token each; {fmt.think_start!r} and {fmt.think_end!r} are not")
                # The answer's grammar alone first: one that matches no string compiles, and
                # nested after a reasoning it would end the answer empty, with "stop". (The
                # second compile costs about 0.5 ms for a JSON schema on CPU, measured.)
                self.grammar.compile(constraint)
                constraint = after_reasoning(constraint, self.think_ids, opened=starts_in_reasoning)
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
            grammar = self.grammar
            processors.append(GrammarProcessor(
                grammar.compile(constraint), tiers=grammar.tiers(), eos_token_ids=grammar.eos_token_ids,
                max_tokens=req.max_tokens, vocab_size=grammar.vocab_size, hints=grammar.hint_ids(constraint),
                text_markup=constraint.text_markup))
            req.extra["constrained"] = constraint.description
        if open_call is not None:
            grammar = self.grammar
            # Compiled here, so a bad tool schema fails this call; each call it opens gets a copy.
            pristine = grammar.compile(open_call)
            processors.append(LazyToolCallGrammar(
                pristine.deep_copy, start_id=plan.call_start_id, tiers=grammar.tiers(),
                eos_token_ids=grammar.eos_token_ids, max_tokens=req.max_tokens,
                vocab_size=grammar.vocab_size, hints=grammar.hint_ids(open_call),
                think_ids=self.think_ids, starts_in_reasoning=starts_in_reasoning,
                text_markup=open_call.text_markup))
        req.processors = processors
        return req, parser

    def render_chat(self, messages, *, tools, tool_choice, response_format, reasoning,
                    parallel_tool_calls, template_kwargs) -> RenderedChat:
        """A chat validated, planned (chat_plan.py) and rendered by the model's template: what
        both a request and ``Engine.apply_chat_template`` see, so the two never disagree."""
        messages = validate_messages(messages)
        media = has_media(messages)
        if media:
            self.check_media(messages, tools)
        plan = plan_chat(
            self.format, tools=tools, tool_choice=tool_choice, response_format=response_format,
            reasoning=reasoning, parallel_tool_calls=parallel_tool_calls, template_kwargs=template_kwargs,
            marker=self.grammar.marker, encode=self.renderer.encode,
            constrain_calls=self.options.constrain_tool_calls)
        text, ids, turns = self.renderer.render_chat(messages, tools=plan.tools, template_kwargs=plan.template_kwargs)
        return RenderedChat(messages, media, plan, text, ids, turns)

    def check_media(self, messages: list, tools) -> None:
        """Media this model can take, before the chat is rendered."""
        if not self.loaded.supports_images:
            raise UnsupportedContentError(
                f"{self.loaded.path.name} is a text-only model; this request carries an image, "
                "video or audio part")
        refuse_media_markers(messages, tools, self.media_markers)

    def load_images(self, messages: list, turns) -> list:
        """A request's images in the order its rendered prompt shows them (``turns``: what
        the history was normalized with), read and checked on the caller's thread (PIL
        only), so a bad image fails its call before anything is queued."""
        return load_images(messages, allow_remote=self.options.allow_remote_images,
                           max_pixels=self.options.max_image_pixels, turns=turns)
