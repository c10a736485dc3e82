"""Neutral chat messages (OpenAI-style dicts): validation, media detection and normalization.

Normalization makes real clients' histories acceptable to strict chat templates without
losing anything: developer -> system, system messages hoisted and merged at the front,
consecutive same-role messages merged (an assistant's calls keep their ids), turns split
where the template cannot print them whole, and each run of tool results put in the order
of the calls they answer (each after its own call where the template takes one call a
turn). A tool message is never merged or dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .errors import InvalidRequestError, UnsupportedContentError

Message = dict[str, Any]

ROLES = ("system", "developer", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}
MEDIA_PART_TYPES = frozenset({"image", "image_url", "input_image", "video", "video_url", "audio", "input_audio"})
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_SEPARATOR = "\n\n"


def validate_messages(messages: Any) -> list[Message]:
    """Check the shape of a message list; returns a list (the input is not modified)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} dicts")
    messages = list(messages)
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    for i, m in enumerate(messages):
        if isinstance(m, Mapping) and not isinstance(m, dict):  # a read-only mapping: a copy
            messages[i] = m = dict(m)
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role={role!r}: expected one of {ROLES}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequestError(f"messages[{i}].content must be a string, a list of parts or None")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}] must be a dict with a string 'type'")
                if part["type"] in TEXT_PART_TYPES and not isinstance(part.get("text", ""), str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}].text must be a string")
                if part["type"] not in TEXT_PART_TYPES and part["type"] not in MEDIA_PART_TYPES:
                    # Silently dropping a part (a PDF, say) would answer a different question.
                    raise UnsupportedContentError(
                        f"messages[{i}].content[{j}]: unsupported part type {part['type']!r}")
        if m.get("reasoning_content") is not None and not isinstance(m["reasoning_content"], str):
            raise InvalidRequestError(f"messages[{i}].reasoning_content must be a string or None")
        if role == "tool" and not m.get("tool_call_id") and not m.get("name"):
            raise InvalidRequestError(f"messages[{i}]: a tool message needs 'tool_call_id' (or 'name')")
        _validate_tool_calls(m.get("tool_calls"), f"messages[{i}].tool_calls")
    return messages


def _validate_tool_calls(calls: Any, where: str) -> None:
    """An assistant's calls: a list of {"function": {"name": str, "arguments": ...}} (OpenAI
    style) or of {"name": str, "arguments": ...} (accepted by HF chat templates)."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list of calls")
    for j, call in enumerate(calls):
        fn = (call.get("function", call) if isinstance(call, dict) else None)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(
                f"{where}[{j}] must be {{'function': {{'name': ..., 'arguments': ...}}}} or {{'name': ..., 'arguments': ...}}")
        # The template prints them as JSON: a set went in as "<set>".
        arguments_text(fn.get("arguments"), f"{where}[{j}]")


def arguments_text(args: Any, where: str) -> str:
    """A call's arguments as the JSON text a template renders (a string is kept as given),
    for the adapters' histories; InvalidRequestError where they are not JSON (a date, a
    set). NaN and infinities pass, as Python's JSON writes them: a call the engine read
    holds an infinity where the model wrote a number past a double's range (valid JSON,
    which the grammars take), and its answer must go back into the history as it came."""
    if isinstance(args, str):
        return args
    try:
        return json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{where}: tool call arguments must be JSON-serializable ({exc})") from None


def has_media(messages: Iterable[Message]) -> bool:
    """True when any message carries an image, video or audio part."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") in MEDIA_PART_TYPES for p in content):
            return True
    return False


