"""LangChain messages <-> mlx-tandem's neutral (OpenAI-style) message dicts and outputs.

Adapter code only: no engine logic. Images are read through ``message.content_blocks``
(LangChain's standard blocks), so base64, data-URI, URL and OpenAI ``image_url`` forms all
arrive as one shape; the engine decides whether the model can take them.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Optional, Sequence

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.utils.json import parse_partial_json

from mlx_tandem.errors import InvalidRequestError, UnsupportedContentError
from mlx_tandem.messages import arguments_text
from mlx_tandem.outputs import ToolCall

PROVIDER = "mlx_tandem"
# ChatMessage roles by other names (other providers', as the LlamaIndex adapter maps them).
_CHAT_ROLES = {"human": "user", "ai": "assistant", "model": "assistant", "chatbot": "assistant"}


def _block_to_part(block: dict) -> Optional[dict]:
    kind = block.get("type")
    if kind == "non_standard":
        return _non_standard_to_part(block.get("value") or {})
    if kind == "text":
        return {"type": "text", "text": block.get("text", "")}
    if kind == "refusal" and isinstance(block.get("refusal"), str):  # an OpenAI assistant turn's
        return {"type": "text", "text": block["refusal"]}
    if kind == "text-plain":  # a plain-text document (e.g. Anthropic's)
        return {"type": "text", "text": _plain_text(block)}
    if kind in ("image", "audio", "video"):
        if block.get("base64"):
            mime = block.get("mime_type") or f"{kind}/*"
            src: Any = f"data:{mime};base64,{block['base64']}"
        elif block.get("url"):
            src = block["url"]
        elif block.get("file_id") or block.get("id"):
            raise UnsupportedContentError(f"{kind} blocks given by file id cannot be read locally")
        else:
            raise InvalidRequestError(f"{kind} block without base64 data or url")
        return {"type": kind, kind: src}
    if kind in ("reasoning", "tool_call", "tool_call_chunk", "invalid_tool_call", "server_tool_call",
                "server_tool_result"):
        return None  # not content of a prompt turn (tool calls travel separately)
    if kind == "file":
        raise UnsupportedContentError("file/PDF content blocks are not supported by mlx-tandem models")
    raise UnsupportedContentError(f"unsupported content block type {kind!r}")


def _plain_text(block: dict) -> str:
    """A ``text-plain`` block's text: given as text, or as base64 (langchain-core allows
    either); a URL or file id is not fetched (a prompt must not make the engine fetch)."""
    if block.get("text") is not None or not block.get("base64"):
        if block.get("text") is None and (block.get("url") or block.get("file_id")):
            raise UnsupportedContentError("text-plain blocks given by url or file id are not fetched; pass the text")
        return block.get("text") or ""
    try:
        return base64.b64decode(block["base64"], validate=True).decode("utf-8")
    except (binascii.Error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidRequestError(f"a text-plain block's base64 is not UTF-8 text: {exc}") from None


def _non_standard_to_part(value: dict) -> dict:
    """Blocks core does not translate arrive as ``non_standard``. Read the common ones (the
    Responses API's input blocks, ``image_url`` given as a bare string); refuse the rest
    rather than drop them: a silently dropped image or text gets an answer to a different
    prompt."""
    kind = value.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": value.get("text", "")}
    url = value.get("image_url")
    if kind in ("input_image", "image_url") and isinstance(url, str) and url:
        return {"type": "image", "image": url}
    raise UnsupportedContentError(f"unsupported content block type {kind!r}")


def _readable(value: dict) -> bool:
    try:
        _non_standard_to_part(value)
    except UnsupportedContentError:
        return False
    return True


def _content(message: BaseMessage) -> str | list[dict]:
    if isinstance(message.content, str):
        return message.content
    blocks = message.content_blocks
    if isinstance(message, ToolMessage):
        # A tool's output is data for the model: a block core has no type for (e.g. a
        # tool returning [{"type": "json", ...}]) is shown as its JSON text, not refused;
        # one this adapter reads (an input_image, an image_url string) is read as elsewhere.
        blocks = [{"type": "text", "text": json.dumps(b.get("value"), ensure_ascii=False, default=str)}
                  if b.get("type") == "non_standard" and not _readable(b.get("value") or {}) else b
                  for b in blocks]
    elif isinstance(message, AIMessage):
        # A provider's own blocks in an assistant turn (Anthropic's tool_use, thinking, ...)
        # are the model's output, not prompt content; its calls travel as tool_calls. They
        # are skipped, as AIMessage.text skips them; text and images are read.
        blocks = [b for b in blocks if b.get("type") != "non_standard" or _readable(b.get("value") or {})]
    parts = [p for p in (_block_to_part(b) for b in blocks) if p is not None]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _object_text(args: Any) -> str:
    try:
        parsed = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        parsed = None
    return args if isinstance(parsed, dict) else "{}"


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    answered = {m.tool_call_id for m in messages if isinstance(m, ToolMessage)}
    out: list[dict] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            d: dict = {"role": "system", "content": _content(m)}
        elif isinstance(m, HumanMessage):
            d = {"role": "user", "content": _content(m)}
        elif isinstance(m, AIMessage):
            # Every block, as for the other roles: an image in an assistant turn is content.
            d = {"role": "assistant", "content": _content(m)}
            # A call with no name is a streamed invalid call that LangChain merged into a
            # valid one (``ChunkBuilder`` names no invalid call); like an invalid call, it
            # goes back only where a result answers it (unanswered it re-rendered as a call
            # the model never finished, where invoke's message rendered none).
            calls = [{"id": tc.get("id") or f"call_{i}", "type": "function",
                      "function": {"name": tc["name"], "arguments": arguments_text(tc["args"], f"call {tc['name']!r}")}}
                     for i, tc in enumerate(m.tool_calls) if tc["name"] or (tc.get("id") or f"call_{i}") in answered]
            # An invalid call a later tool result answers goes back (langchain-openai sends
            # them all), or that result would follow no call. Its arguments only where they
            # are a JSON object: Qwen3.5's template iterates them (``|items``) and fails on
            # text; the result says what was wrong. One with no name (its text did not parse)
            # goes back with an empty one: templates pair results with calls by position.
            calls += [{"id": tc["id"], "type": "function",
                       "function": {"name": tc.get("name") or "", "arguments": _object_text(tc.get("args"))}}
                      for tc in m.invalid_tool_calls if tc.get("id") in answered]
            if calls:
                d["tool_calls"] = calls
            # v0 keeps reasoning in additional_kwargs; v1 messages (and other providers')
            # may carry it only as reasoning content blocks.
            reasoning = m.additional_kwargs.get("reasoning_content") or "".join(
                b.get("reasoning", "") for b in m.content_blocks if b.get("type") == "reasoning")
            if reasoning:
                d["reasoning_content"] = reasoning
        elif isinstance(m, ToolMessage):
            content = _content(m)
            if m.status == "error":  # templates have no error flag for tool results: say it in the text
                content = _marked_error(content)
            d = {"role": "tool", "content": content, "tool_call_id": m.tool_call_id}
        elif isinstance(m, FunctionMessage):
            d = {"role": "tool", "content": _content(m), "name": m.name, "tool_call_id": m.name}
        elif isinstance(m, ChatMessage):
            role = _CHAT_ROLES.get(m.role, m.role)
            d = {"role": role, "content": _content(m)}
        else:
            raise InvalidRequestError(f"unsupported message type {type(m).__name__}")
        # A tool result's name too: some templates (Gemma's, Llama's ipython) print it.
        if getattr(m, "name", None) and d["role"] in ("user", "assistant", "system", "tool"):
            d["name"] = m.name
        out.append(d)
    return out


def _marked_error(content: Any) -> Any:
    """A failed tool's result, its text starting with "Error:" (a list's first text part, or
    a text part put first when it has none)."""
    if isinstance(content, str):
        return content if content.lower().startswith("error") else f"Error: {content}"
    parts = list(content)
    for i, part in enumerate(parts):
        if isinstance(part, dict) and part.get("type") == "text":
            parts[i] = {**part, "text": _marked_error(part.get("text") or "")}
            return parts
    return [{"type": "text", "text": "Error:"}, *parts]


def usage_metadata(usage) -> dict:
    out = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
           "total_tokens": usage.total_tokens}
    if usage.cached_tokens:
        out["input_token_details"] = {"cache_read": usage.cached_tokens}
    if usage.reasoning_tokens:
        out["output_token_details"] = {"reasoning": usage.reasoning_tokens}
    return out


def response_metadata(model_name: str, finish_reason: Optional[str]) -> dict:
    out = {"model_name": model_name, "model_provider": PROVIDER}
    if finish_reason is not None:
        out["finish_reason"] = finish_reason
    return out


def logprobs_metadata(logprobs) -> dict:
    """``response_metadata["logprobs"]`` as ChatOpenAI's: ``{"content": [OpenAI entries]}``,
    one per answer token (reasoning and calls included). A stream's chunks carry their own
    tokens', which adding the chunks concatenates."""
    return {"logprobs": {"content": [lp.to_openai() for lp in logprobs]}}


