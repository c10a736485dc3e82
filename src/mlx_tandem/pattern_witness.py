"""A short string a regular expression accepts, for closing mode to write out.

Closing mode (closing.py) judges a token by what the grammar allows after it. Inside a
string held to an unanchored pattern ("foo", "bar[0-9]": JSON Schema patterns are
unanchored) every letter leaves the allowed set as it was, so the search cannot see that
"f" then "o" then "o" leads to the closing quote, and the answer ended with "length" and
broken JSON. A witness of the pattern, written out whole, gets there in a few tokens.

Parsed with the standard library's own regex parser (``re._parser``, ``sre_parse`` before
Python 3.11): it is private, so any failure to parse or an unknown node gives no witness,
and every witness is checked with ``re.search`` before it is used. JSON Schema patterns
are ECMA-262 and llguidance reads them with its own syntax; where the three disagree the
grammar simply refuses the witness (closing_path rolls it back).
"""

from __future__ import annotations

import re
import string
from typing import Any, Iterable, Optional

try:  # Python 3.11+
    from re import _constants as _c
    from re import _parser as _sre
except ImportError:  # Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _sre  # type: ignore[no-redef]

# Characters tried for a class, in order: plain ones first, never a quote or a backslash
# unless nothing else fits (they cost an escape in a JSON string).
_PREFERRED = "a0A_-. " + string.ascii_letters + string.digits + string.punctuation.replace('"', "").replace(
    "\\", "") + '"\\'
_CATEGORY_CHARS = {
    _c.CATEGORY_DIGIT: "0", _c.CATEGORY_NOT_DIGIT: "a", _c.CATEGORY_SPACE: " ",
    _c.CATEGORY_NOT_SPACE: "a", _c.CATEGORY_WORD: "a", _c.CATEGORY_NOT_WORD: "-",
}
_MAX_LENGTH = 64


class _NoWitness(Exception):
    pass


def shortest_match(pattern: str) -> Optional[str]:
    """A short string that ``pattern`` matches (searched, as JSON Schema patterns are), or None."""
    try:
        tree = _sre.parse(pattern)
        text = _Builder().seq(tree)
    except (_NoWitness, re.error, RecursionError, OverflowError, MemoryError, ValueError, TypeError):
        return None
    if len(text) > _MAX_LENGTH:
        return None
    try:
        return text if re.search(pattern, text) else None
    except (re.error, RecursionError):
        return None


def schema_patterns(schema: Any) -> list[str]:
    """Every ``pattern`` (and ``patternProperties`` key) in a JSON schema, in order, once."""
    found: dict[str, None] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found[node["pattern"]] = None
            if isinstance(node.get("patternProperties"), dict):
                found.update(dict.fromkeys(k for k in node["patternProperties"] if isinstance(k, str)))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return list(found)


def witnesses(patterns: Iterable[str]) -> list[str]:
    """The non-empty witnesses of ``patterns`` (an empty one gets closing mode nowhere)."""
    out = (shortest_match(p) for p in patterns)
    return list(dict.fromkeys(w for w in out if w))


class _Builder:
    """Walks ``re._parser``'s tree: the shortest choice at each node."""

    def __init__(self):
        self.groups: dict[int, str] = {}

    def seq(self, items) -> str:
        out = ""
        for op, av in items:
            out += self.node(op, av)
            if len(out) > _MAX_LENGTH:  # checked as it grows: nested counts multiply
                raise _NoWitness("too long")
        return out

    def node(self, op, av) -> str:
        if op is _c.LITERAL:
            return chr(av)
        if op is _c.NOT_LITERAL:
            return "a" if chr(av) != "a" else "b"
        if op is _c.ANY:
            return "a"
        if op is _c.IN:
            return _class_char(av)
        if op is _c.CATEGORY:
            return _CATEGORY_CHARS[av]
        if op is _c.AT or op in (_c.ASSERT, _c.ASSERT_NOT):
            return ""  # anchors and lookarounds: the final re.search judges
        if op is _c.BRANCH:
            return min((self.seq(branch) for branch in av[1]), key=len)
        if op is _c.SUBPATTERN:
            group, *_, sub = av
            text = self.seq(sub)
            if group is not None:
                self.groups[group] = text
            return text
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
            low, _, sub = av
            text = self.seq(sub) if low else ""
            if len(text) * low > _MAX_LENGTH:
                raise _NoWitness("too long")
            return text * low
        if op is getattr(_c, "ATOMIC_GROUP", None):
            return self.seq(av)
        if op is _c.GROUPREF:
            return self.groups.get(av, "")
        raise _NoWitness(op)


def _class_char(items) -> str:
    negate = bool(items) and items[0][0] is _c.NEGATE
    members = items[1:] if negate else items
    for ch in _PREFERRED:
        if _in(ch, members) != negate:
            return ch
    raise _NoWitness("class")


def _in(ch: str, members) -> bool:
    code = ord(ch)
    for op, av in members:
        if op is _c.LITERAL and code == av:
            return True
        if op is _c.RANGE and av[0] <= code <= av[1]:
            return True
        if op is _c.CATEGORY and re.fullmatch(_CATEGORY_RES[av], ch):
            return True
    return False


_CATEGORY_RES = {
    _c.CATEGORY_DIGIT: r"\d", _c.CATEGORY_NOT_DIGIT: r"\D", _c.CATEGORY_SPACE: r"\s",
    _c.CATEGORY_NOT_SPACE: r"\S", _c.CATEGORY_WORD: r"\w", _c.CATEGORY_NOT_WORD: r"\W",
}
