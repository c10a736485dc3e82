"""LlamaIndex tools as the engine takes them (OpenAI-style specs), and their calls as
LlamaIndex reads them back."""

from __future__ import annotations

from typing import Any, Union

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, ToolCallBlock
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.tools.types import ToolMetadata

from mlx_tandem.errors import InvalidRequestError
from mlx_tandem.pydantic_schema import json_schema, narrowed_schema


def openai_tool(tool: Any) -> dict:
    """``to_openai_tool()``, with a Pydantic argument model the engine writes tighter than
    Pydantic (a ``Decimal``'s string branch held to a decimal's pattern, where Pydantic's
    takes any text) in the engine's words, keeping the keys core keeps. Anything but a
    LlamaIndex tool is an InvalidRequestError (an OpenAI-style dict, a name: core's own
    LLMs fail on it with an AttributeError). The name is the tool's own: core writes it in
    OpenAI's alphabet (``math.add`` as ``math_add``), but finds the tool to run by its own
    name (``call_tool_with_selection``, the agents), so a call to the name the model was
    shown raised KeyError in ``predict_and_call`` (llama-index-core 0.14.25). The engine
    takes any name a chat template can write."""
    if not isinstance(getattr(tool, "metadata", None), ToolMetadata):
        raise InvalidRequestError(f"tools: expected LlamaIndex tools (a BaseTool, e.g. FunctionTool), "
                                  f"got {type(tool).__name__}")
    spec = tool.metadata.to_openai_tool(skip_length_check=True)
    spec["function"]["name"] = tool.metadata.name
    model = tool.metadata.fn_schema
    ours = narrowed_schema(model)
    if ours is None and "$ref" in pydantic_schema(model):
        # A recursive model is a "$ref" to its own "$defs" entry; core keeps the "$defs" and
        # drops the "$ref" (llama-index-core 0.14), which left {"$defs": ...}: a schema of
        # any JSON, and a forced call's arguments came back 0.0 or true.
        ours = json_schema(model)
    if ours is not None:
        spec["function"]["parameters"] = {k: v for k, v in ours.items()
                                          if k in ("type", "properties", "required", "definitions", "$defs", "$ref")}
    return spec


def pydantic_schema(model: Any) -> dict:
    """A Pydantic 2 model's own JSON schema; {} for anything else, or one it cannot write."""
    if not (isinstance(model, type) and hasattr(model, "model_json_schema")):
        return {}
    try:
        return model.model_json_schema()
    except Exception:  # noqa: BLE001 - core's own conversion reports it
        return {}


def kwargs_dict(args: Union[dict, str]) -> dict:
    """A call's arguments; a string (a block from another integration) is parsed as the
    OpenAI LLM does, leniently (a truncated object keeps its complete fields), else ``{}``."""
    if isinstance(args, dict):
        return args
    try:
        parsed = parse_partial_json(args)
    except (TypeError, ValueError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def first_call_only(response: ChatResponse) -> ChatResponse:
    """A streamed response under ``parallel_tool_calls=False`` (``allow_parallel_tool_calls``
    off): the engine ends the answer at its first valid call, but an invalid call before it
    is streamed too; trimmed here as ``chat_with_tools`` trims, so an agent reading the last
    response runs the same one call either way."""
    keep_first_tool_call(response.message)
    return response


def keep_first_tool_call(message: ChatMessage) -> None:
    seen = False
    blocks = []
    for b in message.blocks:
        if isinstance(b, ToolCallBlock):
            if seen:
                continue
            seen = True
        blocks.append(b)
    message.blocks = blocks
    if message.additional_kwargs.get("tool_calls"):
        message.additional_kwargs["tool_calls"] = message.additional_kwargs["tool_calls"][:1]
    invalid = message.additional_kwargs.get("invalid_tool_calls")
    if invalid:  # one call in all: the first valid one, else the first invalid one
        message.additional_kwargs["invalid_tool_calls"] = [] if seen else invalid[:1]
