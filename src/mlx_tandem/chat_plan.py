"""Plan a chat request: tools, tool_choice, response_format and reasoning -> how to run it.

Front end, caller's thread. Decides what the template renders, which grammar (if any)
constrains the output, which tokens are banned, and how the output is parsed. Both
adapters go through this, so tool calling and structured output behave the same in
LangChain and LlamaIndex.

Decisions (see docs/design.md, "Tools and structured output"):
- ``tool_choice``: None/"auto" lets the model choose; "none" renders no tools and bans the
  tool-call marker token; "required"/"any"/True forces a call of any tool, a tool name (or
  ``{"type": "function", "function": {"name": ...}}``) forces that tool.
- A request without tools cannot call one, as in OpenAI's API: the marker token is banned
  there too, so a model that opens a call anyway (small models do) answers in text instead
  of returning call markup as its content. Not when ``template_kwargs`` carries ``tools``:
  that caller renders and parses calls itself.
- A constrained request (forced tool call or response_format) is rendered with reasoning
  off by default: a grammar constrains the answer from its first token. Asked for
  ``reasoning=True``, it reasons first and the grammar holds what follows the reasoning
  (``reason_first``; the engine wraps the constraint once it knows whether the rendered
  prompt opened the reasoning).
- A forced tool_choice forces exactly one call unless ``parallel_tool_calls=True`` is given:
  the grammar governs the whole answer, and an open-ended list of calls lets a weak model
  loop until its budget runs out. Under "auto" the model may make any number of calls,
  unless ``parallel_tool_calls=False``: then the answer ends at its first valid call
  (finish_reason "tool_calls", the row freed at once), as OpenAI's API does.
- Under "auto", a call the model opens is held to the listed tools and their schemas by a
  lazy grammar (tool_call_grammar.py), where the grammar can write the format's own call
  body (JSON for ``json_tools``, XML for ``qwen3_coder``: ``constraints.native_body``) and
  the engine option ``constrain_tool_calls`` is on (the default).
- Under "auto" with a JSON response_format (``json_object``, ``json_schema``), the answer is
  either calls of the listed tools or JSON that matches the format, as in OpenAI's API: the
  format holds the text answer, not the tools. A Lark or regex response_format is the whole
  answer (a caller who wants calls there writes them into the grammar).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .chat_format import ChatFormat
from .constraints import (Constraint, call_or_answer_constraint, native_body, open_call_constraint,
                          response_format_constraint, tool_call_constraint)
from .errors import ConstraintError, InvalidRequestError


@dataclass
class ChatPlan:
    tools: Optional[list[dict]]  # what the template renders
    template_kwargs: dict[str, Any]
    constraint: Optional[Constraint] = None
    banned_token_ids: list[int] = field(default_factory=list)
    parse_tool_calls: bool = False
    forced_json_calls: bool = False
    forced_call: bool = False  # tool_choice names tools: the answer is calls (after any reasoning)
    # "auto" with a lazy grammar: the rest of a call, applied once the model emits start_id.
    open_call: Optional[Constraint] = None
    call_start_id: Optional[int] = None
    max_tool_calls: Optional[int] = None  # 1 under parallel_tool_calls=False; None: any number
    reason_first: bool = False  # the constraint holds the answer after the reasoning
    # A JSON or regex response_format holds the whole answer: its text is the content, not
    # parsed for markers (it may spell "<think>" or "<tool_call>", always in ordinary tokens).
    # A Lark grammar may write the markers themselves (``<think>``, a token): parsed.
    verbatim: bool = False


def _verbatim(constraint: Optional[Constraint], reason_first: bool) -> bool:
    return constraint is not None and constraint.kind in ("json_schema", "regex") and not reason_first


def normalize_tools(tools: Optional[Sequence[Any]]) -> list[dict]:
    """OpenAI function tools; bare ``{"name", "parameters"}`` dicts are wrapped."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise InvalidRequestError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
    out = []
    for t in tools or []:
        if not isinstance(t, dict):
            raise InvalidRequestError(f"a tool must be a dict (OpenAI function schema), got {type(t).__name__}")
        if "function" not in t and "name" in t:
            t = {"type": "function", "function": t}
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name") \
                or not isinstance(fn["name"], str):
            raise InvalidRequestError(f"not an OpenAI function tool: {t!r}")
        params = fn.get("parameters")
        # Arguments are an object (OpenAI's rule): a call of a tool whose schema is a string
        # or an array could only ever be parsed as invalid.
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ConstraintError(f"tool {fn['name']!r}: parameters must be a JSON schema of type 'object'")
        out.append({"type": "function", "function": dict(fn)})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"duplicate tool names: {names}")
    return out


#: tool_choice keywords, as a string or as a dict's "type" (Anthropic's {"type": "any"}).
_TOOL_CHOICE_WORDS = ("auto", "none", "required", "any")


