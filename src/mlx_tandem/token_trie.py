"""TokenTrie: values keyed by token sequences, with the lookups the prefix cache needs.

Why not mlx-lm's ``PromptTrie`` (0.32), which this replaces: its ``search`` looks for a stored
sequence that extends the common prefix depth first, copying the path at every step
(``extra + [tok]``), so a lookup costs the square of the stored tails below the point where
the prompt parts from them. With four 20K-token entries sharing a 1K-token system prompt,
one lookup took 0.6 s on the owner thread, and the lane looks a request up several times
(admission, each admission pass it waits through, its "shared" point). Here every node keeps
one value stored at or below it, so that lookup is a walk of the prompt: linear.

Owner thread only, as the caches that hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

# Node keys besides the token ids (which are >= 0): the node's own value, and one value stored
# at or below it. Values are told apart by identity: store objects, not small ints.
_VALUE, _BELOW = -1, -2
_NONE = object()


@dataclass
class Match:
    """What ``search`` found for a token sequence."""

    exact: Any = None  # the value stored for the whole sequence
    shorter: Any = None  # the value of the longest stored proper prefix of it
    shorter_length: int = 0
    longer: Any = None  # a value stored at or below where the sequence parts from the trie
    common_prefix: int = 0  # how many leading tokens some stored sequence shares with it


class TokenTrie:
    """``rank`` orders the values a node may name as the one below it (the smallest wins);
    without it, the first stored stays."""

    def __init__(self, rank: Optional[Callable[[Any], Any]] = None):
        self._root: dict[int, Any] = {}
        self._rank = rank

    def _better(self, value: Any, than: Any) -> bool:
        return than is _NONE or (self._rank is not None and self._rank(value) < self._rank(than))

    def add(self, tokens: Iterable[int], value: Any) -> None:
        tokens = list(tokens)
        try:
            self.pop(tokens)  # a value replaced: the nodes naming it choose again
        except KeyError:
            pass
        node = self._root
        path = [node]
        for t in tokens:
            node = node.setdefault(t, {})
            path.append(node)
        node[_VALUE] = value
        for n in path:
            if self._better(value, n.get(_BELOW, _NONE)):
                n[_BELOW] = value

    def get(self, tokens: Iterable[int]) -> Any:
        """The value stored for exactly ``tokens``; KeyError if none."""
        node = self._root
        for t in tokens:
            node = node[t]
        return node[_VALUE]

    def pop(self, tokens: Iterable[int]) -> Any:
        """Remove and return the value stored for ``tokens``; KeyError if none."""
        tokens = list(tokens)
        path = [self._root]
        for t in tokens:
            path.append(path[-1][t])
        value = path[-1].pop(_VALUE)
        for i in range(len(tokens), -1, -1):  # deepest first: a parent reads its children
            node = path[i]
            if node.get(_BELOW) is value:
                other = _NONE
                for candidate in [node[_VALUE]] if _VALUE in node else []:
                    other = candidate
                for key, child in node.items():
                    if key >= 0 and self._better(child[_BELOW], other):
                        other = child[_BELOW]
                if other is _NONE:
                    del node[_BELOW]
                else:
                    node[_BELOW] = other
            if i and not node:
                del path[i - 1][tokens[i - 1]]
        return value

    def pop_prefixes(self, tokens: Iterable[int]) -> list[Any]:
        """Remove and return the values stored for proper prefixes of ``tokens``."""
        tokens = list(tokens)
        lengths, node = [], self._root
        for i, t in enumerate(tokens):
            if _VALUE in node:
                lengths.append(i)
            node = node.get(t)
            if node is None:
                break
        return [self.pop(tokens[:i]) for i in lengths]

    def common_prefix(self, tokens: Iterable[int]) -> int:
        """How many leading tokens of ``tokens`` some stored sequence shares."""
        node, n = self._root, 0
        for t in tokens:
            node = node.get(t)
            if node is None:
                break
            n += 1
        return n

    def search(self, tokens: Iterable[int]) -> Match:
        """The exact value, the longest stored proper prefix, and a value stored at or below
        where ``tokens`` parts from the trie (sharing ``common_prefix`` tokens with it)."""
        match, node, n = Match(), self._root, 0
        for t in tokens:
            if _VALUE in node and n:
                match.shorter, match.shorter_length = node[_VALUE], n
            child = node.get(t)
            if child is None:
                break
            node, n = child, n + 1
        else:
            if _VALUE in node:
                match.exact, match.common_prefix = node[_VALUE], n
                return match
        match.common_prefix = n
        if n:
            match.longer = node.get(_BELOW)
        return match

    def __bool__(self) -> bool:
        return _BELOW in self._root

    def clear(self) -> None:
        self._root = {}


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share: slice compares (done in C), not a
    Python loop over tens of thousands of tokens. The window doubles from 64 items until it
    finds a difference (prompts that differ early cost little), then a binary search."""
    if type(a) is not type(b):  # a list never equals a tuple: compare like with like
        a, b = tuple(a), tuple(b)
    lo, end = 0, min(len(a), len(b))
    step = 64
    while lo + step < end and a[lo:lo + step] == b[lo:lo + step]:
        lo, step = lo + step, 2 * step
    hi = min(lo + step, end)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
