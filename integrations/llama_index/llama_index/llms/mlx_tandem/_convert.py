"""LlamaIndex messages <-> mlx-tandem's neutral (OpenAI-style) message dicts and outputs.

Adapter code only: no engine logic. Media blocks become neutral media parts; the engine
decides whether the model can take them (a text-only model raises UnsupportedContentError).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from llama_index.core.base.llms.types import (
    AudioBlock,
    CachePoint,
    ChatMessage,
    CitableBlock,
    CitationBlock,
    ChatResponse,
    LogProb,
    CompletionResponse,
    DocumentBlock,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    VideoBlock,
)

from mlx_tandem.errors import InvalidRequestError, UnsupportedContentError
from mlx_tandem.messages import arguments_text

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "developer",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "tool",
}


def _data_uri(data: bytes, mime: Optional[str], kind: str) -> str:
    return f"data:{mime or kind + '/*'};base64,{data.decode('ascii')}"


def _media_part(block: Any) -> dict:
    if isinstance(block, ImageBlock):
        kind, raw, mime = "image", block.image, block.image_mimetype
    elif isinstance(block, AudioBlock):
        kind, raw, mime = "audio", block.audio, f"audio/{block.format}" if block.format else None
    else:
        kind, raw, mime = "video", block.video, getattr(block, "video_mimetype", None)
    if raw is None and block.path is None and block.url is not None:
        return {"type": kind, kind: str(block.url)}  # remote: the vision path fetches it
    if raw is None and block.path is None:
        raise InvalidRequestError(f"{kind} block without data, path or url")
    if isinstance(raw, io.IOBase):
        # A file-like payload (the blocks' type allows one) skips the validator's base64
        # encoding, and resolve hands it back as it is.
        if raw.seekable():
            raw.seek(0)
        return {"type": kind, kind: _data_uri(base64.b64encode(raw.read()), mime, kind)}
    # Bytes arrive base64-encoded by the block's validator; a path is read here.
    resolve = getattr(block, f"resolve_{kind}")
    return {"type": kind, kind: _data_uri(resolve(as_base64=True).read(), mime, kind)}


def _parts(blocks: Sequence[Any]) -> tuple[list[dict], list[dict], list[str]]:
    """Content parts, tool calls and reasoning texts of a message's blocks."""
    parts: list[dict] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, (ImageBlock, AudioBlock, VideoBlock)):
            parts.append(_media_part(block))
        elif isinstance(block, ToolCallBlock):
            calls.append({"id": block.tool_call_id or f"call_{len(calls)}", "type": "function",
                          "function": {"name": block.tool_name,
                                       "arguments": arguments_text(block.tool_kwargs, f"call {block.tool_name!r}")}})
        elif isinstance(block, ThinkingBlock):
            if block.content:
                reasoning.append(block.content)
        elif isinstance(block, CachePoint):
            continue  # a provider caching hint; the engine's prefix cache needs none
        elif isinstance(block, DocumentBlock):
            parts.append({"type": "text", "text": _document_text(block)})
        elif isinstance(block, (CitableBlock, CitationBlock)):
            # What a tool may return (core's FunctionTool, FunctionAgent passes it on): its
            # content is text, images or documents, read as those are.
            inner = block.content if isinstance(block, CitableBlock) else [block.cited_content]
            inner_parts, _, _ = _parts(inner)
            parts.extend(inner_parts)
        else:
            raise UnsupportedContentError(f"unsupported content block {type(block).__name__}")
    return parts, calls, reasoning


_TEXT_SUFFIXES = frozenset({".txt", ".md", ".markdown", ".rst", ".csv", ".tsv", ".json", ".log", ".yaml", ".yml",
                            ".xml"})
_TEXT_MIMES = frozenset({"application/json", "application/xml", "application/yaml", "application/x-yaml"})


def _is_text_mime(mime: str) -> bool:
    mime = mime.split(";")[0].strip().lower()
    return mime.startswith("text/") or mime in _TEXT_MIMES or mime.endswith(("+json", "+xml"))