def to_ai_message(out, model_name: str, blocks: Optional[list] = None) -> AIMessage:
    """The answer as an AIMessage; its ``content`` the text, or ``blocks`` where given (the
    v1 blocks in the order written: ``WrittenBlocks``)."""
    additional = {"reasoning_content": out.reasoning} if out.reasoning else {}
    metadata = response_metadata(model_name, out.finish_reason)
    if out.logprobs is not None:
        metadata.update(logprobs_metadata(out.logprobs))
    return AIMessage(
        content=out.content if blocks is None else blocks,
        additional_kwargs=additional,
        tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id) for c in out.tool_calls],
        invalid_tool_calls=[invalid_tool_call(name=c.name, args=c.arguments, id=c.id, error=c.error)
                            for c in out.invalid_tool_calls],
        usage_metadata=usage_metadata(out.usage),
        response_metadata=metadata,
    )


def _v1_chunk_blocks(chunk: AIMessageChunk) -> list:
    """A streamed chunk's v1 content blocks (langchain-core's block translator for this
    provider). langchain-core 1.x numbers a stream's blocks in order when they have no index,
    and keeps a tool call chunk's own index, the call's place (0, 1, ...): a call after
    reasoning or text then shares index 0 with that block and the two merge into one. The
    call blocks get their own index space here, as core's OpenAI Responses translator does
    ("lc_" indices); ``tool_call_chunks`` keep their integer index for plain merging."""
    if chunk.chunk_position == "last" or not isinstance(chunk.content, str):
        # A stream's last chunk, or all of them added up (whole calls, as tool_call blocks),
        # or not one of ours: core's best-effort parsing is right.
        raise NotImplementedError
    blocks: list = []
    if reasoning := chunk.additional_kwargs.get("reasoning_content"):
        blocks.append({"type": "reasoning", "reasoning": reasoning})
    if chunk.content:
        blocks.append({"type": "text", "text": chunk.content})
    for c in chunk.tool_call_chunks:
        block = {"type": "tool_call_chunk", "id": c.get("id"), "name": c.get("name"), "args": c.get("args")}
        if c.get("index") is not None:
            block["index"] = f"lc_tc_{c['index']}"
        blocks.append(block)
    return blocks