def text_of(content: Any) -> str:
    """The text of a content value (string or list of parts); media parts are skipped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") in TEXT_PART_TYPES)


@dataclass(frozen=True)
class CallTurns:
    """What a chat template makes of an assistant turn with calls, which decides the
    merges that keep its history whole (``PromptRenderer.call_turns`` finds out by rendering).

    ``text``: the turn's text is rendered beside its calls. Llama 3.1's and Mistral v3's
    templates print only the calls, so text merged into a call turn was dropped (and Mistral
    v3 counts only text turns when it checks that roles alternate, so the merge broke that).
    ``several``: a turn takes more than one call (Llama 3.1 raises on two).
    """

    text: bool = True
    several: bool = True


def _is_plain(m: Message) -> bool:
    return not m.get("tool_calls") and not m.get("tool_call_id") and m["role"] != "tool"


def _mergeable(prev: Message, m: Message) -> bool:
    """Whether ``m`` can join ``prev`` whole: same role, no tool result, the same extra
    fields. Assistant calls join (the ids kept, in order), as text then calls or calls then
    calls; text after calls stays apart (alone or with calls of its own), since templates
    print a turn's text before its calls. A turn the template cannot print whole is split
    afterwards (``_split_call_turn``)."""
    if prev["role"] != m["role"] or prev["role"] in ("system", "tool") or not _same_extras(prev, m):
        return False
    if _is_plain(prev) and _is_plain(m):
        return True
    if prev["role"] != "assistant" or prev.get("tool_call_id") or m.get("tool_call_id") or not m.get("tool_calls"):
        return False
    return not prev.get("tool_calls") or not text_of(m.get("content")).strip()


def _in_call_order(out: list[tuple[Message, list[int]]], turns: CallTurns) -> list[tuple[Message, list[int]]]:
    """Each run of tool results in the order of the calls it answers.

    Clients match a result to its call by id, in any order (OpenAI, LangChain); templates
    in the Qwen and Hermes style pair them by position, so a run answered out of order
    would read each result against the wrong call. A run is reordered only when its ids
    answer distinct calls of the assistant call turns just before it. Where the template
    takes one call a turn (``_split_call_turn``) and the run answers each of those turns'
    call once, each result follows its call: call, result, call, result, as such a model
    calls tools one after another.
    """
    out = list(out)
    i = 0
    while i < len(out):
        j = i
        while j < len(out) and out[j][0]["role"] == "tool":
            j += 1
        # The calls of the assistant turns just before the run (one turn, or one a call
        # where the template takes one a turn).
        calls, k = [], i - 1
        while j > i + 1 and k >= 0 and out[k][0]["role"] == "assistant" and out[k][0].get("tool_calls"):
            calls[:0] = out[k][0]["tool_calls"]
            k -= 1
        if calls:
            order = {c["id"]: n for n, c in enumerate(calls)
                     if isinstance(c, dict) and isinstance(c.get("id"), str)}
            ids = [m.get("tool_call_id") for m, _ in out[i:j]]
            if all(isinstance(x, str) and x in order for x in ids) and len(set(ids)) == len(ids):
                out[i:j] = sorted(out[i:j], key=lambda item: order[item[0]["tool_call_id"]])
                call_turns = out[k + 1:i]
                if not turns.several and len(call_turns) == len(calls) == j - i == len(order):
                    out[k + 1:j] = [item for pair in zip(call_turns, out[i:j]) for item in pair]
        i = max(j, i + 1)
    return out


def _is_system(m: Message) -> bool:
    return ROLE_ALIASES.get(m.get("role"), m.get("role")) == "system"


def hoisted_order(messages: Sequence[Message], turns: CallTurns = CallTurns()) -> list[tuple[int, Message]]:
    """(index, message) of the caller's messages in the order ``normalize_messages``
    renders their content: system and developer messages first, tool results in call order."""
    messages = list(messages)
    return [(i, messages[i]) for _, sources in _normalized(validate_messages(messages), turns) for i in sources]


_MERGED_FIELDS = frozenset({"role", "content", "reasoning_content", "tool_calls"})


def _same_extras(a: Message, b: Message) -> bool:
    """Whether two messages agree on every field a merge does not join (``name``, ...)."""
    keys = (set(a) | set(b)) - _MERGED_FIELDS
    return all(a.get(k) == b.get(k) for k in keys)


def _copy(obj: Any) -> Any:
    """A copy of the message structure (dicts, lists, tuples); leaves are shared. Leaves are
    never mutated, and some cannot be deep-copied (a memoryview of image bytes) or are
    costly to (PIL images)."""
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list) or type(obj) is tuple:
        return type(obj)(_copy(v) for v in obj)
    return obj


def _merge_content(a: Any, b: Any) -> Any:
    if _no_content(a):
        return _copy(b)
    if _no_content(b):
        return a
    if isinstance(a, str) and isinstance(b, str):
        return a + _SEPARATOR + b
    parts_a = [{"type": "text", "text": a}] if isinstance(a, str) else list(a)
    parts_b = [{"type": "text", "text": b}] if isinstance(b, str) else _copy(b)
    return parts_a + [{"type": "text", "text": _SEPARATOR}] + parts_b


def _no_content(c: Any) -> bool:
    """None, "", [] or only empty text parts: nothing to join (a separator would be all)."""
    if c is None or c == "":
        return True
    return isinstance(c, list) and all(p.get("type") in TEXT_PART_TYPES and not p.get("text") for p in c)


def normalize_messages(messages: Iterable[Message], turns: CallTurns = CallTurns()) -> list[Message]:
    """Return a normalized deep copy; the caller's messages are never modified.

    1. ``developer`` becomes ``system``.
    2. All system messages are hoisted to the front and merged into one, in order.
    3. Consecutive messages of the same role are merged when their ``name`` is the same
       and they carry no other field that differs; their ``content`` and
       ``reasoning_content`` are joined, and an assistant's ``tool_calls`` are concatenated
       (text then calls, or calls then calls; see ``_mergeable``). Strict templates (Gemma,
       Mistral) refuse two assistant turns in a row, and a Responses-style history often
       has one for the text and one per call. Tool results are never merged. Nothing else
       is dropped: messages that cannot be merged whole stay apart. A turn the template
       cannot print whole (``turns``, found by ``PromptRenderer.call_turns``) is then split
       into turns it can (``_split_call_turn``).
    4. Each run of tool results follows the order of the calls it answers, each result
       after its own call where the template takes one call a turn (``_in_call_order``).
    """
    return [m for m, _ in _normalized(validate_messages(messages), turns)]


def _normalized(messages: list[Message], turns: CallTurns = CallTurns()) -> list[tuple[Message, list[int]]]:
    """``normalize_messages``, each message with the caller's indices it was made from."""
    try:
        msgs = [_copy(m) for m in messages]
    except RecursionError:
        raise InvalidRequestError("a message is nested too deeply") from None
    for m in msgs:
        m["role"] = ROLE_ALIASES.get(m["role"], m["role"])

    out: list[tuple[Message, list[int]]] = []
    system = [i for i, m in enumerate(msgs) if _is_system(m)]
    if system:
        # The fields every system message shares (a ``name``) stay; a template takes one
        # system message, so fields they disagree on cannot.
        extras = [{k: v for k, v in msgs[i].items() if k not in ("role", "content")} for i in system]
        head = {"role": "system", "content": None,
                **{k: v for k, v in extras[0].items() if all(k in e and e[k] == v for e in extras[1:])}}
        for i in system:
            head["content"] = _merge_content(head["content"], msgs[i].get("content"))
        if head["content"] is None:
            head["content"] = ""
        out.append((head, system))

    for i, m in enumerate(msgs):
        if _is_system(m):
            continue
        prev = out[-1][0] if out else None
        if prev is not None and _mergeable(prev, m):
            prev["content"] = _merge_content(prev.get("content"), m.get("content"))
            if m.get("reasoning_content"):
                prev["reasoning_content"] = _merge_content(prev.get("reasoning_content"), m["reasoning_content"])
            if m.get("tool_calls"):
                prev["tool_calls"] = list(prev.get("tool_calls") or []) + m["tool_calls"]
            out[-1][1].append(i)
            continue
        out.append((m, [i]))
    if not (turns.text and turns.several):
        out = [piece for item in out for piece in _split_call_turn(item, turns)]
    return _in_call_order(out, turns)


def _split_call_turn(item: tuple[Message, list[int]], turns: CallTurns) -> list[tuple[Message, list[int]]]:
    """An assistant turn the template cannot print whole, as turns it can: its text (and
    reasoning) apart from its calls where it drops a call turn's text, and one call a turn
    where it takes one (Llama 3.1's dropped the text and raised on two calls). The caller's
    indices go with the first piece only, so the images are read once."""
    m, sources = item
    calls = m.get("tool_calls") or []
    if m["role"] != "assistant" or not calls or (turns.several or len(calls) == 1) and (
            turns.text or _no_content(m.get("content"))):
        return [item]
    pieces = []
    head = {k: v for k, v in m.items() if k != "tool_calls"}
    if not turns.text and not _no_content(m.get("content")):
        pieces.append(head)
        head = {k: v for k, v in head.items() if k not in ("content", "reasoning_content")}
    for group in ([calls] if turns.several else [[c] for c in calls]):
        pieces.append({**head, "tool_calls": group})
        head = {k: v for k, v in head.items() if k not in ("content", "reasoning_content")}
    return [(piece, sources if k == 0 else []) for k, piece in enumerate(pieces)]