def _document_text(block: DocumentBlock) -> str:
    """A plain-text document's text, read from its bytes or local path (as LangChain's
    ``text-plain`` blocks are read). PDFs and other binary formats need a parser first;
    remote documents are not fetched (a prompt must not make the engine fetch URLs)."""
    mime = block.document_mimetype or ""
    suffix = Path(str(block.path or block.title or "")).suffix.lower()
    if not (_is_text_mime(mime) or (mime in ("", "application/octet-stream") and suffix in _TEXT_SUFFIXES)):
        raise UnsupportedContentError(
            f"document blocks of type {mime or suffix or 'unknown'} are not supported; plain-text ones "
            "are (parse a PDF into text first, e.g. with a LlamaIndex reader)")
    if block.data is None and block.path is None:
        raise UnsupportedContentError("remote documents are not fetched; pass the text as data or a path")
    try:
        return block.resolve_document().read().decode("utf-8")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidRequestError(f"could not read document {block.title!r} as UTF-8 text: {exc}") from exc


def _legacy_tool_calls(raw: Any) -> list[dict]:
    """``additional_kwargs["tool_calls"]`` as older integrations store it (dicts or OpenAI objects)."""
    out = []
    for i, entry in enumerate(raw or []):
        c = entry if isinstance(entry, dict) else (
            entry.model_dump() if hasattr(entry, "model_dump") else getattr(entry, "__dict__", None))
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) and not hasattr(fn, "model_dump"):
            raise InvalidRequestError(f"additional_kwargs['tool_calls'][{i}] is not an OpenAI tool call: {entry!r}")
        fn = fn if isinstance(fn, dict) else fn.model_dump()
        out.append({"id": c.get("id") or f"call_{i}", "type": "function",
                    "function": {"name": fn.get("name"),
                                 "arguments": arguments_text(fn.get("arguments", "{}"), f"tool_calls[{i}]")}})
    return out


def _invalid_calls(raw: Any, answered: set) -> list[dict]:
    """The calls of ``additional_kwargs["invalid_tool_calls"]`` (this adapter's answers keep
    them there) that a later tool result answers: that result would otherwise follow no
    call (langchain-openai sends such calls back too). Their arguments only where they are
    a JSON object: Qwen3.5's template iterates them (``|items``) and fails on text; the
    result says what was wrong. One with no name (its text did not parse) goes back with an
    empty one: templates pair results with calls by position."""
    out = []
    for c in raw or []:
        if isinstance(c, dict) and c.get("id") in answered:
            args = c.get("arguments")
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                parsed = None
            out.append({"id": c["id"], "type": "function",
                        "function": {"name": c.get("name") or "", "arguments": json.dumps(parsed if isinstance(parsed, dict)
                                                                                else {}, ensure_ascii=False)}})
    return out


def in_written_order(calls: list, kw: dict, call_id) -> list:
    """``calls`` in the order the model wrote them, valid and invalid ones together: the
    answer's ``additional_kwargs`` number them. Unchanged where any call is not numbered.
    ``call_id`` reads a call's id."""
    written = {c.get("id"): c.get("index") for key in ("tool_calls", "invalid_tool_calls")
               for c in (kw.get(key) or []) if isinstance(c, dict) and isinstance(c.get("index"), int)}
    if not all(call_id(c) in written for c in calls):
        return calls
    return sorted(calls, key=lambda c: written[call_id(c)])


