"""The schemas ChatMLX sends: tools as OpenAI specs, and structured output's response
format or forced tool, from every form ChatOpenAI takes.

langchain-core (1.8) inlines every ``$ref`` of a model's schema
(``convert_to_json_schema`` / ``convert_to_openai_tool``), and a recursive reference, which
cannot be inlined, becomes ``{}``: the grammar would then let anything through where the
model nests (``kids: list["Tree"]``) and the answer fail its own model. For such models the
schema is kept as Pydantic writes it (``$defs`` and ``$ref``), which the engine's grammar
compiles as is. So is a model with a ``Decimal``, written by the engine's
``pydantic_schema.json_schema`` (its string branch held to a decimal's pattern, where
Pydantic's takes any text). Every other schema is converted as ChatOpenAI converts it.
"""

from __future__ import annotations

from typing import Any, Optional

from langchain_core.tools import BaseTool, create_schema_from_function
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from mlx_tandem.pydantic_schema import json_schema

_DEFS = "#/$defs/"


def arguments_model(tool: Any) -> Any:
    """The Pydantic model of a tool's arguments where it has one: a BaseTool's
    ``tool_call_schema`` (injected arguments left out), a plain function's model as
    ``convert_to_openai_tool`` builds it (docstring argument descriptions included), else
    the tool itself. A plain function's recursive or tighter schema was lost: core's
    conversion is all that reached the engine."""
    if isinstance(tool, BaseTool):
        return tool.tool_call_schema
    if callable(tool) and not isinstance(tool, type) and hasattr(tool, "__name__"):
        return create_schema_from_function(tool.__name__, tool, filter_args=(), parse_docstring=True,
                                           error_on_invalid_docstring=False, include_injected=False)
    return tool


def whole_model_schema(schema: Any) -> Optional[dict]:
    """The engine's schema of ``schema`` (``pydantic_schema.json_schema``) when it is a
    Pydantic model whose definitions refer to themselves (directly or through others), or
    one the engine writes tighter than Pydantic; None otherwise."""
    if not (isinstance(schema, type) and is_basemodel_subclass(schema) and hasattr(schema, "model_json_schema")):
        return None  # not a Pydantic v2 model (v1 models are converted by core as before)
    full = json_schema(schema)
    defs = full.get("$defs") or {}
    graph = {name: _refs(body) for name, body in defs.items()}
    return full if _has_cycle(graph) or full != schema.model_json_schema() else None


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        found = {ref[len(_DEFS):]} if isinstance(ref, str) and ref.startswith(_DEFS) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def _has_cycle(graph: dict[str, set[str]]) -> bool:
    done: set[str] = set()

    def visit(name: str, path: set[str]) -> bool:
        if name in path:
            return True
        if name in done or name not in graph:
            return False
        path.add(name)
        found = any(visit(n, path) for n in graph[name])
        path.discard(name)
        done.add(name)
        return found

    return any(visit(name, set()) for name in graph)


def response_format_for(schema: Any, strict: Optional[bool]) -> dict:
    """A ``json_schema`` response format for ``schema``, in the forms ChatOpenAI takes: the
    OpenAI response-format dict (whole, or its ``{"name", "schema"}`` part), a Pydantic model,
    a TypedDict, an OpenAI or Anthropic tool dict, or a JSON schema (one without a title
    too: a name is OpenAI's API's need, not this engine's)."""
    if isinstance(schema, dict) and schema.get("type") == "json_schema" and isinstance(schema.get("json_schema"), dict):
        return schema
    if isinstance(schema, dict) and "name" in schema and isinstance(schema.get("schema"), dict):
        return {"type": "json_schema", "json_schema": schema}
    if isinstance(schema, dict) and "title" not in schema and not is_tool_dict(schema) and (
            "type" in schema or "properties" in schema):
        json_schema = schema
    else:
        json_schema = convert_to_json_schema(schema)
        full = whole_model_schema(schema)
        if full is not None:
            json_schema = {**full, "title": json_schema.get("title"),
                           "description": json_schema.get("description", "")}
    return {"type": "json_schema", "json_schema": {
        "name": json_schema.get("title", "response"), "schema": json_schema, "strict": strict}}


def structured_tool(schema: Any, strict: Optional[bool]) -> dict:
    """The tool ``method="function_calling"`` forces: built from ``schema`` as
    ``response_format_for`` reads it where it is a response-format dict (whole, or its
    ``{"name", "schema"}`` part) or an untitled JSON schema, which langchain-core's
    ``convert_to_openai_tool`` turned into a tool without parameters (its call then held to
    ``{}``) or refused; otherwise as ``bind_tools`` builds it."""
    if isinstance(schema, dict) and not is_tool_dict(schema) and (
            schema.get("type") == "json_schema" or ("name" in schema and isinstance(schema.get("schema"), dict))
            or ("title" not in schema and ("type" in schema or "properties" in schema))):
        rf = response_format_for(schema, strict)["json_schema"]
        params = rf.get("schema") or {}
        if not isinstance(params, dict):
            raise ValueError("the response format's schema must be a JSON schema object")
        function = {"name": rf.get("name") or "response", "description": rf.get("description") or params.get(
            "description", ""), "parameters": params}
        if strict is not None:
            function["strict"] = strict
        return {"type": "function", "function": function}
    return openai_tool(schema, strict)


def is_tool_dict(schema: dict) -> bool:
    """An OpenAI tool or function dict, or an Anthropic tool (``input_schema``): not a JSON
    schema itself, though OpenAI's carries a ``type``."""
    return (schema.get("type") == "function" or "function" in schema or "parameters" in schema
            or "input_schema" in schema)


def openai_tool(tool: Any, strict: Optional[bool]) -> dict:
    formatted = convert_to_openai_tool(tool, strict=strict)
    # A tool's arguments are a Pydantic model too (a BaseTool's or a plain function's); a
    # recursive one lost its nested levels the same way, and a Decimal's string branch took
    # any text.
    full = whole_model_schema(arguments_model(tool))
    if full is not None:
        formatted["function"]["parameters"] = full
    return formatted
