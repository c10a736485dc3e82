"""Chat rendering: normalized messages -> prompt token ids through the tokenizer's chat template.

Runs on the caller's thread (pure Python, no mlx). A template failure is a TemplateError for
that request only. The tokenizer is guarded by a lock: HF fast tokenizers raise
"Already borrowed" when one instance is used from several threads at once.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
import threading
from collections import OrderedDict
from typing import Any, NamedTuple, Optional, Sequence

from .errors import InvalidRequestError, TemplateError
from .messages import CallTurns, Message, normalize_messages, text_of, TEXT_PART_TYPES
from .token_trie import common_prefix_length


# Part types as templates spell them (the adapters already write "image").
_TEMPLATE_PART_TYPES = {**{t: "text" for t in TEXT_PART_TYPES}, "image_url": "image", "input_image": "image"}


def short_call_id(call_id: Any) -> Any:
    """A call id as Mistral's templates take it: 9 letters or digits ("Tool call IDs should be
    alphanumeric strings with length 9"), kept where it is one already, else derived from
    the id (the same for a call and the result that answers it). vLLM shortens them too."""
    if not isinstance(call_id, str) or re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    return hashlib.sha1(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:9]


def _template_ready(messages: list[Message], *, short_ids: bool = False) -> list[Message]:
    """Shape messages the way HF chat templates expect them.

    Text-only part lists become strings (many templates only render string content); in
    lists with media, the Responses API's ``input_text``/``output_text`` parts become
    ``text`` parts and OpenAI's ``image_url``/``input_image`` parts become ``image`` parts
    (templates such as Gemma's render only those: the image was read, its placeholder
    missing); and tool-call arguments given as JSON strings (OpenAI style) become dicts
    (HF style). ``short_ids``: call ids become ``short_call_id``'s (Mistral's templates).
    """
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list) and all(p.get("type") in TEXT_PART_TYPES for p in content):
            m["content"] = text_of(content)
        elif isinstance(content, list):
            m["content"] = [{**p, "type": _TEMPLATE_PART_TYPES.get(p.get("type"), p.get("type"))} for p in content]
        if m.get("content") is None:
            m["content"] = ""
        if short_ids and "tool_call_id" in m:
            m["tool_call_id"] = short_call_id(m["tool_call_id"])
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                if short_ids and "id" in call:
                    call["id"] = short_call_id(call["id"])
                nested = "function" in call  # OpenAI style; else the HF style's top-level name
                fn = dict(call["function"]) if nested else call
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except (json.JSONDecodeError, RecursionError):
                        pass  # keep the raw string; the template prints it as is
                if nested:
                    call["function"] = fn
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out


# Two user messages that differ from their first character on.
_PROBES = ("A", "Z")


def raw_prompt_ids(prompt: Any, encode, vocab_size: int) -> list[int]:
    """A raw prompt's token ids: a string is encoded (no template), a sequence is taken as ids."""
    if isinstance(prompt, str):
        return encode(prompt)
    try:
        if isinstance(prompt, (bytes, bytearray)) or any(isinstance(t, bool) for t in prompt):
            raise TypeError  # bytes are not token ids, nor are booleans
        ids = [operator.index(t) for t in prompt]  # ints only: no floats or strings
    except TypeError:
        raise InvalidRequestError("a prompt is a string or a sequence of token ids (ints)") from None
    if any(t < 0 or t >= vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
    return ids


def _digest(msgs: list[Message], tools, template_kwargs) -> bytes:
    """A key for messages, tools and template kwargs, however long the messages."""
    text = json.dumps([msgs, tools, template_kwargs], sort_keys=True, default=str)
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()


def render_template(tokenizer, msgs: list[Message], **kwargs) -> str:
    """The chat template's text for ``msgs``, its own thinking default kept when the caller
    names none (``reasoning=None``).

    Why not ``TokenizerWrapper.apply_chat_template`` alone: mlx-lm 0.32's wrapper passes
    ``enable_thinking=has_thinking`` (its ``_thinking_kwarg``) whenever the caller passes
    none, so every template that knows ``<think>`` thought by default, Qwen3.5's too, which
    opens thinking only when asked (``enable_thinking is true``): the answers of a request
    that asked for nothing went to reasoning, to the whole budget on a small model. Without
    the kwarg this renders through what the wrapper itself calls (its custom renderer, or
    the Hugging Face tokenizer's template), as transformers and vLLM render it. A tokenizer
    without think markers keeps the wrapper's ``enable_thinking=False``: the output parser
    could not tell its reasoning from its answer (chat_format.py).
    """
    thinking = getattr(tokenizer, "_thinking_kwarg", None)
    inner = getattr(tokenizer, "_tokenizer", None)
    if thinking is None or inner is None or thinking in kwargs or "enable_thinking" in kwargs \
            or not getattr(tokenizer, "has_thinking", False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, **kwargs)
    custom = getattr(tokenizer, "_chat_template", None)
    if custom is not None:
        return custom(msgs, **kwargs)
    return inner.apply_chat_template(msgs, tokenize=False, return_dict=False, **kwargs)


class RenderedChat(NamedTuple):
    text: str
    ids: list[int]
    turns: CallTurns


class PromptRenderer:
    """Renders chats to token ids with one tokenizer, safely from many threads."""

    def __init__(self, tokenizer, *, short_call_ids: bool = False):
        self._tokenizer = tokenizer
        self._short_ids = short_call_ids  # the template wants Mistral's 9-character call ids
        self.lock = threading.Lock()
        # _digest(messages, tools, kwargs) -> the tokens every prompt of them and a user starts with
        self._shared_prefixes: OrderedDict[bytes, list[int]] = OrderedDict()
        # _digest(messages through the last reply, tools, kwargs) -> requests that held them
        self._histories: OrderedDict[bytes, int] = OrderedDict()
        self._call_turns: Optional[CallTurns] = None

    @property
    def call_turns(self) -> CallTurns:
        """What the template makes of an assistant turn with calls (``CallTurns``), found
        once by rendering small probe histories: whether the turn's text is printed beside
        its calls, and whether it takes two calls. Normalization merges an assistant's text
        and calls into one turn only where the template keeps both. Where a probe cannot
        render at all (a template with no calls), the merges stay on."""
        if self._call_turns is None:
            self._call_turns = self._probe_call_turns()
        return self._call_turns

    def _probe_call_turns(self) -> CallTurns:
        def render(turn: dict, results: int) -> Optional[str]:
            msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", **turn},
                    *({"role": "tool", "tool_call_id": f"probecall{k}", "content": "R"} for k in range(results)),
                    {"role": "assistant", "content": "A"}]
            try:
                return self._apply(_template_ready(msgs, short_ids=self._short_ids), None, False, None)
            except TemplateError:
                return None

        def calls(n: int) -> list[dict]:
            return [{"id": f"probecall{k}", "type": "function",
                     "function": {"name": f"probe_tool_{k}", "arguments": {}}} for k in range(n)]

        one = render({"content": None, "tool_calls": calls(1)}, 1)
        if one is None or "probe_tool_0" not in one:
            return CallTurns()
        marked = render({"content": "PROBE_TEXT_BESIDE_CALLS", "tool_calls": calls(1)}, 1)
        two = render({"content": None, "tool_calls": calls(2)}, 2)
        return CallTurns(text=marked is not None and "PROBE_TEXT_BESIDE_CALLS" in marked,
                         several=two is not None and "probe_tool_1" in two)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Optional[Sequence[dict]] = None,
        add_generation_prompt: bool = True,
        template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[int]:
        return self.render_with_text(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     template_kwargs=template_kwargs)[1]

    def render_with_text(self, messages: Sequence[Message], **options: Any) -> tuple[str, list[int]]:
        """The rendered prompt text and its token ids (``render_chat``'s first two; the same
        options)."""
        rendered = self.render_chat(messages, **options)
        return rendered.text, rendered.ids

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Optional[Sequence[dict]] = None,
        add_generation_prompt: bool = True,
        template_kwargs: Optional[dict[str, Any]] = None,
    ) -> "RenderedChat":
        """The rendered prompt text, its token ids, and the ``CallTurns`` its history was
        normalized with (``cache_points``, ``continued_text`` and the images' order must
        use the same).

        ``template_kwargs={"continue_final_message": True}`` (as in transformers and vLLM)
        leaves a final assistant message open, so the answer continues it (a prefill that
        steers the answer); by default a final assistant message is history, closed, and a
        new assistant turn follows, as OpenAI's API does.
        """
        turns = self.call_turns
        msgs = _template_ready(normalize_messages(messages, turns), short_ids=self._short_ids)
        if (template_kwargs or {}).get("continue_final_message") and (not msgs or msgs[-1]["role"] != "assistant"):
            raise InvalidRequestError("continue_final_message needs a chat that ends with an assistant message")
        try:
            text = self._apply(msgs, tools, add_generation_prompt, template_kwargs)
        except TemplateError as first:
            if turns == CallTurns():
                raise
            # Kept apart, the text and calls broke the template's own rules (Mistral v3: an
            # assistant's text, its calls, the results and its answer are two text turns in
            # a row to its alternation check). Merged, as the template's design wants, the
            # history renders; the text it does not print is its choice.
            turns = CallTurns()
            merged = _template_ready(normalize_messages(messages, turns), short_ids=self._short_ids)
            try:
                text = self._apply(merged, tools, add_generation_prompt, template_kwargs)
            except TemplateError:
                raise first from None
        return RenderedChat(text, self.encode(text), turns)

    def continued_text(self, messages: Sequence[Message], text: str, *, tools: Optional[Sequence[dict]] = None,
                       template_kwargs: Optional[dict[str, Any]] = None, turns: Optional[CallTurns] = None) -> str:
        """Under ``continue_final_message``, the part of the prompt ``text`` that renders the
        final assistant message (what the answer goes on from); "" otherwise. Found as what
        follows the rest of the chat rendered with its generation prompt. ``turns``: what
        ``render_chat`` normalized ``text``'s history with."""
        if not (template_kwargs or {}).get("continue_final_message"):
            return ""
        msgs = _template_ready(normalize_messages(messages, turns or self.call_turns), short_ids=self._short_ids)
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "continue_final_message"}
        head = self._apply(msgs[:-1], tools, True, kwargs) if len(msgs) > 1 else ""
        n = 0
        for a, b in zip(head, text):  # a template may render history a little differently
            if a != b:
                break
            n += 1
        return text[n:]

    def _apply(self, msgs: list[Message], tools, add_generation_prompt: bool, template_kwargs) -> str:
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = list(tools)
        if kwargs.get("continue_final_message"):
            add_generation_prompt = False  # the answer goes on inside the final message
        try:
            with self.lock:
                return render_template(self._tokenizer, msgs, add_generation_prompt=add_generation_prompt, **kwargs)
        except InvalidRequestError:
            raise
        except Exception as exc:  # jinja2 errors, raise_exception() in templates, ...
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ cache points
    def cache_points(
        self,
        messages: Sequence[Message],
        prompt_ids: Sequence[int],
        *,
        tools: Optional[Sequence[dict]] = None,
        template_kwargs: Optional[dict[str, Any]] = None,
        turns: Optional[CallTurns] = None,
        history: Optional[bool] = False,
    ) -> list[tuple[int, str]]:
        """Prompt lengths worth a prefix-cache snapshot, found for any chat template.

        - "system": where the system prompt (and tool definitions) end. The template renders
          the system messages followed by two different probe user messages; their common
          token prefix is the part every conversation with this system prompt shares.
        - "turn": where the conversation before this request's generation prompt ends; the
          next turn of the conversation starts with it.
        - "history": where the conversation through its last assistant message ends, found
          with the same probes: what requests that differ only in the messages after it
          share (few-shot examples written as messages, one conversation fanned out).
          ``history=True`` finds it; None (the engine's call) counts this request as one
          that holds that history and finds it only from the second such request on:
          the probes render the whole history twice (56 ms for 20K tokens, measured), and
          in a conversation every turn's history is new, read by its next turn from the
          "turn" point anyway.

        No ChatML (or other) markers are searched for. A boundary that the actual prompt does
        not share is cut back to the common prefix. ``turns``: what ``render_chat``
        normalized the prompt's history with.
        """
        msgs = _template_ready(normalize_messages(messages, turns or self.call_turns), short_ids=self._short_ids)
        # The probes and the history end elsewhere than the prompt: no final message to continue.
        template_kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "continue_final_message"}
        points = []
        n_system = next((i for i, m in enumerate(msgs) if m.get("role") != "system"), len(msgs))
        if n_system or tools:
            shared = self._before_a_user(msgs[:n_system], tools, template_kwargs, _digest(msgs[:n_system], tools,
                                                                                          template_kwargs))
            points.append((common_prefix_length(shared, prompt_ids), "system"))
        try:
            before = self.encode(self._apply(msgs, tools, False, template_kwargs))
        except TemplateError:  # e.g. templates that insist on a final user turn
            before = []
        points.append((common_prefix_length(before, prompt_ids), "turn"))
        last_reply = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=len(msgs))
        if history is not False and last_reply < len(msgs) - 1:
            earlier = msgs[:last_reply + 1]
            key = _digest(earlier, tools, template_kwargs)
            if history or self._seen_before(key):
                # (appended last: a point that clashes with another keeps the other's kind)
                shared = self._before_a_user(earlier, tools, template_kwargs, key)
                points.append((common_prefix_length(shared, prompt_ids), "history"))
        out, seen = [], set()
        for n, kind in points:
            if 0 < n < len(prompt_ids) and n not in seen:
                seen.add(n)
                out.append((n, kind))
        return out

    def _seen_before(self, key: bytes) -> bool:
        """Count one more request holding the history of digest ``key``; did an earlier one
        (of the last 4,096 histories) hold it too?"""
        with self.lock:
            seen = self._histories.get(key, 0)
            self._histories[key] = seen + 1
            self._histories.move_to_end(key)
            while len(self._histories) > 4096:
                self._histories.popitem(last=False)
        return seen > 0

    def _before_a_user(self, msgs: list[Message], tools, template_kwargs, key: bytes) -> list[int]:
        """The tokens every prompt of ``msgs`` followed by a user message starts with
        (``key``: their ``_digest``)."""
        with self.lock:
            hit = self._shared_prefixes.get(key)
            if hit is not None:
                self._shared_prefixes.move_to_end(key)
                return hit
        try:
            a, b = (self.encode(self._apply(msgs + [{"role": "user", "content": probe}], tools, False,
                                            template_kwargs)) for probe in _PROBES)
        except TemplateError:
            a = b = []
        shared = a[: common_prefix_length(a, b)]
        with self.lock:
            self._shared_prefixes[key] = shared
            while len(self._shared_prefixes) > 64:
                self._shared_prefixes.popitem(last=False)
        return shared

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer can take it
            raise InvalidRequestError(f"the prompt is not valid Unicode: {exc}") from None
        with self.lock:
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        with self.lock:
            return self._tokenizer.decode(list(token_ids))
