"""PrefixCache: snapshots of prompt caches keyed by their tokens, reused by later prompts.

Owner thread only. Works for hybrid models: attention KV can be trimmed to a shorter common
prefix, recurrent state (``ArraysCache``) cannot, so an entry serves a prompt only when its
tokens are a prefix of the prompt, unless every layer of the entry is trimmable. That is why
the text lane snapshots at boundaries (end of the system prompt, end of the previous turn)
instead of only at the end of a request.

Entries own their memory: a row's extracted cache is a slice of the batch's buffers, and
``copy.deepcopy`` of an ``mx.array`` shares its buffer, so a deep-copied row kept the whole
batch's buffers alive while the budget counted the row (measured: 14.3 GB of active MLX
memory under a 1 GiB budget after 300 requests at batch 32). ``_owned_copy`` copies every
array into a buffer of its own size and evaluates it at once, and the budget counts what the
copies hold. A live request never sees, or changes, a stored snapshot: MLX arrays are
immutable, and a fetched copy gets its own cache objects.

Lookup uses ``TokenTrie`` (token_trie.py: mlx-lm's ``PromptTrie`` lookups grew with the square
of long entries); eviction is ours: least recently used first, within a priority of kinds
(``KINDS``: ``final`` answers, then ``turn`` checkpoints, ``shared`` and ``history``
prefixes, then ``system`` prompts), under a byte budget.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, can_trim_prompt_cache, trim_prompt_cache

from .token_trie import TokenTrie

logger = logging.getLogger(__name__)

#: Entry kinds, evicted first to last. A "history" point is made only once a second
#: request held it (prompt.py), so it outlives a "turn" checkpoint, which one next turn reads;
#: a "shared" one where a prompt stops sharing a stored entry's tokens (shared_point).
KINDS = ("final", "turn", "shared", "history", "system")


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: list[Any]
    nbytes: int
    kind: str
    trimmable: bool
    answer_start: Optional[int] = None  # a final entry's prompt length: its answer follows


class PrefixCache:
    def __init__(self, budget_bytes: int, *, min_tokens: int = 1):
        self.budget_bytes = int(budget_bytes)
        self.min_tokens = max(1, int(min_tokens))
        # The entry a lookup may trim back: one that can be trimmed, then the nearest (mlx-lm's).
        self._trie = TokenTrie(rank=lambda e: (not e.trimmable, len(e.tokens)))
        self._lru: dict[str, OrderedDict[tuple[int, ...], _Entry]] = {k: OrderedDict() for k in KINDS}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0
        self.stored = 0
        self.evicted = 0  # dropped for room
        self.superseded = 0  # dropped because a longer entry that can be cut back serves them
        self.hits_by_kind = {k: 0 for k in KINDS}
        self.last_lookup: tuple[int, Optional[str]] = (0, None)  # (tokens reused, entry kind or None)
        self.prefill_waits = 0  # requests that waited for a row in prefill to store their prefix
        self.refused = 0  # snapshots the budget had no room for
        # (tokens, least bytes) of refused snapshots, none dominated by another: any later
        # snapshot of at least that many tokens holds at least that many bytes (_least_nbytes).
        self._refusals: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return sum(len(d) for d in self._lru.values())

    # ------------------------------------------------------------------ lookup
    def fetch(self, tokens: Sequence[int]) -> tuple[Optional[list[Any]], int]:
        """A private copy of the longest usable cached prefix of ``tokens`` and its length.

        At most ``len(tokens) - 1`` tokens are reused: the model must still be fed at least
        one token to produce the first logits. Returns (None, 0) on a miss. What it counted
        is ``last_lookup``, for ``uncount``.
        """
        found = self._usable(tokens)
        if found is None:
            self.misses += 1
            self.last_lookup = (0, None)
            return None, 0
        entry, n = found
        cache = copy.deepcopy(entry.cache)
        if n < len(entry.tokens):
            trim_prompt_cache(cache, len(entry.tokens) - n)
            for c in cache:  # state that belongs to the trimmed-off position (MTP's pending)
                if getattr(c, "pending", None) is not None:
                    c.pending = None
        self._touch(entry)
        self.hits += 1
        self.hit_tokens += n
        self.hits_by_kind[entry.kind] += 1
        self.last_lookup = (n, entry.kind)
        return cache, n

    def uncount(self, lookup: tuple[int, Optional[str]]) -> None:
        """Take back a fetch's counts (``last_lookup``): its request was taken back and
        looks up again, and only the lookup it starts from counts."""
        n, kind = lookup
        if kind is None:
            self.misses -= 1
            return
        self.hits -= 1
        self.hit_tokens -= n
        self.hits_by_kind[kind] -= 1

    def cached_length(self, tokens: Sequence[int]) -> int:
        """How many tokens of ``tokens`` a fetch would reuse now (no copy, not counted)."""
        found = self._usable(tokens)
        return found[1] if found is not None else 0

    def _usable(self, tokens: Sequence[int]) -> Optional[tuple[_Entry, int]]:
        """The entry a fetch of ``tokens`` would use and its length, leaving one token to feed."""
        tokens = list(tokens)
        return self._find(tokens[:-1]) if len(tokens) > 1 else None

    def _find(self, tokens: list[int]) -> Optional[tuple[_Entry, int]]:
        if not tokens:
            return None
        res = self._trie.search(tokens)
        if res.exact is not None:
            return res.exact, len(tokens)
        best = None
        if res.shorter is not None and res.shorter_length >= self.min_tokens:
            best = (res.shorter, res.shorter_length)
        if res.longer is not None and res.common_prefix >= self.min_tokens:
            if res.longer.trimmable and res.common_prefix > (best[1] if best else 0):
                best = (res.longer, res.common_prefix)
        return best

    def _get(self, tokens: list[int]) -> _Entry:
        return self._trie.get(tokens)

    def _touch(self, entry: _Entry) -> None:
        self._lru[entry.kind].move_to_end(entry.tokens)

    def shared_point(self, tokens: Sequence[int], start: int) -> Optional[int]:
        """Where ``tokens`` stops sharing the tokens of a stored entry, if that is at least
        ``min_tokens`` past ``start`` (what a fetch reuses) and leaves a token to feed.

        Recurrent state cannot be cut back, so a hybrid model's entry serves only prompts
        it is a whole prefix of: questions about one document written in one message (a
        RAG template) reused none of it. A snapshot where a second prompt parts from the
        first lets the next ones start there. An entry that can be trimmed (attention
        only) already serves the shared part, so ``start`` is there and no point is made.
        """
        tokens = list(tokens)[:-1]
        res = self._trie.search(tokens) if tokens else None
        shared = 0 if res is None else res.common_prefix
        if shared - start < self.min_tokens or shared < self.min_tokens:
            return None
        if res.exact is None and res.longer is not None:
            answer_start = res.longer.answer_start
            if answer_start is not None and shared > answer_start:
                # The prompt parts from a stored answer inside it: a conversation sent back
                # an answer changed (a stop string cut, a call re-rendered). Its own turn
                # point serves its next turn; a snapshot here was read by nobody (a review:
                # one a turn, pushing out the turn entries).
                return None
        return shared

    def contains(self, tokens: Sequence[int]) -> bool:
        """Is there an entry for exactly these tokens?"""
        try:
            self._get([int(t) for t in tokens])
        except KeyError:
            return False
        return True

    # ------------------------------------------------------------------ insertion
    def store(self, tokens: Sequence[int], cache: list[Any], kind: str, *,
              answer_start: Optional[int] = None) -> bool:
        """Keep an independent copy of ``cache`` (the state after ``tokens``; for a final
        entry, its answer from ``answer_start`` on). False if skipped."""
        if kind not in KINDS:
            raise ValueError(f"unknown prefix cache kind {kind!r}")
        tokens = tuple(int(t) for t in tokens)
        if len(tokens) < self.min_tokens or not cache:
            return False
        try:
            prev = self._get(list(tokens))
        except KeyError:
            prev = None
        if prev is not None:
            # Same tokens, same state: keep the old copy, but a more durable kind wins.
            if KINDS.index(kind) > KINDS.index(prev.kind):
                del self._lru[prev.kind][tokens]
                prev.kind = kind
                self._lru[kind][tokens] = prev
            self._touch(prev)
            return False
        # Room is made from entries of this kind or a less durable one: a final answer's
        # entry pushed system prompts out (the new entry was exempt from eviction).
        rank = KINDS.index(kind)
        if self._durable_bytes(kind) + _cache_nbytes(cache) > self.budget_bytes:
            self._refuse(len(tokens), _least_nbytes(cache))
            return False
        owned, nbytes = _owned_copy(cache)
        entry = _Entry(tokens, owned, nbytes, kind, can_trim_prompt_cache(cache), answer_start)
        self._trie.add(tokens, entry)
        self._lru[kind][tokens] = entry
        self.nbytes += nbytes
        self.stored += 1
        if entry.trimmable:
            # A trimmable entry serves every prefix of itself, so shorter copies are waste,
            # except those of a more durable kind: they must outlive this entry.
            for old in self._trie.pop_prefixes(tokens):
                if KINDS.index(old.kind) > rank:
                    self._trie.add(old.tokens, old)
                else:
                    self._forget(old)
                    self.superseded += 1
        self._evict_to(self.budget_bytes, keep=entry)
        return True

    def would_refuse(self, n_tokens: int, kind: str) -> bool:
        """Would the budget surely refuse a snapshot of ``n_tokens`` tokens of this kind?

        Known from earlier refusals only, never a guess: a refused snapshot of no more tokens
        showed that any such snapshot holds more than the room there is (``_least_nbytes``).
        The text lane then neither cuts the prefill at that point nor has other requests wait
        for a snapshot that cannot be kept.
        """
        room = self.budget_bytes - self._durable_bytes(kind)
        return any(n <= n_tokens and nbytes > room for n, nbytes in self._refusals)

    def learn_floor(self, held_bytes: Callable[[int], int]) -> None:
        """Know from the start which snapshots no room could keep: ``held_bytes(n)`` is what
        every snapshot of ``n`` tokens holds at least (the model's cache footprint,
        memory.py). Without it the first requests learned it from a refusal: they cut
        their prefill there and waited for a snapshot that was then refused."""
        most = 1 << 40
        if held_bytes(most) <= self.budget_bytes:
            return
        lo, hi = self.min_tokens, most  # the fewest tokens whose snapshot passes the budget
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if held_bytes(mid) > self.budget_bytes else (mid + 1, hi)
        self._refusals.append((lo, held_bytes(lo)))  # known, not refused: not counted

    def _durable_bytes(self, kind: str) -> int:
        """Bytes held by entries more durable than ``kind``: a new entry cannot evict them."""
        return sum(e.nbytes for k in KINDS[KINDS.index(kind) + 1:] for e in self._lru[k].values())

    def _refuse(self, n_tokens: int, nbytes: int) -> None:
        self.refused += 1
        if any(n <= n_tokens and b >= nbytes for n, b in self._refusals):
            return  # already implied
        self._refusals = [(n, b) for n, b in self._refusals if not (n >= n_tokens and b <= nbytes)]
        self._refusals.append((n_tokens, nbytes))

    def _forget(self, entry: _Entry) -> None:
        self._lru[entry.kind].pop(entry.tokens, None)
        self.nbytes -= entry.nbytes

    def _evict_to(self, budget: int, keep: Optional[_Entry] = None) -> None:
        while self.nbytes > budget:
            victim = next((e for k in KINDS for e in self._lru[k].values() if e is not keep), None)
            if victim is None:
                return
            self._trie.pop(victim.tokens)
            self._forget(victim)
            self.evicted += 1

    def clear(self) -> None:
        self._evict_to(0)

    def snapshot(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_tokens": self.hit_tokens,
            "hits_by_kind": dict(self.hits_by_kind),
            "stored": self.stored,
            "evicted": self.evicted,
            "superseded": self.superseded,
            "prefill_waits": self.prefill_waits,
            "refused": self.refused,
            "entries": len(self),
            "bytes": self.nbytes,
            "budget_bytes": self.budget_bytes,
        }


def _fresh_buffer(x: mx.array) -> mx.array:
    """``x`` in a buffer of its own. ``mx.contiguous`` returns a row slice of a parent of at
    most 16 KiB as a view into the parent (mlx 0.32), so an entry cut from a small batched
    state (conv states, MTP pending rows) kept the whole batch's buffer uncounted; an
    elementwise identity always writes a new buffer."""
    if x.dtype == mx.bool_:
        return mx.logical_and(x, True)
    return x * mx.array(1, dtype=x.dtype)


def _owned_copy(cache: list[Any]) -> tuple[list[Any], int]:
    """``cache`` deep-copied with every array in a buffer of its own, evaluated; and the bytes
    those buffers hold. Each array is copied out of its parent (``copy.deepcopy`` and
    ``mx.array(x)`` share it); evaluating now lets the parent go, where a pending copy
    would keep it alive until first use. Arrays are found in the caches' attributes, through
    lists, tuples, dicts and nested cache objects (mlx-lm's ``CacheList``)."""
    arrays = []

    def own(x):
        if isinstance(x, mx.array):
            arrays.append(_fresh_buffer(x))
            return arrays[-1]
        if hasattr(x, "__dict__") and not isinstance(x, type):
            for name, value in vars(x).items():
                setattr(x, name, tree_map(own, value))
        return x

    owned = [own(_fitted(c)) for c in copy.deepcopy(cache)]
    mx.eval(arrays)
    return owned, sum(a.nbytes for a in arrays)


def _cache_nbytes(cache: list[Any]) -> int:
    """The bytes ``_owned_copy`` would hold for ``cache``, without copying anything."""
    seen: list[int] = []

    def count(x):
        if isinstance(x, mx.array):
            seen.append(x.nbytes)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            for value in vars(x).values():
                tree_map(count, value)
        return x

    for c in cache:
        count(_fitted(c))
    return sum(seen)


def _least_nbytes(cache: list[Any]) -> int:
    """Bytes that every snapshot of this model holding at least these tokens holds too.

    Each attention layer's keys and values for the tokens it holds (at most its window for
    a sliding one), and recurrent state (a fixed size per model). Not the buffers' spare or
    rotated slots: those depend on how the prompt was cut into chunks, not on its tokens
    (an audit: a sliding-window model's 253-token snapshot held 130 KB, a 289-token one
    78 KB), so a refusal recorded with the plain byte count wrongly barred longer
    snapshots that fit. Layers of unknown layout count nothing.
    """
    total = 0
    for c in cache:
        if isinstance(c, CacheList):
            total += _least_nbytes(c.caches)
        elif isinstance(c, ArraysCache):
            total += sum(a.nbytes for a in c.cache if isinstance(a, mx.array))
        else:
            keys, values, held = getattr(c, "keys", None), getattr(c, "values", None), getattr(c, "offset", None)
            if isinstance(keys, mx.array) and isinstance(values, mx.array) and isinstance(held, int) \
                    and keys.ndim == 4 and keys.shape[2] > 0:
                window = getattr(c, "max_size", None)
                held = min(held, window) if isinstance(window, int) else held
                total += (keys.nbytes + values.nbytes) // keys.shape[2] * min(held, keys.shape[2])
    return total


def _fitted(c: Any) -> Any:
    """A plain KVCache without the spare slots of its buffer (it grows in 256-slot steps):
    SpecPrefill's draft snapshots its live cache, and kept 768 slots for 573 tokens.
    Caches cut from a batch (``extract``) hold their tokens exactly already."""
    if type(c) is KVCache and c.keys is not None and c.keys.shape[2] > c.offset:
        fitted = KVCache()
        n = c.offset
        fitted.keys, fitted.values, fitted.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        return fitted
    return c