def _v1_message_blocks(message: AIMessage) -> list:
    raise NotImplementedError  # a whole message: core's best-effort parsing is right


def register_block_translator() -> None:
    from langchain_core.messages.block_translators import register_translator

    register_translator(PROVIDER, _v1_message_blocks, _v1_chunk_blocks)


def _merges_valid(args: Optional[str]) -> bool:
    """Would langchain-core (AIMessageChunk.init_tool_calls) read a streamed call with these
    arguments as a valid call? Empty ones and those that parse, leniently, to an object."""
    if not args:
        return True
    try:
        return isinstance(parse_partial_json(args), dict)
    except Exception:  # noqa: BLE001 - what core cannot parse stays invalid
        return False


def _in_written_order(delta) -> list:
    """A delta's (or an answer's) valid and invalid calls, in the order written."""
    return sorted([*delta.tool_calls, *delta.invalid_tool_calls], key=lambda c: c.index)


def _stretches(content: str, calls: list, start: int) -> list[tuple[str, list]]:
    """``content`` (which begins ``start`` characters into the answer's content) cut where
    ``calls`` (written in it, in order) sat: each stretch of text with the calls written
    after it, and the text after the last call, where there is any."""
    out: list[tuple[str, list]] = []
    at = 0
    for call in calls:
        cut = min(max(call.content_offset - start, at), len(content))
        if cut > at or not out:
            out.append((content[at:cut], []))
            at = cut
        out[-1][1].append(call)
    if at < len(content) or not out:
        out.append((content[at:], []))
    return out


