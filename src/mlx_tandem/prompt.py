"""Chat rendering: normalized messages -> prompt token ids through the tokenizer's chat template.

Runs on the caller's thread (pure Python, no mlx). A template failure is a TemplateError for
that request only. The tokenizer is guarded by a lock: HF fast tokenizers raise
"Already borrowed" when one instance is used from several threads at once.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Optional, Sequence

from .errors import InvalidRequestError, TemplateError
from .messages import Message, normalize_messages, text_of, TEXT_PART_TYPES


def _template_ready(messages: list[Message]) -> list[Message]:
    """Shape messages the way HF chat templates expect them.

    Text-only part lists become strings (many templates only render string content), and
    tool-call arguments given as JSON strings (OpenAI style) become dicts (HF style).
    """
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list) and all(p.get("type") in TEXT_PART_TYPES for p in content):
            m["content"] = text_of(content)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        pass  # keep the raw string; the template prints it as is
                call["function"] = fn
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out


class PromptRenderer:
    """Renders chats to token ids with one tokenizer, safely from many threads."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.lock = threading.Lock()

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

    def render_with_text(
        self,
        messages: Sequence[Message],
        *,
        tools: Optional[Sequence[dict]] = None,
        add_generation_prompt: bool = True,
        template_kwargs: Optional[dict[str, Any]] = None,
    ) -> tuple[str, list[int]]:
        """The rendered prompt text and its token ids."""
        msgs = _template_ready(normalize_messages(messages))
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = list(tools)
        try:
            with self.lock:
                text = self._tokenizer.apply_chat_template(
                    msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
                )
        except InvalidRequestError:
            raise
        except Exception as exc:  # jinja2 errors, raise_exception() in templates, ...
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return text, self.encode(text)

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        with self.lock:
            return self._tokenizer.decode(list(token_ids))