def _forced_names(tool_choice: Any, names: list[str]) -> Optional[list[str]]:
    """None for "auto"; [] for "none"; the names a forced call may use otherwise.

    A dict that names a tool forces that tool, even one called "none" or "auto" (it was
    read as the keyword), and a dict of no known shape is an error (``{"name": "f"}``
    without a type was read as "auto": the call the caller forced never came).
    """
    tc = tool_choice
    if isinstance(tc, dict):
        kind = tc.get("type")
        if kind in (None, "function", "tool"):  # OpenAI's forms (nested or not), Anthropic's, a bare name
            fn = tc.get("function")
            name = (fn.get("name") if isinstance(fn, dict) else None) or tc.get("name")
            if not isinstance(name, str) or not name:  # not "auto": the caller meant to force a call
                raise ConstraintError(f"tool_choice {tool_choice!r} names no tool")
            return _named_tool(name, tool_choice, names)
        if kind not in _TOOL_CHOICE_WORDS:
            raise ConstraintError(f"unsupported tool_choice {tool_choice!r}")
        tc = kind
    if tc is None or tc == "auto" or tc is False:
        return None
    if tc == "none":
        return []
    if tc is True or tc in ("required", "any"):
        if not names:
            raise ConstraintError(f"tool_choice={tool_choice!r} needs tools")
        return list(names)
    if isinstance(tc, str):
        return _named_tool(tc, tool_choice, names)
    raise ConstraintError(f"unsupported tool_choice {tool_choice!r}")


def _named_tool(name: str, tool_choice: Any, names: list[str]) -> list[str]:
    if not names:
        raise ConstraintError(f"tool_choice={tool_choice!r} needs tools")
    if name not in names:
        raise ConstraintError(f"tool_choice names {name!r}, which is not among the tools {names}")
    return [name]


def plan_chat(
    fmt: ChatFormat,
    *,
    tools: Optional[Sequence[Any]],
    tool_choice: Any,
    response_format: Optional[dict],
    reasoning: Optional[bool],
    parallel_tool_calls: Optional[bool],
    template_kwargs: Optional[dict],
    marker,
    encode,
    constrain_calls: bool = True,
) -> ChatPlan:
    tools = normalize_tools(tools)
    names = [t["function"]["name"] for t in tools]
    forced = _forced_names(tool_choice, names) if (tools or tool_choice not in (None, "auto", "none")) else None
    if reasoning is not None and not isinstance(reasoning, bool):
        raise InvalidRequestError(f"reasoning must be True, False or None, got {reasoning!r}")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be True, False or None, got {parallel_tool_calls!r}")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise InvalidRequestError(f"template_kwargs must be a dict, got {type(template_kwargs).__name__}")
    kwargs = dict(template_kwargs or {})
    if reasoning is not None and fmt.has_thinking:
        kwargs[fmt.thinking_kwarg] = bool(reasoning)

    constraint = response_format_constraint(response_format)
    if forced:
        if constraint is not None:
            raise ConstraintError("give either a forced tool_choice or a response_format, not both")
        constraint = tool_call_constraint(fmt, tools, forced, parallel=bool(parallel_tool_calls), marker=marker)
    reason_first = constraint is not None and fmt.has_thinking and reasoning is True
    if constraint is not None and fmt.has_thinking and not reason_first:
        kwargs[fmt.thinking_kwarg] = False

    if forced == [] or tool_choice == "none" or (not tools and "tools" not in kwargs):
        # tool_choice="none", or no tools at all: none in the prompt, no call markers out.
        banned = []
        if fmt.tool_call_start:
            ids = encode(fmt.tool_call_start)
            if len(ids) == 1:
                banned = ids
        # Keep the response_format constraint: tool_choice="none" only removes the tools.
        return ChatPlan(tools=None, template_kwargs=kwargs, constraint=constraint, banned_token_ids=banned,
                        reason_first=reason_first, verbatim=_verbatim(constraint, reason_first))
    call_or_answer = (not forced and constraint is not None and constraint.kind == "json_schema"
                      and bool(tools) and bool(fmt.tool_call_start))
    if call_or_answer:
        constraint = call_or_answer_constraint(fmt, tools, constraint, parallel=parallel_tool_calls is not False,
                                               marker=marker)
    open_call, start_id = None, None
    if constrain_calls and tools and constraint is None and native_body(fmt, tools, names) \
            and fmt.tool_call_start and fmt.tool_call_end:
        ids = encode(fmt.tool_call_start)
        if len(ids) == 1:
            open_call, start_id = open_call_constraint(fmt, tools, marker=marker), ids[0]
    return ChatPlan(
        tools=tools or None,
        template_kwargs=kwargs,
        constraint=constraint,
        parse_tool_calls=bool(tools),
        forced_json_calls=(bool(forced) or call_or_answer) and not native_body(fmt, tools, forced or names),
        forced_call=bool(forced),
        open_call=open_call,
        call_start_id=start_id,
        # One call: the answer ends at its end marker (a forced call's grammar would write
        # only EOS after it, which a budget that fits the call exactly had no room for: a
        # whole call ended with "length"). call_or_answer's grammar ends it itself.
        max_tool_calls=1 if tools and not call_or_answer and (
            parallel_tool_calls is not True if forced else parallel_tool_calls is False) else None,
        reason_first=reason_first,
        # With tools a grammar may write calls (a Lark format that names <tool_call>): parsed.
        verbatim=not tools and _verbatim(constraint, reason_first),
    )
