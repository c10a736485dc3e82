"""Grammar-constrained decoding: JSON schemas, forced tool calls, Lark and regex grammars.

Built on llguidance (Microsoft's grammar engine, also used by vLLM, SGLang and llama.cpp):
it computes a token mask from an Earley parser over the tokenizer's trie in ~50-100 us per
token, supports JSON Schema and Lark with embedded JSON, treats special tokens exactly,
and its Python API (LLMatcher) exposes consume/rollback/deep_copy, which the budget-aware
"closing" below needs. Outlines-core and xgrammar were the alternatives; llguidance is
already a dependency of mlx-vlm and the only one with a Lark front end that embeds JSON.

Split across threads the way the engine is split: ``GrammarCompiler`` compiles on the
caller's thread (so a bad schema fails the call at once, with a typed error), and
``GrammarProcessor`` runs on the owner thread as a per-row mlx-lm logits processor.

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
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from .chat_format import ChatFormat
from .errors import ConstraintError

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

    @classmethod
    def json_schema(cls, schema: dict | str, *, name: str = "") -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ConstraintError("a JSON schema must be an object")
        return cls("json_schema", _schema_text(lambda: _prepared_schema(schema)), name or "json_schema")

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json_schema", json.dumps({"type": "object"}), "json_object")

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        return cls("lark", grammar, "lark")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern, "regex")


def _schema_text(build: Callable[[], Any]) -> str:
    """``build()``'s schema as JSON text; a schema too deep to walk, or holding what JSON
    cannot (NaN, objects, a cycle), is a ConstraintError."""
    try:
        return json.dumps(build(), allow_nan=False)
    except RecursionError:
        raise ConstraintError("the JSON schema is nested too deeply") from None
    except (TypeError, ValueError) as exc:
        raise ConstraintError(f"the JSON schema is not JSON data: {exc}") from None


# Where a JSON Schema holds subschemas (draft 2020-12 and draft 7). Everything else, const,
# enum, default and examples above all, is data: a value that has a "properties" key is not
# an object schema.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
              "contains", "propertyNames", "not", "if", "then", "else")


# llguidance's date formats allow year 0000, a leap second :60 and February 29 in any year;
# Python's datetime (so Pydantic, and jsonschema's format checker) refuses all three. These
# patterns are intersected with the format by llguidance; a string with its own pattern
# keeps it.
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_FORMAT_PATTERNS = {
    "date": rf"^{_DATE}$",
    "date-time": rf"^{_DATE}[Tt ][0-9]{{2}}:[0-9]{{2}}:[0-5][0-9].*$",
    "time": r"^[0-9]{2}:[0-9]{2}:[0-5][0-9].*$",
}


def _prepared_schema(schema: Any) -> Any:
    """The caller's schema as the grammar gets it; every output still validates against it.

    - ``additionalProperties`` defaults to false on objects that list their properties: it
      only forbids keys the schema did not name, and a tool never receives arguments it does
      not declare. Left open where closing would refuse what the schema allows, because
      other subschemas name keys too: an ``allOf`` branch (inline or a ``$defs`` entry it
      refers to), an ``anyOf``/``oneOf`` branch beside its parent's own properties, an object
      combined with such subschemas or a ``$ref``, and an object that requires a key it does
      not list.
    - ``date``, ``date-time`` and ``time`` strings also exclude year 0000 and second 60.
    """
    return _prepare(schema, open_defs=_defs_combined(schema), keep_open=False)


def _defs_combined(schema: Any) -> set[str]:
    """Names of the ``$defs``/``definitions`` entries that an ``allOf`` (or an ``anyOf``/
    ``oneOf`` beside properties) refers to: they share their object with other subschemas."""
    names: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key in ("allOf", "anyOf", "oneOf"):
                branches = node.get(key)
                if isinstance(branches, list) and (key == "allOf" or "properties" in node):
                    for b in branches:
                        ref = b.get("$ref") if isinstance(b, dict) else None
                        if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                            names.add(ref.rsplit("/", 1)[1])
            stack.extend(node.values())
    return names


def _prepare(schema: Any, *, open_defs: set[str], keep_open: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)

    def sub(value: Any, keep: bool = False) -> Any:
        return _prepare(value, open_defs=open_defs, keep_open=keep)

    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            is_defs = key in ("$defs", "definitions")
            out[key] = {name: sub(v, keep=is_defs and name in open_defs) for name, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            shared = key == "allOf" or (key in ("anyOf", "oneOf") and "properties" in out)
            out[key] = [sub(v, keep=shared) for v in out[key]]
    for key in _SUBSCHEMA:
        value = out.get(key)
        if isinstance(value, list):  # draft 7 tuple "items"
            out[key] = [sub(v) for v in value]
        elif isinstance(value, dict):
            out[key] = sub(value)
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in _FORMAT_PATTERNS and "pattern" not in out:
        out["pattern"] = _FORMAT_PATTERNS[fmt]
    properties = out.get("properties")
    required = out.get("required", [])
    if (isinstance(properties, dict) and not keep_open and out.get("type", "object") == "object"
            and "additionalProperties" not in out and "unevaluatedProperties" not in out
            and not any(k in out for k in ("allOf", "anyOf", "oneOf", "$ref", "if"))
            and isinstance(required, list) and all(k in properties for k in required)):
        out["additionalProperties"] = False
    return out


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

    The body is ``{"name": ..., "arguments": {...}}`` between the format's tool-call
    markers: the native syntax of Hermes/Qwen2.5/Qwen3 (``json_tools``). For other
    syntaxes with markers (e.g. Qwen3.5's XML-like ``qwen3_coder``) the same JSON body is
    forced and the output parser reads forced bodies as JSON (see docs/design.md).
    """
    if not (fmt.tool_call_start and fmt.tool_call_end):
        raise ConstraintError(
            "this model's chat template has no tool-call markers, so a tool call cannot be forced")
    call = f'{marker(fmt.tool_call_start)} "\\n" body "\\n" {marker(fmt.tool_call_end)}'
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    grammar = f"{start}\ncall: {call}\nbody: %json {_schema_text(lambda: _call_body_schema(tools, names))}\n"
    return Constraint("lark", grammar, f"tool_call({', '.join(names)})")


