"""Split a chat answer into reasoning, content and tool calls, incrementally.

Runs on the caller's side of a stream (pure Python, per request), so both adapters get the
same parsing: ``<think>...</think>`` becomes reasoning, each ``<tool_call>...</tool_call>``
becomes a ToolCall (or an InvalidToolCall when it cannot be parsed), the rest is content.
Text that might be the start of a marker is held back until it is decided, so a marker
split across stream deltas is never leaked as content.

Whitespace decisions (the ones vLLM's reasoning and Hermes tool parsers make): reasoning
is stripped, content after ``</think>`` or after a tool call loses its leading whitespace,
and whitespace right before a tool call is dropped. With no markers in the output the
content is exactly the generated text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .chat_format import ChatFormat
from .cut_names import check_not_cut_short
from .detokenizer import JsonStrings, partial_marker_length
from .outputs import InvalidToolCall, ToolCall
from .xml_call_reading import function_header, normalized_call, read_arguments, reread_names, split_calls

CONTENT, REASONING, TOOL_CALL = "content", "reasoning", "tool_call"


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


class _Channel:
    """A text channel that strips leading whitespace on demand and holds trailing whitespace."""

    def __init__(self, strip_leading: bool):
        self.strip_leading = strip_leading
        self.pending_ws = ""
        self.joining = False  # after a call, with text before it: its white space may join them
        self._stripped = ""

    def resume_after_call(self, joining: bool) -> None:
        """Text after a tool call: its leading white space is stripped, and the text joins
        the text before the call (``joining``) with the white space written before the
        call, else with the one written after it."""
        self.strip_leading, self.joining, self._stripped = True, joining, ""

    def push(self, text: str) -> str:
        if self.strip_leading:
            body = text.lstrip()
            if self.joining:
                self._stripped += text[:len(text) - len(body)]
            if not body:
                return ""
            if self.joining and not self.pending_ws:
                self.pending_ws = self._stripped
            text, self.strip_leading, self.joining, self._stripped = body, False, False, ""
        body = text.rstrip()
        out = self.pending_ws + body if body else ""
        self.pending_ws = text[len(body):] if body else self.pending_ws + text
        return out

    def drop_pending(self) -> None:
        self.pending_ws = ""

    def take_pending(self) -> str:
        out, self.pending_ws = self.pending_ws, ""
        return out


class ChatOutputParser:
    def __init__(
        self,
        fmt: ChatFormat,
        *,
        tools: Optional[Sequence[dict]] = None,
        parse_tool_calls: bool = False,
        starts_in_reasoning: bool = False,
        forced_json_calls: bool = False,
        forced_call: bool = False,
        max_tool_calls: Optional[int] = None,
        verbatim: bool = False,
        call_start_by_token: bool = False,
    ):
        self._fmt = fmt
        # The call-start marker is a special token: a call opens only where that token wrote
        # it (``feed``'s ``call_starts``), as the call grammars open; spelled in ordinary
        # tokens ("<tool" "_call>", mentioned in a sentence) it is text (detokenizer.CallMarkers).
        self._by_token = call_start_by_token
        self._call_starts: set[int] = set()
        self._verbatim = verbatim  # no markers: the text is the content, exactly
        self._max_calls = max_tool_calls
        #: The answer has made its last allowed call; everything after it is dropped.
        self.calls_exhausted = False
        #: Where that call's end marker ends, in the text fed so far (None: at its end).
        self.exhausted_at: Optional[int] = None
        self._fed = 0  # characters fed so far
        self._tools = list(tools or [])
        self._parse_tools = parse_tool_calls and fmt.has_tool_calling
        self._forced_json = forced_json_calls
        self._forced_call = forced_call and self._parse_tools
        self._xml_values = fmt.tool_format == "qwen3_coder" and not forced_json_calls
        #: Calls have a JSON body: an end marker inside one of its strings is argument text
        #: (detokenizer.JsonStrings; the stop matcher reads calls by the same rule).
        self.json_body = self._parse_tools and (forced_json_calls or fmt.tool_format == "json_tools")
        self._strings = JsonStrings()
        self._state = REASONING if (starts_in_reasoning and fmt.has_thinking and not verbatim) else CONTENT
        self._buf = ""
        self._call_buf = ""
        self._content = _Channel(strip_leading=False)
        self._reasoning = _Channel(strip_leading=True)
        self._seen_content = False
        self.num_tool_calls = 0
        self._calls_written = 0  # valid and invalid: the next call's index
        self._content_chars = 0  # content handed out so far: a call's content_offset
        self._call_ids: set[str] = set()
        #: The answer has reasoned (it started in reasoning or opened it).
        self.reasoned = self._state == REASONING

    @property
    def in_reasoning(self) -> bool:
        return self._state == REASONING

    @property
    def think_end_ids(self) -> tuple[int, ...]:
        return self._fmt.think_end_ids

    @property
    def format(self) -> ChatFormat:
        return self._fmt

    # ------------------------------------------------------------------ markers
    def _markers(self) -> list[str]:
        f = self._fmt
        if self._verbatim:
            return []
        if self._state == REASONING:
            return [f.think_end]
        if self._state == TOOL_CALL:
            # Mistral's format has no end marker (mlx-lm's parser: ""): the call runs to the
            # end of the answer, closed by finish(). "" would match at once, an empty call.
            return [f.tool_call_end] if f.tool_call_end else []
        out = []
        # Invalid calls count: after any call <think> is text (as the stop matcher reads it).
        if f.has_thinking and not self._seen_content and not self._calls_written:
            out.append(f.think_start)
        if self._parse_tools:
            out.append(f.tool_call_start)
        return out

    # ------------------------------------------------------------------ feeding
    def feed(self, text: str, call_starts: Sequence[int] = ()) -> ParsedDelta:
        """The next piece of the answer's text. ``call_starts``: offsets in the whole text
        where the call-start token wrote its marker (with ``call_start_by_token``)."""
        out = ParsedDelta()
        if self.calls_exhausted:
            return out
        self._call_starts.update(call_starts)
        self._buf += text
        self._fed += len(text)
        while True:
            markers = self._markers()
            hits = [(self._buf.find(m), m) for m in markers]
            # <think> opens reasoning only before any content. Text ahead of it in the same
            # buffer is content too: without this check the result depended on how the
            # stream was split into deltas ("abc<think>" in one delta vs. two).
            hits = [(i, m) for i, m in hits if i >= 0
                    and not (m == self._fmt.think_start and self._state == CONTENT and self._buf[:i].strip())]
            if not hits:
                keep = partial_marker_length(self._buf, markers)
                cut = len(self._buf) - keep
                self._take(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                if self._state == TOOL_CALL and not self._fmt.tool_call_end and self._max_calls is not None:
                    self._end_at_first_call(out)
                return out
            i, marker = min(hits)
            if self._by_token and marker == self._fmt.tool_call_start and self._state == CONTENT \
                    and self._fed - len(self._buf) + i not in self._call_starts:
                # Spelled in ordinary tokens: text (see __init__).
                self._take(self._buf[:i + len(marker)], out)
                self._buf = self._buf[i + len(marker):]
                continue
            if self._state == TOOL_CALL and self.json_body and self._strings.inside_after(self._buf[:i]):
                self._take(self._buf[:i + len(marker)], out)
                self._buf = self._buf[i + len(marker):]
                continue
            self._take(self._buf[:i], out)
            self._buf = self._buf[i + len(marker):]
            self._switch(marker, out)
            if self.calls_exhausted:
                self.exhausted_at = self._fed - len(self._buf)
                self._buf = ""
                return out

    def finish(self, truncated: bool = False) -> ParsedDelta:
        """The end of the answer; ``truncated``: it reached ``max_tokens`` (a call still open
        then is cut off, its invalid call marked so)."""
        out = ParsedDelta()
        if self.calls_exhausted:
            return out
        rest, self._buf = self._buf, ""
        if truncated and self._forced_call and self._state == CONTENT and rest.strip() \
                and self._fmt.tool_call_start.startswith(rest.strip()):
            # Cut inside a forced call's start marker (one spelled in several tokens): the
            # grammar allowed nothing but the call here, so the text is a cut call, not content.
            rest = ""
            self._switch(self._fmt.tool_call_start, out)
        self._take(rest, out)
        if self._state == TOOL_CALL:  # stopped inside a call: parse what there is
            self._close_call(out, truncated=truncated)
        if not self._calls_written:  # else it is white space held before a call (see _switch)
            rest = self._content.take_pending()
            out.content += rest
            self._content_chars += len(rest)
        return out

    def _take(self, text: str, out: ParsedDelta) -> None:
        if not text:
            return
        if self._state == CONTENT:
            piece = self._content.push(text)
            if piece:
                self._seen_content = True
                out.content += piece
                self._content_chars += len(piece)
            elif text.strip():
                self._seen_content = True
        elif self._state == REASONING:
            out.reasoning += self._reasoning.push(text)
        else:
            self._call_buf += text
            if self.json_body:
                self._strings.feed(text)

    def _switch(self, marker: str, out: ParsedDelta) -> None:
        f = self._fmt
        if self._state == CONTENT and marker == f.think_start:
            self._content.drop_pending()  # whitespace before <think> is not content either
            self._state = REASONING
            self.reasoned = True
        elif self._state == REASONING:
            self._reasoning.drop_pending()
            self._state = CONTENT
            self._content.resume_after_call(False)  # after reasoning: nothing to join
        elif self._state == CONTENT:  # tool_call_start
            if not self._content_chars:
                self._content.drop_pending()
            # Else the white space before the call is held: content after the call (its own
            # leading white space stripped) begins with it, or with the white space after the
            # call where there was none before (_Channel.resume_after_call), so "Let me
            # check." and "Done." either side of a call do not run together; an answer
            # ending with calls drops it.
            self._state = TOOL_CALL
            self._call_buf = ""
            self._strings = JsonStrings()
        else:  # tool_call_end
            self._close_call(out)

    def _end_at_first_call(self, out: ParsedDelta) -> None:
        """``parallel_tool_calls=False`` in a format without an end marker (Mistral's): its
        calls run to the end of the answer, so the row decoded every call of its list and
        the output kept the first. The answer now ends where its first call is whole and
        valid (an invalid first call ends nothing: a later one may count)."""
        first = _first_call(self._call_buf)
        if first is None:
            return
        block, end = first
        items = self._parse_call(block)
        if not items or not isinstance(items[0], ToolCall):
            return
        at = self._fed - len(self._buf) - (len(self._call_buf) - end)  # the call's end in the fed text
        self._call_buf = block
        self._close_call(out, items=items[:1])
        if self.calls_exhausted:
            self.exhausted_at = at
            self._buf = ""

    def _close_call(self, out: ParsedDelta, truncated: bool = False, items: Optional[list] = None) -> None:
        body, self._call_buf = self._call_buf, ""
        self._state = CONTENT
        self._content.resume_after_call(joining=self._content_chars > 0)
        items = self._parse_call(body) if items is None else items
        if truncated and self._fmt.tool_call_end and items and isinstance(items[-1], ToolCall):
            # Its end marker never came, yet a lenient parser (GLM's) read what was written
            # as a call: with the arguments written so far, a flag being written dropped.
            # It is cut off like any other (a format with no end marker, Mistral's, ends its
            # calls with the answer: a body that parses is whole there).
            cut = items[-1]
            own = (split_calls(body) or [body])[-1] if self._xml_values else body  # its own text
            items[-1] = InvalidToolCall(id=cut.id, name=cut.name, arguments=cut.arguments_json,
                                        error="the answer reached max_tokens inside this call", text=own.strip())
        for k, item in enumerate(items):
            if self.calls_exhausted:
                break
            item = dataclasses.replace(item, index=self._calls_written, content_offset=self._content_chars)
            self._calls_written += 1
            if isinstance(item, ToolCall):
                out.tool_calls.append(item)
                self.num_tool_calls += 1
                self.calls_exhausted = self._max_calls is not None and self.num_tool_calls >= self._max_calls
            else:
                # Of a block of several calls only the last can be the one cut off.
                out.invalid_tool_calls.append(dataclasses.replace(item, truncated=truncated and k == len(items) - 1))

    def _call_id(self, given: Any) -> str:
        """The id the model wrote (Mistral's templates want their own 9-character ids back
        in the history, as mlx-lm's parser and vLLM keep them), else a fresh one; never one
        this answer has used already."""
        cid = given if isinstance(given, str) and given.strip() and given not in self._call_ids else new_tool_call_id()
        self._call_ids.add(cid)
        return cid

    def _parameters(self, name: str) -> Optional[dict]:
        return next((t["function"].get("parameters") for t in self._tools
                     if t.get("function", {}).get("name") == name), None)

    def _parse_call(self, body: str) -> list:
        """The calls of one call block. Each call is judged alone: a block of several (Kimi's
        section, Mistral's list) keeps its valid calls beside an invalid one."""
        written = body
        if self._xml_values:  # each call alone, as the template writes one (xml_calls.py)
            calls = split_calls(body)
            if len(calls) > 1:
                return [item for call in calls for item in self._parse_call(call)]
            written = normalized_call(calls[0]) if calls else body
        try:
            if self._forced_json or self._fmt.tool_parser is None:
                parsed: Any = json.loads(body.strip())
            elif self._xml_values:
                # Given no tools, mlx-lm's parser hands back each value's text; read_arguments
                # reads it by the schema as the grammar writes it (see its docstring for why).
                parsed = reread_names(written, self._fmt.tool_parser(written, None), self._tools)
            else:
                parsed = self._as_written(body, self._fmt.tool_parser(body, self._tools or None))
        except Exception as exc:  # noqa: BLE001 - any parser failure is an invalid call
            cut = self._whole_before_cut(body)
            if cut is None:
                return [self._invalid(body.strip(), exc)]
            # A block of several calls, one of them cut off (by max_tokens) or no call: the
            # others are whole, and were lost with it.
            whole, rest = cut
            if not whole and not rest:  # "[" alone: a block cut before its first call
                return [self._invalid(body.strip(), exc)]
            return self._judged(whole, written=body) + ([self._invalid(rest, exc)] if rest else [])
        return self._judged(parsed if isinstance(parsed, list) else [parsed], block=written, written=written)

    @staticmethod
    def _as_written(body: str, parsed: Any) -> Any:
        """The items of a whole JSON list of calls (Mistral's) as written, where the
        format's parser read that list: mlx-lm's (0.32) rebuilds each call from its "name"
        and "arguments" only, so arguments under another key ("parameters", "args") were
        lost and the call read as one of none, past ``_arguments_of``'s check."""
        read = parsed if isinstance(parsed, list) else [parsed]  # one call comes back alone
        listed = _list_items(body)
        if listed is None or listed[1] or len(listed[0]) != len(read) \
                or not all(isinstance(item, dict) for item in listed[0]):
            return parsed
        return listed[0]

    def _whole_before_cut(self, body: str) -> Optional[tuple[list, str]]:
        """The whole calls of a block the format's parser refused, and the text of a call cut
        off after them: a JSON list's items (mlx-lm's Mistral parser refuses a whole list
        for one item that is no call), or what the parser reads of the block up to a cut
        call's header (Mistral's ``a[ARGS]{...}b[ARGS]{...``)."""
        listed = _list_items(body)
        if listed is not None or self._forced_json or self._fmt.tool_parser is None:
            return listed
        starts = [m.start() for m in _ARGS_HEADER.finditer(body)]
        if len(starts) < 2 or _cut_parts(body[starts[-1]:]) is None:
            return None
        try:
            parsed = self._fmt.tool_parser(body[:starts[-1]], None if self._xml_values else self._tools or None)
        except Exception:  # noqa: BLE001 - the calls before it are broken too: one invalid block
            return None
        return (parsed if isinstance(parsed, list) else [parsed]), body[starts[-1]:].strip()

    def _judged(self, items: list, block: Optional[str] = None, written: str = "") -> list:
        """Each item as a call, or an invalid call where it is none; where none is, a whole
        ``block`` is one invalid call, as written. ``written``: the text the items were read
        from, for ``cut_names.check_not_cut_short``; a JSON text is not checked (JSON parsers read
        names whole, and a name written with an escape is not found as written)."""
        calls, errors = [], []
        text = block if block is not None and len(items) == 1 else ""  # the call's own text
        if written and (self._json_text(written) or _list_items(written) is not None):
            written = ""
        for item in items:
            try:
                calls.append(self._call(item, text, written))
            except Exception as exc:  # noqa: BLE001 - as above, for this call alone
                calls.append(None)
                errors.append(exc)
        if block is not None and len(errors) == len(items):
            return [self._invalid(block.strip(), errors[0] if errors else ValueError("no call in the block"))]
        failed = iter(errors)
        return [call or self._invalid(_item_text(item), next(failed)) for call, item in zip(calls, items)]

    def _json_text(self, text: str) -> bool:
        if self.json_body:
            return True
        try:
            json.loads(text)
        except ValueError:
            return False
        return True

    def _call(self, item: Any, body: str = "", block: str = "") -> ToolCall:
        name = item["name"]
        args = _arguments_of(item)
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if not isinstance(name, str) or not isinstance(args, dict):
            raise ValueError("a tool call needs a string name and object arguments")
        if self._xml_values:
            args = read_arguments(args, self._parameters(name), body)
        check_not_cut_short(block, name, args, self._tools)
        return _json_holdable(ToolCall(id=self._call_id(item.get("id")), name=name, arguments=args))

    @staticmethod
    def _invalid(text: str, exc: BaseException) -> InvalidToolCall:
        name, arguments = _readable_parts(text)
        return InvalidToolCall(id=new_tool_call_id(), name=name, arguments=arguments,
                               error=f"{type(exc).__name__}: {exc}", text=text)


#: Where a JSON call's arguments are read from: Hermes-style templates write "arguments",
#: Llama 3's JSON calls "parameters" (vLLM's llama3_json parser reads both).
ARGUMENT_KEYS = ("arguments", "parameters")
#: Keys a call may hold besides its name and arguments.
_CALL_KEYS = {"name", "id", "type"}


def _arguments_of(item: dict) -> Any:
    """A call's arguments. A call with neither key but other keys besides its name is no
    call of no arguments: what it wrote under them (``"args"``) would be lost, and the tool
    run without them."""
    key = next((k for k in ARGUMENT_KEYS if k in item), None)
    if key is not None:
        return item[key]
    unknown = sorted(str(k) for k in item if k not in _CALL_KEYS)
    if unknown:
        raise ValueError(f"a tool call's arguments go under 'arguments'; it wrote {unknown}")
    return {}


def _json_holdable(call: ToolCall) -> ToolCall:
    """The call, if its arguments have a JSON form (the one the history will carry).
    The parsers that read Python literals
    (mlx-lm's pythonic, GLM, Kimi and MiniMax ones, and Qwen3-Coder's dict values here) give
    sets, bytes and complex numbers too: such a value reached the tool, and
    ``ToolCall.arguments_json`` raised when the call went back into the history. Such a call
    is an invalid call, which an agent can show the model and retry. A tuple is JSON's
    array, kept. A number past a float's range (``1e400``, which a schema's unbounded
    ``number`` lets even a constrained model write) reads as ``inf``, as Python's json and
    Pydantic read it, and is kept: the call is what its schema allows (see design.md)."""
    try:
        _ = call.arguments_json
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the arguments hold a value JSON has no form for ({exc})") from None
    return call


def _item_text(item: Any) -> str:
    """One call of a block as JSON text (what the parser made of it), for its InvalidToolCall."""
    try:
        return json.dumps(item, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(item)


def _readable_parts(body: str) -> tuple[Optional[str], str]:
    """The name and the arguments' text of a call body that failed to parse, as OpenAI
    reports an invalid call: where the body is a JSON object, or one cut off (by
    ``max_tokens``), or an XML call with its ``<function=NAME>`` tag; else no name and the
    whole body. Arguments that are not an object stay their JSON text, so a
    stream's consumer (LangChain merges chunks by parsing their arguments) keeps the call
    invalid; cut-off arguments are the text written so far, which LangChain's stream merges
    into a call of that tool with the complete fields, as it does OpenAI's."""
    try:
        item = json.loads(body)
    except (ValueError, RecursionError):  # nested past Python's limit: a looping model's "[[[["
        return _cut_parts(body) or (None, body)
    if not isinstance(item, dict):
        return None, body
    name = item.get("name") if isinstance(item.get("name"), str) else None
    key = next((k for k in ARGUMENT_KEYS if k in item), None)
    if key is None:
        return name, body
    args = item[key]
    return name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


_ARGS_HEADER = re.compile(r"([\w-]+)\s*\[ARGS\]\s*")  # Mistral's name[ARGS]{...} (mlx-lm's parser's)
_BLANK = re.compile(r"\s*")


def _cut_parts(body: str) -> Optional[tuple[Optional[str], str]]:
    """(name, arguments' text) of a call that does not parse: an XML call's function tag
    and the parameters after it, or a JSON object cut off (by ``max_tokens``), read key by
    key to where the text ends (no name, or no arguments, where none was written yet).
    None where the JSON is broken rather than cut: its arguments could not be told from the
    rest, and LangChain's stream would merge them into a call with fewer."""
    xml = function_header(body)
    if xml is not None:
        return xml
    header = _ARGS_HEADER.match(body.strip())
    if header:
        rest = body.strip()[header.end():]
        inner = _cut_parts('{"name": "", "arguments": ' + rest) if rest else (None, "")
        return (header.group(1), inner[1]) if inner is not None else None
    text = body.strip()
    if not text.startswith("{"):
        return None
    decoder, at, name, args = json.JSONDecoder(), 1, None, ""
    try:
        while text[(at := _BLANK.match(text, at).end()):at + 1] == '"':
            key, at = json.decoder.scanstring(text, at + 1)
            at = _BLANK.match(text, at).end()
            if text[at:at + 1] != ":":
                break
            at = _BLANK.match(text, at + 1).end()
            try:
                value, end = decoder.raw_decode(text, at)
            except RecursionError:  # a looping model's "[[[[", cut at the budget
                at, args = len(text), (text[at:] if key == "arguments" else args)
                break
            except json.JSONDecodeError as exc:
                if not _cut_at_end(exc, text):
                    return None
                at, args = len(text), (text[at:] if key == "arguments" else args)
                break
            except ValueError:  # not JSON's own error: an integer past Python's 4300 digits
                return None
            if key == "name" and isinstance(value, str):
                name = value
            elif key == "arguments":
                args = value if isinstance(value, str) else text[at:end]
            at = _BLANK.match(text, end).end()
            if text[at:at + 1] != ",":
                break
            at += 1
    except json.JSONDecodeError as exc:  # a key's string
        if not _cut_at_end(exc, text):
            return None
        at = len(text)
    except ValueError:
        return None
    return (name, args) if at >= len(text) else None


def _first_call(body: str) -> Optional[tuple[str, int]]:
    """The first call of a block in a format without an end marker, once whole: that call
    alone as a block its parser reads (``[{...}]``, ``{...}`` or ``name[ARGS]{...}``), and
    where it ends in ``body``; None while it is being written. Whole means its object
    closed: nothing after a ``}`` can change it."""
    at = _BLANK.match(body).end()
    listed = body[at:at + 1] == "["
    if listed:
        at = _BLANK.match(body, at + 1).end()
    elif body[at:at + 1] != "{":
        header = _ARGS_HEADER.match(body, at)
        if header is None:
            return None
        at = header.end()
    if body[at:at + 1] != "{":
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(body, at)
    except (ValueError, RecursionError):  # not closed yet (or broken: read at the end as before)
        return None
    return body[:end] + ("]" if listed else ""), end


def _list_items(body: str) -> Optional[tuple[list, str]]:
    """The whole items of a JSON list of calls, and the text of the item it was cut off in
    (Mistral's ``[{...}, {...`` at max_tokens; "" where the list is whole or the cut fell
    between items); None where the text is no such list (not one, or broken)."""
    text = body.strip()
    if not text.startswith("["):
        return None
    decoder, at, items = json.JSONDecoder(), 1, []
    while True:
        at = _BLANK.match(text, at).end()
        try:
            item, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            return (items, text[at:]) if _cut_at_end(exc, text) else None
        except (ValueError, RecursionError):  # a 4300-digit integer; a looping "[[[["
            return None
        items.append(item)
        at = _BLANK.match(text, end).end()
        if at == len(text) or text[at:] == "]":
            return items, ""
        if text[at] != ",":
            return None
        at += 1


def _cut_at_end(exc: json.JSONDecodeError, text: str) -> bool:
    """The JSON failed because the text ran out (a cut), not because it is malformed: at
    its end, in an open string, or in a literal, a number or an escape still being written
    (``tru``, ``-``, ``1.``, ``\\u00``)."""
    rest = text[exc.pos:].rstrip()
    if not rest or exc.msg.startswith("Unterminated string"):
        return True
    if exc.msg == "Expecting value" and any(word.startswith(rest) for word in ("true", "false", "null", "-")):
        return True
    if exc.msg.startswith("Invalid \\uXXXX escape") and re.fullmatch(r"\\?u[0-9a-fA-F]{0,3}", rest):
        return True
    return text[exc.pos - 1:exc.pos].isdigit() and re.fullmatch(r"(\.[0-9]*)?([eE][+-]?[0-9]*)?", rest) is not None
