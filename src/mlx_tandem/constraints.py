"""Grammar-constrained decoding: JSON schemas, forced tool calls, Lark and regex grammars.

Built on llguidance (Microsoft's grammar engine, also used by vLLM, SGLang and llama.cpp):
it computes a token mask from an Earley parser over the tokenizer's trie in ~50-100 us per
token, supports JSON Schema and Lark with embedded JSON, treats special tokens exactly,
and its Python API (LLMatcher) exposes consume/rollback/deep_copy, which the budget-aware
closing (closing.py) needs. Outlines-core and xgrammar were the alternatives; llguidance is
already a dependency of mlx-vlm and the only one with a Lark front end that embeds JSON.

Split across threads the way the engine is split: ``GrammarCompiler`` compiles on the
caller's thread (so a bad schema fails the call at once, with a typed error), and
``closing.GrammarProcessor`` runs on the owner thread as a per-row mlx-lm logits processor.

A constraint must also *finish* within the request's token budget, even on a model that
never wants to close a string (a random-weight model, or a real one in a loop). Near the
end of the budget the processor simulates a shortest-path completion on a copy of the
matcher; when the remaining budget only just covers it, the request is steered onto that
completion. So structured output is always valid JSON unless the budget is smaller than
the smallest valid answer (then finish_reason is "length").
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .chat_format import ChatFormat
from .token_classes import TokenClasses, token_classes
from .errors import ConstraintError
from .pattern_witness import schema_patterns, shortest_match, witnesses
from .schema_prep import prepared_schema, refuse_dangling_escape
from .xml_calls import lark_regex, xml_body_rules, xml_expressible

logger = logging.getLogger(__name__)

# Compact JSON with the separators chat templates print: in-distribution for real models,
# and no free whitespace a looping model could fill its budget with.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the output must match. Build with the class methods."""

    kind: str  # "json_schema" | "lark" | "regex"
    source: str  # the schema (JSON text), grammar or pattern
    description: str = ""
    # Texts, as the output spells them, that get a string past its pattern: closing mode
    # writes one out where no single token shows progress (pattern_witness.py).
    hints: tuple[str, ...] = field(default=(), compare=False)
    # The grammar's structure is ordinary text (an XML call's ``</parameter>``,
    # ``</function>``; xml_calls.py), not JSON punctuation, so no closer token shows closing
    # mode the way out: it writes out the hints (markup every completion writes) first
    # wherever the grammar takes them (closing.py).
    text_markup: bool = field(default=False, compare=False)

    @classmethod
    def json_schema(cls, schema: dict | str, *, name: str = "") -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
            except RecursionError:
                raise ConstraintError("the JSON schema is nested too deeply") from None
        if not isinstance(schema, dict):
            raise ConstraintError("a JSON schema must be an object")
        text = _schema_text(lambda: prepared_schema(schema))
        return cls("json_schema", text, name or "json_schema", _string_hints(text))

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json_schema", json.dumps({"type": "object"}), "json_object")

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        return cls("lark", grammar, "lark")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        if isinstance(pattern, str):
            refuse_dangling_escape(pattern)
        witness = shortest_match(pattern) if isinstance(pattern, str) else None
        return cls("regex", pattern, "regex", (witness,) if witness else ())


# Closing mode tries each hint on every free-text step it takes: keep them few.
_MAX_HINTS = 8


def _string_hints(schema_text: str) -> tuple[str, ...]:
    """Witnesses of a schema's string patterns, escaped as they appear inside a JSON string."""
    found = witnesses(schema_patterns(json.loads(schema_text)))[:_MAX_HINTS]
    return tuple(json.dumps(w, ensure_ascii=False)[1:-1] for w in found)


def _schema_text(build: Callable[[], Any]) -> str:
    """``build()``'s schema as JSON text; a schema too deep to walk, or holding what JSON
    cannot (NaN, objects, a cycle), is a ConstraintError."""
    try:
        return json.dumps(build(), allow_nan=False)
    except ConstraintError:
        raise
    except RecursionError:
        raise ConstraintError("the JSON schema is nested too deeply") from None
    except (TypeError, ValueError) as exc:
        raise ConstraintError(f"the JSON schema is not JSON data: {exc}") from None