def open_call_constraint(fmt: ChatFormat, tools: Sequence[dict], *, marker: Callable[[str], str]) -> Constraint:
    """The rest of one call of any listed tool, once its start marker has been emitted.

    What a lazy grammar (tool_call_grammar.py) applies after the model opens a call itself.
    """
    names = tool_names(tools)
    grammar = (f'start: "\\n" body "\\n" {marker(fmt.tool_call_end)}\n'
               f"body: %json {_schema_text(lambda: _call_body_schema(tools, names))}\n")
    return Constraint("lark", grammar, f"open_tool_call({', '.join(names)})")


def _call_body_schema(tools: Sequence[dict], names: Sequence[str]) -> dict:
    """``{"name": <one of names>, "arguments": <that tool's parameters>}`` as one JSON schema."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    variants = []
    defs: dict[str, Any] = {}
    for i, name in enumerate(names):
        params = _prepared_schema(by_name[name].get("parameters") or {"type": "object", "properties": {}})
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


# Closing-mode preferences: lower tier first. Closers end strings, arrays and objects (and
# parentheses, in Lark and regex grammars); separators move on to the next required key.
# EOS ends the answer once it is complete.
_CLOSERS = frozenset(b'"}])')
_SEPARATORS = frozenset(b",:")
_DIGITS = frozenset(b"0123456789")
_STRUCTURE = frozenset(b'"{}[](),: \t\n\r')
# Take the closing path while the budget still exceeds it by this many tokens. One token can
# lengthen the shortest completion by several (a "," in an array, " {" in an object, a new
# optional key): with a slack of one, such a token right before the end left no completion
# that fits, and a valid-looking request ended with "length" and broken JSON.
_SLACK = 8
# Within this many tokens of the end, a choice of structure follows the completion (see
# GrammarProcessor.mask); content (string text, digits) stays the model's.
_STRUCTURE_SLACK = 32
# closing_path: candidates tried per step when the best one makes no progress, and extra
# tries per simulation (each a consume, a mask and a rollback, on the engine thread).
_TRIES = 128
_TRY_BUDGET = 512
_MAX_SAME_CLOSES = 16
# A content state may be reached this many times between closers and still count as progress:
# once was too few where the way out passes the state the string began in ("First Last").
_REVISITS = 2
# Candidates tried on a step that follows one without progress.
_STUCK_TRIES = 8
# Steps without progress after which escapes and pieces of characters are candidates again.
_AWKWARD_AFTER = 16
# Searches that may find no completion in one request before closing mode gives up on it.
_MAX_FAILED_SEARCHES = 3


class TokenClasses(NamedTuple):
    """What closing mode needs to know of each token id (arrays over the vocabulary)."""

    tier: np.ndarray  # closing preference: 0 EOS, 1 closers, 2 separators, 3 digits, 4 the rest
    length: np.ndarray  # bytes
    quote_first: np.ndarray  # starts with a quote
    awkward: np.ndarray  # holds a backslash (an escape, in a JSON string)
    partial: np.ndarray  # bytes that are not whole UTF-8 characters
    structural: np.ndarray  # only JSON punctuation and whitespace (or EOS): no content


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
                    self._llt = llguidance.hf.from_tokenizer(
                        hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._llt

    def marker(self, text: str) -> str:
        """A Lark expression for a literal marker such as ``<tool_call>``.

        llguidance treats every added token as special; those only match by id.
        """
        llt = self.tokenizer
        ids = llt.tokenize_str(text)
        if len(ids) == 1 and llt.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

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
        return matcher

    def tiers(self) -> "TokenClasses":
        """Per-token closing preference and classes (``TokenClasses``), computed once."""
        if self._tiers is None:
            llt = self.tokenizer
            tier = np.full(self.vocab_size, 4, dtype=np.int64)
            length = np.zeros(self.vocab_size, dtype=np.int64)
            quote_first = np.zeros(self.vocab_size, dtype=bool)
            awkward = np.zeros(self.vocab_size, dtype=bool)
            partial = np.zeros(self.vocab_size, dtype=bool)
            structural = np.zeros(self.vocab_size, dtype=bool)
            for i in range(self.vocab_size):
                b = llt.decode_bytes([i])
                length[i] = len(b)
                quote_first[i] = b[:1] == b'"'
                structural[i] = bool(b) and all(ch in _STRUCTURE for ch in b)
                try:
                    b.decode("utf-8")
                    awkward[i] = b"\\" in b
                except UnicodeDecodeError:
                    partial[i] = True
                if b and all(ch in _CLOSERS for ch in b):
                    tier[i] = 1
                elif b and all(ch in _SEPARATORS for ch in b):
                    tier[i] = 2
                elif b and all(ch in _DIGITS for ch in b):
                    tier[i] = 3  # numbers start with a digit, not "-"
            tier[self.eos_token_ids] = 0
            structural[self.eos_token_ids] = True
            self._tiers = TokenClasses(tier, length, quote_first, awkward, partial, structural)
        return self._tiers


def allowed_tokens(matcher, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = np.zeros(vocab_size, dtype=bool)
    n = min(vocab_size, bits.shape[0])
    allowed[:n] = bits[:n].astype(bool)
    return allowed


def closing_path(matcher, tiers: TokenClasses, eos: frozenset[int],
                 limit: int) -> Optional[list[int]]:
    """A short completion from the matcher's state (on a copy), or None if over ``limit``.

    Greedy over preference tiers: EOS, then closers (longest first: ``"}`` closes two
    levels), then separators, then digits, then anything allowed, shortest first (a long
    byte-level token can leave a UTF-8 sequence open; a single byte completes it); ties go
    to the lowest token id.

    A quote ends a string or opens one, and the other closer characters are a string's
    content. So in free text (most of the vocabulary allowed, a quote among it: a JSON
    string) only closers that start with a quote keep their tier; elsewhere a closer that
    starts with a quote opens a string with content, and ``"`` alone opens an empty one,
    which then needs closing: it goes after the other closers.

    Greedy alone loops where the best token is content: ``]`` in a string held to a
    pattern, ``0`` where a number must not be zero, ``(`` in a Lark grammar of nested
    parentheses, ``.`` and ``}`` in turn in an email address. So each step judges a
    candidate by the set of tokens allowed after it, and takes, in order of preference:
    1. a closer (or ``"``) after which that set differs: in structure (few tokens
       allowed), from the current one; in content (many allowed, where a closer character
       may be content), from every set seen since the last closer;
    2. in structure, the best closer that leaves the set as it is, at most
       ``_MAX_SAME_CLOSES`` times in a row: closing one level of nesting can leave the
       same choices (``}`` then ``}`` again, where the vocabulary has no ``}}``);
    3. the first of the best ``_TRIES`` other candidates after which the set is one not
       seen since the last closer, else one seen once (``_REVISITS``): the way out of
       "First Last" passes the state the string began in;
    4. the best candidate, and on each further step without progress the next one in
       turn: where every candidate leaves the set as it was (free text held to an
       unanchored pattern such as ``[0-9]{3}``), repeating the best one would never reach
       the content that lets the string close.
    Ending the grammar counts as progress.
    Judging a candidate costs a consume, a mask and, when it is refused, a rollback, on the
    engine thread: ``_TRY_BUDGET`` bounds the refusals per simulation, then only the best
    closer is judged and step 4 goes on in turn. Tested on fuzzed schemas, formats, patterns and grammars, on the factory and
    the demo tokenizers.
    """
    tier, length, quote_first, awkward, partial, _ = tiers
    vocab = tier.shape[0]
    closer = tier == 1
    in_text = np.where(closer & ~quote_first, 4, tier)
    in_structure = np.where(closer & quote_first, np.where(length > 1, 4, 2), tier)
    lone_quote = quote_first & (length == 1)
    m = matcher.deep_copy()
    path: list[int] = []
    allowed = allowed_tokens(m, vocab)
    seen = Counter([allowed.tobytes()])  # visits of each allowed set since the last closer
    budget, same_closes, stuck, turned = _TRY_BUDGET, 0, 0, 0

    def take(tok: int) -> np.ndarray:
        if not m.consume_token(tok):
            raise ValueError(tok)
        return allowed_tokens(m, vocab)

    def progress(tok: int, strict: bool, visits: int = 1) -> Optional[np.ndarray]:
        """Take ``tok`` if the allowed set after it is new (``strict``) or at least another
        one (or the grammar ended); else undo it."""
        nonlocal budget
        after = take(tok)
        if m.is_stopped() or (seen[after.tobytes()] < visits if strict else not np.array_equal(after, allowed)):
            return after
        m.rollback(1)
        budget -= 1
        return None

    try:
        while len(path) <= limit:
            if m.is_stopped():
                return path + [min(eos)]
            n_allowed = int(allowed.sum())
            if not n_allowed:
                return None
            free_text = 2 * n_allowed > vocab
            t = in_text if free_text else in_structure
            # Content never needs a piece of a character to close and rarely an escape, and
            # either reads as progress (only a few tokens may follow): it looped on ``\"``.
            # Escapes come back once the search has been stuck a while (a pattern ending in
            # a quote or a backslash needs one).
            usable = allowed
            if free_text:
                usable = allowed & ~partial & ~(awkward if stuck < _AWKWARD_AFTER else False)
            if not usable.any():
                usable = allowed
            score = np.where(usable, t * 100_000 + np.where(t >= 3, length, -length), np.iinfo(np.int64).max)
            n_allowed = int(usable.sum())
            n = min(n_allowed, _TRIES)
            best = np.sort(np.argpartition(score, n - 1)[:n]) if n < vocab else np.arange(vocab)
            best = [int(i) for i in best[np.argsort(score[best], kind="stable")]]  # ties: lowest id first
            if best[0] in eos:
                return path + [best[0]]
            # Out of tries: the best closer, else the candidates in turn (4).
            tries = best if budget > 0 else best[:1]
            closing = [i for i in tries if t[i] == 1 or lone_quote[i]]
            others = [i for i in tries if not (t[i] == 1 or lone_quote[i])] if budget > 0 else []
            structure = 8 * n_allowed < vocab
            tok = after = None
            for i in closing:  # 1
                if (after := progress(i, strict=not structure)) is not None:
                    tok = i
                    break
            # A closer right after an escape (``\"``) is content: nothing ended.
            ended = tok is not None and not (path and awkward[path[-1]])
            same_level = False
            if tok is None and closing and structure and same_closes < _MAX_SAME_CLOSES:
                after = take(closing[0])  # 2
                same_level = np.array_equal(after, allowed)
                if same_level:
                    tok, ended = closing[0], True
                else:
                    m.rollback(1)
            same_closes = same_closes + 1 if same_level else 0
            # 3 and 4 go round the candidates from where the last step without progress
            # left off; after such a step only the next few are tried (tries are the cost).
            k = turned % len(best)
            turn = best[k:] + best[:k]
            if tok is None:  # 3: a set not seen since the last closer, else one seen once
                pool = set(others)
                window = others if not stuck else [i for i in turn[:_STUCK_TRIES] if i in pool]
                for visits in range(1, _REVISITS + 1):
                    tok = next((i for i in window if (after := progress(i, strict=True, visits=visits)) is not None),
                               None)
                    if tok is not None:
                        break
            if tok is None:  # 4
                tok = turn[0]
                after = take(tok)
                stuck += 1
                turned += 1  # not reset by progress: the next round starts where this one ended
            else:
                stuck = 0
            path.append(tok)
            if ended:  # something ended: the same content states may recur (array items)
                seen = Counter()
            allowed = after
            seen[allowed.tobytes()] += 1
    except ValueError:  # an allowed token the matcher then refused
        return None
    return None


class GrammarProcessor:
    """mlx-lm logits processor for one row: mask to the grammar, close within budget.

    mlx-lm calls a row's processors once per generated token, with the row's token
    context whose last element is the token sampled at the previous call.
    """

    def __init__(self, matcher, *, tiers, eos_token_ids: Sequence[int], max_tokens: int,
                 vocab_size: int):
        self.matcher = matcher
        self._tiers = tiers
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._max_tokens = int(max_tokens)
        self._vocab = int(vocab_size)
        self._calls = 0
        self._forced: list[int] = []
        self._estimate = 0  # tokens the last simulated completion needed
        self._next_check = 1  # call number of the next simulation far from the end
        self._retry_at = 0  # after a simulation that found no completion: when to try again
        self._failed = 0
        self.closed_early = False

    def cap_budget(self, max_tokens: int) -> None:
        """Lower the row's token budget before it starts (the vision lane learns the real
        one only once the images are expanded), so the answer still closes within it."""
        self._max_tokens = min(self._max_tokens, int(max_tokens))

    def __call__(self, tokens, logits):
        if self._calls > 0:
            self.consume(int(tokens[-1].item()))
        return self.mask(logits)

    def consume(self, tok: int) -> None:
        """Advance the matcher by a token the row emitted."""
        if not self.matcher.consume_token(tok):
            raise ConstraintError(f"grammar rejected token {tok}: {self.matcher.get_error()}")

    def mask(self, logits):
        """The logits for the next token, masked to the grammar (one call per token)."""
        import mlx.core as mx

        self._calls += 1
        remaining = self._max_tokens - self._calls + 1  # tokens left, this one included
        # Simulate at the start (the smallest answer's length) and whenever the budget left
        # is within twice the last estimate: cheap far from the end, exact near it.
        # Also re-simulate far from the end, at shrinking intervals: the completion grows
        # while the model nests ("[[[[..."), so the last estimate alone can be far too low.
        steer = None
        if not self._forced and self._calls >= self._retry_at and (
                self._calls >= self._next_check or remaining <= 2 * self._estimate + _STRUCTURE_SLACK):
            path = closing_path(self.matcher, self._tiers, self._eos, limit=remaining)
            if path is None:
                # None fits now (or the search found none): look again later, less often,
                # since the model may reach a state it can close from; a failed search
                # walks the whole budget, so after _MAX_FAILED_SEARCHES stop looking.
                self._failed += 1
                self._retry_at = (self._calls + max(4, remaining // 4) if self._failed < _MAX_FAILED_SEARCHES
                                  else self._max_tokens + 1)
            elif len(path) >= remaining - _SLACK:
                self._forced = path  # the budget only just covers a completion: take it
                self.closed_early = True
            else:
                self._estimate = len(path)
                self._next_check = self._calls + max(1, (remaining - len(path) - _SLACK) // 4)
                if len(path) >= remaining - _STRUCTURE_SLACK and self._tiers.tier[path[0]] <= 2:
                    steer = path[0]  # a closer, separator or EOS
        if self._forced:
            allowed = np.zeros(logits.shape[-1], dtype=bool)
            allowed[self._forced.pop(0)] = True
        else:
            allowed = allowed_tokens(self.matcher, logits.shape[-1])
            classes = self._tiers
            if steer is not None and not (allowed & ~(classes.structural | classes.quote_first)).any():
                # Near the end, at a choice of structure only (a new key, item, nesting or
                # call, or the closer), close: one such token can lengthen the completion
                # past any fixed slack (a long optional key, a dict entry holding an object).
                # Where a token may go on with the value (a digit, a letter of an enum
                # value), the choice is the model's.
                allowed = np.zeros_like(allowed)
                allowed[steer] = True
        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))


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
