"""Prefixes that rows in prefill are about to store in the prefix cache. Owner thread only.

Requests that arrive together with one system prompt would each prefill it beside the
others, all missing the cache. A row in prefill *claims* each prefix it will snapshot; a
request that shares a claimed prefix waits in the queue until the claim is given back (the
snapshot stored, refused by the budget, or the row gone), then starts from the cache.

A request waits only for claims older than its first wait. Where the budget refuses the
snapshot, the waiters start together (and none claims it again: the prefix cache now knows it
would refuse it, ``PrefixCache.would_refuse``); without that rule each waited for the one
before it, one request at a time. A younger claim on a
prefix longer than any the request waited for is waited for too: requests that waited for
one's system prompt, where the first of them to start claims the few-shot examples they
all hold, wait for those as well (each such wait is for a longer prefix, so they end).
"""

from __future__ import annotations

from typing import Iterable, Optional

Claim = tuple[tuple[int, ...], int]  # (the prefix's tokens, the claim's serial number)


class PrefillClaims:
    def __init__(self):
        self._live: dict[tuple[int, ...], set[int]] = {}
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

    def held(self, tokens: Iterable[int]) -> bool:
        """Is any claim on exactly these tokens live?"""
        return bool(self._live.get(tuple(tokens)))

    def held_since(self, tokens: Iterable[int], serial: int) -> bool:
        """Is a claim on exactly these tokens, made no later than claim ``serial``, live?"""
        live = self._live.get(tuple(tokens))
        return bool(live) and min(live) <= serial

    def clear(self) -> None:
        self._live.clear()
