"""What a model's chat format looks like: reasoning markers and the tool-call syntax.

Inferred by mlx-lm's TokenizerWrapper from the chat template and vocabulary (the same
inference ``mlx_lm.server`` uses), so every tool-call syntax mlx-lm has a parser for, we
can parse; a call can be forced in any syntax with a start marker (the native body for
``json_tools`` and ``qwen3_coder``, else a JSON body between the markers, or a JSON list
after a lone start marker: constraints.py). A ``tool_parser_type``
in tokenizer_config.json overrides the inference (mlx-lm reads it). Not read yet: mlx-lm's
``structural_markers`` and ``response_transitions`` (Kimi K3's wrappers, header channels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .tool_parser_fixes import fixed


@dataclass(frozen=True)
class ChatFormat:
    think_start: Optional[str] = None
    think_end: Optional[str] = None
    think_end_ids: tuple[int, ...] = ()  # the token ids of ``think_end`` (counting reasoning tokens)
    thinking_kwarg: str = "enable_thinking"
    tool_call_start: Optional[str] = None
    tool_call_end: Optional[str] = None
    tool_call_end_ids: tuple[int, ...] = ()  # the token ids of ``tool_call_end``
    tool_format: Optional[str] = None  # mlx-lm tool parser module name, e.g. "json_tools"
    tool_parser: Optional[Callable[[str, Any], Any]] = None
    template_has_tools: bool = False  # the template renders a ``tools`` list

    @property
    def has_thinking(self) -> bool:
        return bool(self.think_start and self.think_end)

    def opens_in_reasoning(self, prompt: str, continued: str = "") -> bool:
        """Does the answer to ``prompt`` start inside a reasoning: the prompt ends with
        ``<think>``, or ``continued`` (the final assistant message it goes on from, a
        prefill) has a ``<think>`` with no ``</think>`` after it?"""
        if not self.has_thinking:
            return False
        i = continued.rfind(self.think_start)
        return prompt.rstrip().endswith(self.think_start) or (i >= 0 and self.think_end not in continued[i:])

    @property
    def has_tool_calling(self) -> bool:
        return self.tool_parser is not None and bool(self.tool_call_start)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatFormat":
        """``tokenizer`` is mlx-lm's TokenizerWrapper."""
        parser = getattr(tokenizer, "tool_parser", None)
        fmt = parser.__module__.rsplit(".", 1)[-1] if parser is not None else None
        template = getattr(tokenizer, "chat_template", None) or ""
        if not isinstance(template, str):  # named templates: {"default": ..., "tool_use": ...}
            template = " ".join(str(t) for t in dict(template).values()) if template else ""
        has_thinking = bool(getattr(tokenizer, "has_thinking", False))
        return cls(
            think_start=tokenizer.think_start if has_thinking else None,
            think_end=tokenizer.think_end if has_thinking else None,
            think_end_ids=tuple(getattr(tokenizer, "think_end_tokens", None) or ()) if has_thinking else (),
            thinking_kwarg=getattr(tokenizer, "_thinking_kwarg", "enable_thinking") or "enable_thinking",
            tool_call_start=getattr(tokenizer, "tool_call_start", None),
            tool_call_end=getattr(tokenizer, "tool_call_end", None),
            tool_call_end_ids=_ids(tokenizer, getattr(tokenizer, "tool_call_end", None)),
            tool_format=fmt,
            tool_parser=fixed(fmt, parser),
            template_has_tools="tools" in template,
        )


def _ids(tokenizer, text: Optional[str]) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(tokenizer.encode(text, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it: found by text only
        return ()