def _newline_between_texts(parts: list[dict]) -> list[dict]:
    out: list[dict] = []
    for p in parts:
        if out and p["type"] == "text" and out[-1]["type"] == "text":
            out.append({"type": "text", "text": "\n"})
        out.append(p)
    return out


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    answered = {m.additional_kwargs.get("tool_call_id") for m in messages
                if _ROLES.get(m.role) == "tool" and isinstance(m.additional_kwargs.get("tool_call_id"), str)}
    out: list[dict] = []
    for m in messages:
        role = _ROLES.get(m.role)
        if role is None:
            raise InvalidRequestError(f"unsupported message role {m.role!r}")
        parts, calls, reasoning = _parts(m.blocks)
        # TextBlocks join with "\n", as ChatMessage.content joins them (beside media too).
        if all(p["type"] == "text" for p in parts):
            content: Any = "\n".join(p["text"] for p in parts)
        else:
            content = _newline_between_texts(parts)
        d: dict[str, Any] = {"role": role, "content": content}
        kw = m.additional_kwargs
        if role == "assistant":
            calls = (calls or _legacy_tool_calls(kw.get("tool_calls"))) + _invalid_calls(kw.get("invalid_tool_calls"), answered)
            calls = in_written_order(calls, kw, lambda c: c["id"])  # the history as it was written
            if calls:
                d["tool_calls"] = calls
            if reasoning:
                d["reasoning_content"] = "\n".join(reasoning)
        elif role == "tool":
            tool_call_id = kw.get("tool_call_id")
            if tool_call_id:
                d["tool_call_id"] = tool_call_id
            if kw.get("name"):
                d["name"] = kw["name"]
            elif m.role == MessageRole.FUNCTION and not tool_call_id:
                raise InvalidRequestError("a function message needs additional_kwargs['name'] or ['tool_call_id']")
        if role in ("user", "system", "developer") and kw.get("name"):
            d["name"] = kw["name"]
        out.append(d)
    return out


