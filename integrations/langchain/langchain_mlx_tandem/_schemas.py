"""JSON schemas of Pydantic models for tools and structured output.

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