def response_format_constraint(response_format: Optional[dict]) -> Optional[Constraint]:
    """OpenAI-style ``response_format`` -> Constraint (None for plain text)."""
    if response_format is None:
        return None
    if isinstance(response_format, Constraint):
        return response_format
    if not isinstance(response_format, dict):
        raise ConstraintError("response_format must be a dict such as {'type': 'json_object'}")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema", response_format)
        if not isinstance(spec, dict):
            raise ConstraintError("response_format json_schema must be a dict with a 'schema'")
        schema = spec.get("schema")
        if schema is None:
            raise ConstraintError("response_format json_schema needs a 'schema'")
        return Constraint.json_schema(schema, name=spec.get("name", ""))
    if kind in ("lark", "grammar", "regex"):
        key = "pattern" if kind == "regex" else "grammar"
        text = response_format.get(key)
        if not isinstance(text, str):
            raise ConstraintError(f"response_format {kind} needs a {key!r} string")
        return Constraint.regex(text) if kind == "regex" else Constraint.lark(text)
    raise ConstraintError(f"unknown response_format type {kind!r}")


def tool_names(tools: Sequence[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def tool_call_constraint(fmt: ChatFormat, tools: Sequence[dict], names: Sequence[str], *,
                         parallel: bool, marker: Callable[[str], str]) -> Constraint:
    """Force one call (or several, if ``parallel``) of the named tools.

    The body is the format's own where this module can write it (``native_body``):
    ``{"name": ..., "arguments": {...}}`` for Hermes/Qwen2.5/Qwen3 (``json_tools``), the
    XML ``<function=...>`` body for Qwen3.5 and Qwen3-Coder (``qwen3_coder``, xml_calls.py).
    For other syntaxes with markers the JSON body is forced and the output parser reads
    forced bodies as JSON (see docs/design.md).
    """
    if not fmt.tool_call_start:
        raise ConstraintError(
            "this model's chat template has no tool-call markers, so a tool call cannot be forced")
    body, hints, xml = _body_rules(fmt, tools, names)
    grammar = f"start: calls\n{_calls_rules(fmt, parallel, marker)}\n{body}\n"
    return Constraint("lark", grammar, f"tool_call({', '.join(names)})", hints, text_markup=xml)


def native_body(fmt: ChatFormat, tools: Sequence[dict], names: Sequence[str]) -> bool:
    """Is a call of ``names`` written in the format's own body (else a JSON body that the
    output parser reads as JSON)? JSON for ``json_tools``; XML for ``qwen3_coder`` where
    the tools' schemas can be written in it (xml_calls.py)."""
    if fmt.tool_format == "json_tools":
        return True
    return fmt.tool_format == "qwen3_coder" and bool(fmt.tool_call_end) and xml_expressible(tools, names)


def _body_rules(fmt: ChatFormat, tools: Sequence[dict],
                names: Sequence[str]) -> tuple[str, tuple[str, ...], bool]:
    """The Lark rule ``body`` (one call of any of ``names``), its closing-mode hints, and
    whether it is XML."""
    if fmt.tool_format == "qwen3_coder" and native_body(fmt, tools, names):
        try:
            return (*xml_body_rules(tools, names, json_style=JSON_STYLE, prepare=prepared_schema,
                                    end_marker=fmt.tool_call_end), True)
        except RecursionError:
            raise ConstraintError("the JSON schema is nested too deeply") from None
    body = _schema_text(lambda: _call_body_schema(tools, names))
    return f"body: %json {body}", _string_hints(body), False


def _calls_rules(fmt: ChatFormat, parallel: bool, marker: Callable[[str], str]) -> str:
    """The Lark rule ``calls``: one call (or several) of JSON ``body`` rules in the format's
    markup. A format without an end marker (Mistral's, ``[TOOL_CALLS]``) writes its calls as
    one JSON list after the start marker, which mlx-lm's parser for it reads; the answer ends
    with them."""
    if not fmt.tool_call_end:
        more = '(", " body)*' if parallel else ""
        return f'calls: {marker(fmt.tool_call_start)} "[" body {more} "]"'
    call = f'{marker(fmt.tool_call_start)} "\\n" body "\\n" {marker(fmt.tool_call_end)}'
    return f'calls: call ("\\n" call)*\ncall: {call}' if parallel else f"calls: call\ncall: {call}"


def call_or_answer_constraint(fmt: ChatFormat, tools: Sequence[dict], answer: Constraint, *,
                              parallel: bool, marker: Callable[[str], str]) -> Constraint:
    """Calls of the listed tools, or an answer that matches a JSON ``response_format``.

    OpenAI's API lets a model call its tools under ``tool_choice="auto"`` and holds only its
    text answer to the ``response_format``; agents bind both (LangChain's ``create_agent``
    with a ``response_format``, through ``bind_tools(..., response_format=...)``). Calls are
    written as forced calls are (``tool_call_constraint``).
    """
    names = tool_names(tools)
    body, hints, xml = _body_rules(fmt, tools, names)
    grammar = (f"start: calls | answer\n{_calls_rules(fmt, parallel, marker)}\n{body}\n"
               f"answer: {_as_rule(answer)}\n")
    return Constraint("lark", grammar, f"tool_call({', '.join(names)}) or {answer.description}",
                      answer.hints + hints, text_markup=xml or answer.text_markup)


def after_reasoning(constraint: Constraint, think_ids: tuple[int, int], *, opened: bool) -> Constraint:
    """Reasoning first, then ``constraint`` (a request that asks for ``reasoning=True`` with a
    response_format or a forced call).

    The reasoning is free text up to the end marker; ``opened``: the prompt already opened it
    (Qwen3.5's template), else the model may open it or skip it. The markers are matched by
    token id, so reasoning text cannot end it by spelling one. vLLM applies structured output
    after its reasoning parser's end marker the same way. One grammar for both parts keeps
    closing mode exact: near the end of the budget the shortest way out is the end marker
    and the shortest answer, so the answer still closes within ``max_tokens``.
    """
    start, end = think_ids
    # The blank line Qwen's template writes after </think>, which the output parser drops;
    # only after a reasoning, so an answer without one is exactly the constraint's.
    thought = f"THOUGHT <[{end}]> /\\n{{0,2}}/"
    head = thought if opened else f"(<[{start}]> {thought})?"
    grammar = f"start: {head} answer\nTHOUGHT: /(.|\\n)*/\nanswer: {_as_rule(constraint)}\n"
    return Constraint("lark", grammar, f"reasoning, then {constraint.description}", constraint.hints,
                      text_markup=constraint.text_markup)


def _as_rule(c: Constraint) -> str:
    """``c`` as the body of a Lark rule (a nested grammar)."""
    if c.kind == "json_schema":
        schema = json.loads(c.source)
        if isinstance(schema, dict):  # what the top-level compile passes as overrides
            schema = {**schema, "x-guidance": JSON_STYLE}
        return f"%json {json.dumps(schema)}"
    if c.kind == "lark":
        return f"%lark {{\n{c.source}\n}}"
    if c.kind == "regex":
        return lark_regex(c.source)
    raise ConstraintError(f"unknown constraint kind {c.kind!r}")


def open_call_constraint(fmt: ChatFormat, tools: Sequence[dict], *, marker: Callable[[str], str]) -> Constraint:
    """The rest of one call of any listed tool, once its start marker has been emitted.

    What a lazy grammar (tool_call_grammar.py) applies after the model opens a call itself.
    """
    names = tool_names(tools)
    body, hints, xml = _body_rules(fmt, tools, names)
    grammar = f'start: "\\n" body "\\n" {marker(fmt.tool_call_end)}\n{body}\n'
    return Constraint("lark", grammar, f"open_tool_call({', '.join(names)})", hints, text_markup=xml)


def _call_body_schema(tools: Sequence[dict], names: Sequence[str]) -> dict:
    """``{"name": <one of names>, "arguments": <that tool's parameters>}`` as one JSON schema."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    variants = []
    defs: dict[str, Any] = {}
    for i, name in enumerate(names):
        params = prepared_schema(by_name[name].get("parameters") or {"type": "object", "properties": {}})
        if _has_local_ref(params):
            # Local refs ("#/$defs/Model", as pydantic writes them) resolve against the
            # document root; nested under "arguments" they failed to compile. Keep the
            # parameter schema whole under the root's $defs and point its refs there.
            key = f"tool{i}_arguments"
            defs[key] = _rebase_refs(params, f"#/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        variants.append({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    body = variants[0] if len(variants) == 1 else {"anyOf": variants}
    body = {**body, "x-guidance": JSON_STYLE}
    if defs:
        body["$defs"] = defs
    return body


def _has_local_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_local_ref(v) for v in schema)
    return False


def _rebase_refs(schema: Any, base: str) -> Any:
    """Rewrite local ``$ref`` pointers ("#/...") for a schema moved to ``base`` ("#/...")."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebase_refs(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def _grammar_text(c: Constraint) -> str:
    import llguidance

    if c.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(c.source, overrides=JSON_STYLE)
    if c.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(c.source)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.source)
    raise ConstraintError(f"unknown constraint kind {c.kind!r}")


def _without_normalizer(hf) -> None:
    """Drop the text normalizer from llguidance's copy of the tokenizer. A grammar writes
    bytes, and llguidance tokenizes the text it forces: through Qwen's NFC normalizer a
    Lark literal "cafe\u0301" became the tokens of "caf\u00e9", which the grammar refused
    (ConstraintError on every such request; an audit). Tokens decode to their bytes either
    way, so without it the forced tokens write exactly the grammar's text."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None and backend.normalizer is not None:
        backend.normalizer = None


class GrammarCompiler:
    """Per-engine: the llguidance tokenizer (built once, lazily) and grammar compilation."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 lock: Optional[threading.Lock] = None):
        self._hf = hf_tokenizer
        self._lock = lock or threading.Lock()
        self._init_lock = threading.Lock()
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._llt = None
        self._tiers: Optional[TokenClasses] = None

    @property
    def tokenizer(self):
        if self._llt is None:
            with self._init_lock:
                if self._llt is None:
                    import llguidance.hf

                    with self._lock:  # HF tokenizers are not safe to share across threads
                        hf = copy.deepcopy(self._hf)
                    _without_normalizer(hf)
                    self._llt = llguidance.hf.from_tokenizer(
                        hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._llt

    def marker(self, text: str) -> str:
        """A Lark expression for a literal marker such as ``<tool_call>``.

        llguidance treats every added token as special; those only match by id.
        """
        token = self.marker_id(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    def marker_id(self, text: str) -> Optional[int]:
        """The id of the special (added) token that is ``text``, if it is one: grammars write
        such a marker by that id, never in ordinary tokens."""
        llt = self.tokenizer
        ids = llt.tokenize_str(text)
        return ids[0] if len(ids) == 1 and llt.is_special_token(ids[0]) else None

    def compile(self, constraint: Constraint):
        """A fresh LLMatcher for one request; ConstraintError if the grammar is invalid."""
        import llguidance

        try:
            grammar = _grammar_text(constraint)
        except ValueError as exc:
            raise ConstraintError(f"invalid {constraint.description}: {exc}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"invalid {constraint.description}: {matcher.get_error()}")
        # A grammar of no string (a regex of an empty character class) compiles, and fails
        # only at its first mask, which allowed just EOS: the answer was "" and "stop".
        matcher.compute_bitmask()
        if matcher.is_error():
            raise ConstraintError(f"invalid {constraint.description}: it matches no string")
        return matcher

    def hint_ids(self, constraint: Constraint) -> tuple[tuple[int, ...], ...]:
        """``constraint.hints`` as token ids, for closing mode, shortest first: a witness
        fits in any string its pattern's grammar takes, and a long one (another field's
        twenty digits) would crowd out a short one that closes in budget."""
        return tuple(sorted((tuple(self.tokenizer.tokenize_str(h)) for h in constraint.hints), key=len))

    def tiers(self) -> TokenClasses:
        """Per-token closing preference and classes (``TokenClasses``), computed once."""
        if self._tiers is None:
            self._tiers = token_classes(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._tiers



def keep_mask(banned: Sequence[int], vocab: int) -> np.ndarray:
    """(vocab,) bool, False at the banned ids (ids past the vocabulary are ignored)."""
    keep = np.ones(vocab, dtype=bool)
    keep[[t for t in banned if t < vocab]] = False
    return keep


class TokenBan:
    """mlx-lm logits processor that forbids some tokens (e.g. tool-call markers for tool_choice="none").

    Keeps a numpy mask, not an mx.array: processors live as long as the caller's stream
    object, and mx arrays must not outlive the owner thread.
    """

    def __init__(self, token_ids: Sequence[int]):
        self._ids = sorted(set(int(t) for t in token_ids))
        self._keep: Optional[np.ndarray] = None

    @property
    def token_ids(self) -> list[int]:
        """The banned ids. A ban does not depend on the tokens before it, so a speculative
        step applies it to every drafted and verified position (spec/batch.py)."""
        return list(self._ids)

    def __call__(self, tokens, logits):
        import mlx.core as mx

        if self._keep is None or self._keep.shape[-1] != logits.shape[-1]:
            self._keep = keep_mask(self._ids, logits.shape[-1])
        return mx.where(mx.array(self._keep), logits, mx.array(-float("inf"), dtype=logits.dtype))