# ---------------------------------------------------------------------- outputs
def token_counts(usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def to_logprobs(logprobs) -> Optional[list[list[LogProb]]]:
    """``ChatResponse.logprobs``/``CompletionResponse.logprobs``: per answer token, the token
    drawn first, then the most likely others at its place (``top_logprobs`` of them)."""
    if logprobs is None:
        return None
    return [[LogProb(token=lp.token, logprob=lp.logprob, bytes=list(lp.bytes)),
             *(LogProb(token=t.token, logprob=t.logprob, bytes=list(t.bytes))
               for t in lp.top_logprobs if t.token_id != lp.token_id)] for lp in logprobs]


def raw_response(model_name: str, request_id: str, finish_reason: Optional[str], usage, logprobs=None) -> dict:
    """``raw``: what LlamaIndex's token counting reads (``raw["usage"]``), plus the finish reason,
    and OpenAI's ``logprobs`` (``{"content": [...]}``) when the call asked for them."""
    raw: dict[str, Any] = {"model": model_name, "id": request_id}
    if logprobs is not None:
        raw["logprobs"] = {"content": [lp.to_openai() for lp in logprobs]}
    if finish_reason is not None:
        raw["finish_reason"] = finish_reason
    if usage is not None:
        raw["usage"] = token_counts(usage)
        if usage.cached_tokens:  # OpenAI's shape, which LlamaIndex users already read
            raw["usage"]["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
        if usage.reasoning_tokens:
            raw["usage"]["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return raw


def _blocks(content: str, reasoning: str, calls: Sequence[Any], usage=None) -> list:
    blocks: list = []
    if reasoning:
        # num_tokens once known (the whole answer, or a stream's last response).
        blocks.append(ThinkingBlock(content=reasoning, num_tokens=usage.reasoning_tokens if usage else None))
    blocks.append(TextBlock(text=content))
    blocks.extend(ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in calls)
    return blocks


def _call_kwargs(calls: Sequence[Any], invalid: Sequence[Any]) -> dict:
    """An answer's calls as ``additional_kwargs`` hold them (OpenAI's shape)."""
    kwargs: dict[str, Any] = {}
    if calls:
        # Kept beside the ToolCallBlocks for core helpers that still read additional_kwargs.
        kwargs["tool_calls"] = [{"id": c.id, "type": "function", "index": c.index,
                                 "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]
    if invalid:
        kwargs["invalid_tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments, "error": c.error,
                                         "index": c.index, **({"truncated": True} if c.truncated else {})}
                                        for c in invalid]
    return kwargs


def _message(content: str, reasoning: str, calls: Sequence[Any], invalid: Sequence[Any], usage=None) -> ChatMessage:
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=_blocks(content, reasoning, calls, usage),
                       additional_kwargs=_call_kwargs(calls, invalid))


def to_chat_response(out, model_name: str) -> ChatResponse:
    message = _message(out.content, out.reasoning, out.tool_calls, out.invalid_tool_calls, out.usage)
    return ChatResponse(message=message, raw=raw_response(model_name, out.request_id, out.finish_reason, out.usage,
                                                          out.logprobs),
                        additional_kwargs=token_counts(out.usage), logprobs=to_logprobs(out.logprobs))


def to_completion_response(out, model_name: str) -> CompletionResponse:
    # A completion carries its calls as core's chat_response_to_completion_response does.
    extra = {**_call_kwargs(out.tool_calls, out.invalid_tool_calls), **token_counts(out.usage)}
    if out.reasoning:
        extra["thinking"] = out.reasoning
    return CompletionResponse(text=out.content, raw=raw_response(model_name, out.request_id, out.finish_reason,
                                                                 out.usage, out.logprobs),
                              additional_kwargs=extra, logprobs=to_logprobs(out.logprobs))


class StreamAccumulator:
    """StreamDeltas -> LlamaIndex stream responses: ``message.content``/``text`` is the text so
    far, ``delta`` the new piece, ``additional_kwargs["thinking_delta"]`` the new reasoning
    (and, for completions, ``additional_kwargs["thinking"]`` the reasoning so far);
    ``logprobs``, when asked for, those of the piece's tokens (as ``delta``, not the sum)."""

    def __init__(self, model_name: str, request_id: str, logprobs: bool = False):
        self._model_name = model_name
        self._request_id = request_id
        self._logprobs = logprobs
        self.content = ""
        self.reasoning = ""
        self.calls: list = []
        self.invalid: list = []

    def _update(self, delta) -> Optional[dict]:
        self.content += delta.content or ""
        self.reasoning += delta.reasoning or ""
        self.calls.extend(delta.tool_calls)
        self.invalid.extend(delta.invalid_tool_calls)
        last = delta.finish_reason is not None
        if not (delta.content or delta.reasoning or delta.tool_calls or delta.invalid_tool_calls or last
                or delta.logprobs):  # held-back text's tokens still carry their logprobs
            return None
        extra: dict[str, Any] = {}
        if delta.reasoning:
            extra["thinking_delta"] = delta.reasoning
        if last and delta.usage is not None:
            extra.update(token_counts(delta.usage))
        return extra

    def chat(self, delta) -> Optional[ChatResponse]:
        extra = self._update(delta)
        if extra is None:
            return None
        return ChatResponse(
            message=_message(self.content, self.reasoning, self.calls, self.invalid, delta.usage),
            delta=delta.content or "",
            raw=self._raw(delta),
            additional_kwargs=extra,
            logprobs=self._piece_logprobs(delta),
        )

    def _raw(self, delta) -> dict:
        return raw_response(self._model_name, self._request_id, delta.finish_reason, delta.usage,
                            delta.logprobs if self._logprobs else None)

    def _piece_logprobs(self, delta) -> Optional[list[list[LogProb]]]:
        return to_logprobs(delta.logprobs) if self._logprobs else None

    def completion(self, delta) -> Optional[CompletionResponse]:
        extra = self._update(delta)
        if extra is None:
            return None
        if self.reasoning:  # cumulative, as ``text`` is, and as complete() reports it
            extra["thinking"] = self.reasoning
        extra.update(_call_kwargs(self.calls, self.invalid))  # the calls so far, as the chat stream's message
        return CompletionResponse(
            text=self.content, delta=delta.content or "",
            raw=self._raw(delta),
            additional_kwargs=extra,
            logprobs=self._piece_logprobs(delta),
        )