class WrittenBlocks:
    """An answer's v1 content blocks in the order written: text, the calls after it, more
    text. The engine keeps content and calls apart (as OpenAI's messages do); from that
    joined text ``invoke``'s blocks put all text before the calls, while a stream's chunks
    brought them in order (until an audit, 2026-11-30). Reasoning is left to core, which
    puts it first (from ``reasoning_content``)."""

    def __init__(self):
        self.blocks: list[dict] = []

    def add(self, stretches: list[tuple[str, list]]) -> None:
        for text, calls in stretches:
            if text:
                if self.blocks and self.blocks[-1]["type"] == "text":
                    self.blocks[-1]["text"] += text
                else:
                    self.blocks.append({"type": "text", "text": text})
            for c in calls:
                if isinstance(c, ToolCall):
                    self.blocks.append({"type": "tool_call", "id": c.id, "name": c.name, "args": c.arguments})
                else:
                    self.blocks.append({"type": "invalid_tool_call", "id": c.id, "name": c.name,
                                        "args": c.arguments, "error": c.error})

    @classmethod
    def of(cls, out) -> list[dict]:
        """A whole answer's blocks."""
        written = cls()
        written.add(_stretches(out.content, _in_written_order(out), 0))
        return written.blocks


class ChunkBuilder:
    """StreamDeltas -> AIMessageChunks; a tool call chunk's index is the call's place in the
    answer (the engine's, valid and invalid calls in the order written). A delta that holds
    text after a call is cut there, one chunk per stretch of text and the calls after it, so
    the chunks' v1 blocks (which core numbers in order) keep the order written, however the
    tokens were grouped into deltas (MTP on or off). ``written``, where given (v1), gathers
    the blocks as ``WrittenBlocks.of`` gives them for the whole answer."""

    def __init__(self, model_name: str, usage: bool = True, written: Optional[WrittenBlocks] = None):
        self._model_name = model_name
        self._usage = usage  # usage_metadata on the last chunk (ChatMLX.stream_usage)
        self._content_chars = 0  # content of the deltas so far
        self.written = written

    def chunks(self, delta) -> list[AIMessageChunk]:
        stretches = _stretches(delta.content or "", _in_written_order(delta), self._content_chars)
        self._content_chars += len(delta.content or "")
        if self.written is not None:
            self.written.add(stretches)
        out = []
        for k, (text, calls) in enumerate(stretches):
            first, last = k == 0, k == len(stretches) - 1
            chunk = self._chunk(delta, text, calls, reasoning=delta.reasoning if first else "",
                                logprobs=delta.logprobs if first else None, last=last and delta.finish_reason is not None)
            if chunk is not None:
                out.append(chunk)
        return out

    def _chunk(self, delta, content: str, calls: list, *, reasoning: str, logprobs, last: bool) -> Optional[AIMessageChunk]:
        written = [(c.index, c, c.arguments_json, True) if isinstance(c, ToolCall) else (c.index, c, c.arguments, False)
                   for c in calls]
        # An invalid call whose arguments LangChain would read as an object (one cut off by
        # max_tokens, or closed but malformed: a brace missing, ``<function=f>`` with no
        # parameter) carries no name here: LangChain merges a streamed call by parsing its
        # arguments, and a named one would merge into a valid call of that tool, which an
        # agent (a ToolNode under LangGraph's streaming) would run. Unnamed it is an error
        # message to the agent instead; invoke keeps the name in invalid_tool_calls.
        chunks = [tool_call_chunk(name=c.name if valid or not _merges_valid(args) else None, args=args, id=c.id,
                                  index=i) for i, c, args, valid in written]
        # A delta whose text the parser still holds back has tokens all the same: with
        # logprobs it is a chunk too (empty content), or its tokens' logprobs were lost.
        if not (content or reasoning or chunks or last or logprobs):
            return None
        # The provider on every chunk, so langchain-core finds its block translator.
        kwargs: dict[str, Any] = {"response_metadata": {"model_provider": PROVIDER}}
        if last:
            kwargs.update(
                usage_metadata=usage_metadata(delta.usage) if delta.usage and self._usage else None,
                response_metadata=response_metadata(self._model_name, delta.finish_reason),
                chunk_position="last",
            )
        if logprobs:
            kwargs["response_metadata"].update(logprobs_metadata(logprobs))
        return AIMessageChunk(
            content=content,
            additional_kwargs={"reasoning_content": reasoning} if reasoning else {},
            tool_call_chunks=chunks,
            **kwargs,
        )


register_block_translator()
