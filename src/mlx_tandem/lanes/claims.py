"""Prefixes that rows in prefill are about to store in the prefix cache. Owner thread only.

Requests that arrive together with one system prompt would each prefill it beside the
others, all missing the cache. A row in prefill *claims* each prefix it will snapshot; a
request that shares a claimed prefix waits in the queue until the claim is given back (the
snapshot stored, refused by the budget, or the row gone), then starts from the cache.

A request waits for a claim on any prefix of its prompt (``longest_prefix_of``), only for
claims older than its first wait. Where the budget refuses the snapshot, the waiters start
together (and none claims it again: the prefix cache now knows it would refuse it,
``PrefixCache.would_refuse``); without that rule each waited for the one before it, one
request at a time. A younger claim on a prefix longer than any the request waited for is
waited for too: requests that waited for one's system prompt, where the first of them to
start claims the few-shot examples (or the document) they all hold, wait for those as well
(each such wait is for a longer prefix, so they end). So is a younger claim on a prefix
whose claim was given back after the request began to wait, its row gone before storing
(cancelled, failed): the first waiter to start claims it again and the others wait for it.
Before (an audit), five requests waiting on a cancelled row each prefilled its 3.9K-token
document. Each such wait needs another row gone, so they end too; a refused prefix is
never claimed again, so its waiters still go on together.

``PromptsInPrefill`` keeps the prompts of rows in prefill, where a request that arrives
with them finds what it shares with them before any is stored (a "shared" point);
``shared_with_waiting`` finds what it shares with requests still queued behind it, so the
first of a burst about one document already stores the document (and the others wait).
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable, Sequence

from ..token_trie import TokenTrie, common_prefix_length

Claim = tuple[tuple[int, ...], int]  # (the prefix's tokens, the claim's serial number)


#: Prefixes whose last claim was given back, remembered for a replacement claim.
MAX_RELEASED = 256


class PrefillClaims:
    def __init__(self):
        self._live: dict[tuple[int, ...], set[int]] = {}
        # Prefix -> the serial when its last live claim was given back (latest last).
        self._released: dict[tuple[int, ...], int] = {}
        self.serial = 0  # of the latest claim

    def __bool__(self) -> bool:
        return bool(self._live)

    def __len__(self) -> int:
        return sum(map(len, self._live.values()))

    def take(self, tokens: Iterable[int]) -> Claim:
        self.serial += 1
        key = tuple(tokens)
        self._live.setdefault(key, set()).add(self.serial)
        return key, self.serial

    def give_back(self, claims: Iterable[Claim]) -> None:
        for key, serial in claims:
            live = self._live.get(key)
            if live is not None:
                live.discard(serial)
                if not live:
                    del self._live[key]
                    self._released.pop(key, None)
                    self._released[key] = self.serial
                    if len(self._released) > MAX_RELEASED:
                        del self._released[next(iter(self._released))]

    def longest_prefix_of(self, prompt: tuple[int, ...], *, since: int, beyond: int) -> int:
        """The longest live claim on a prefix of ``prompt``: made no later than claim
        ``since``, longer than ``beyond`` tokens, or replacing one given back since then.
        Any row's claim counts, not only on the request's own cache points: a "shared"
        point another request found (a document in one message) or an earlier turn of its
        conversation is a prefix too."""
        n = len(prompt)
        return max((len(key) for key, live in self._live.items()
                    if len(key) < n and (min(live) <= since or len(key) > beyond
                                         or self._released.get(key, -1) >= since) and prompt[:len(key)] == key),
                   default=0)

    def clear(self) -> None:
        self._live.clear()
        self._released.clear()


class PromptsInPrefill:
    """The prompts of rows still in prefill, for the longest prefix a new prompt shares with
    one of them: requests that arrive together with one document in one message find no
    stored entry to share it with, but the rows beside them hold it."""

    def __init__(self):
        self._trie = TokenTrie()
        self._by_uid: dict[int, list[int]] = {}

    def add(self, uid: int, prompt: Sequence[int]) -> None:
        tokens = self._by_uid[uid] = list(prompt)
        try:
            self._trie.get(tokens).append(uid)  # an identical prompt is in prefill too
        except KeyError:
            self._trie.add(tokens, [uid])

    def discard(self, uid: int) -> None:
        tokens = self._by_uid.pop(uid, None)
        if tokens is None:
            return
        uids = self._trie.get(tokens)
        uids.remove(uid)
        if not uids:
            self._trie.pop(tokens)

    def shared_length(self, prompt: Sequence[int]) -> int:
        return self._trie.common_prefix(prompt)

    def sharing(self, prompt: Sequence[int]) -> tuple[int, list[int]]:
        """The longest prefix of ``prompt`` a row in prefill shares, and the rows (uids)
        whose prompt holds it (one prompt's rows)."""
        match = self._trie.search(prompt)
        uids = match.exact if match.exact is not None else match.longer
        return match.common_prefix, list(uids or [])

    def clear(self) -> None:
        self._trie.clear()
        self._by_uid.clear()


def shared_with_waiting(prompt: Sequence[int], others: Iterable[Sequence[int]], usable: Callable[[int], bool],
                        *, limit: int = 64) -> list[int]:
    """The usable prefixes ``prompt`` shares with ``others`` (the prompts of requests queued
    behind it; the first ``limit``), shortest first, each leaving a token to feed. Every
    prompt that shares a longer one shares the shorter ones too."""
    lengths = (min(common_prefix_length(prompt, other), len(prompt) - 1, len(other) - 1)
               for other in islice(others, limit))
    return sorted(set(filter(usable, lengths)))


def spaced(points: Iterable[int], gap: int) -> list[int]:
    """``points`` in order, less each one within ``gap`` of the one kept before it (two
    snapshots a few tokens apart hold nearly the same; the shorter serves more prompts)."""
    kept: list[int] = []
    for p in sorted(set(points)):
        if not kept or p - kept[-1] >= gap:
            kept.append(p)
    return kept
