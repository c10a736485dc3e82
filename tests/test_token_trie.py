"""TokenTrie against a brute-force reference: random stores, removals and lookups."""

from __future__ import annotations

import random

import pytest

from mlx_tandem.token_trie import TokenTrie


class _Value:
    def __init__(self, tokens):
        self.tokens = tuple(tokens)


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("ranked", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_lookups_match_a_brute_force_reference(seed, ranked):
    """Ranked (here by length), the value a lookup may extend to is the nearest one, as
    mlx-lm's PromptTrie gave it; the prefix cache ranks entries that can be trimmed first."""
    rng = random.Random(seed)
    trie, stored = TokenTrie(rank=(lambda v: len(v.tokens)) if ranked else None), {}

    def sequence():
        base = list(rng.choice(list(stored))) if stored and rng.random() < 0.7 else []
        cut = rng.randrange(len(base) + 1) if base else 0
        return tuple(base[:cut] + [rng.randrange(4) for _ in range(rng.randrange(1, 8))])

    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            tokens = sequence()
            stored[tokens] = _Value(tokens)
            trie.add(tokens, stored[tokens])
        elif op < 0.65 and stored:
            tokens = rng.choice(list(stored))
            assert trie.pop(tokens) is stored.pop(tokens)
        elif op < 0.72 and stored:
            tokens = rng.choice(list(stored)) + (rng.randrange(4),)
            popped = trie.pop_prefixes(tokens)
            expected = [stored.pop(k) for k in sorted(stored, key=len) if len(k) < len(tokens) and tokens[:len(k)] == k]
            assert sorted(map(id, popped)) == sorted(map(id, expected))
        query = sequence()
        match = trie.search(query)
        common = max((_lcp(query, k) for k in stored), default=0)
        assert match.common_prefix == trie.common_prefix(query) == common
        assert match.exact is stored.get(query)
        if match.exact is None:
            prefixes = [k for k in stored if 0 < len(k) < len(query) and query[:len(k)] == k]
            longest = max(prefixes, key=len, default=None)
            assert match.shorter is (stored[longest] if longest else None)
            assert match.shorter_length == (len(longest) if longest else 0)
            if common:
                assert match.longer is not None and match.longer.tokens[:common] == query[:common]
                assert stored.get(match.longer.tokens) is match.longer  # a live value
                if ranked:
                    nearest = min(len(k) for k in stored if k[:common] == query[:common])
                    assert len(match.longer.tokens) == nearest
            else:
                assert match.longer is None
        assert bool(trie) == bool(stored)
    for tokens in list(stored):
        trie.pop(tokens)
    assert trie._root == {}  # nothing left behind


@pytest.mark.parametrize("seed", range(4))
def test_prefixes_shared_with_queued_prompts_match_a_brute_force_reference(seed):
    """``common_prefix_length`` (slice compares), ``shared_with_waiting`` (the usable
    prefixes shared with queued prompts, each leaving a token to feed) and ``spaced``."""
    from mlx_tandem.lanes.claims import shared_with_waiting, spaced
    from mlx_tandem.token_trie import common_prefix_length

    rng = random.Random(seed)
    base = [rng.randrange(3) for _ in range(60)]
    for _ in range(300):
        a = tuple(base[: rng.randrange(61)] + [rng.randrange(3) for _ in range(rng.randrange(5))])
        others = [tuple(base[: rng.randrange(61)] + [rng.randrange(3) for _ in range(rng.randrange(5))])
                  for _ in range(rng.randrange(4))]
        assert all(common_prefix_length(a, o) == _lcp(a, o) == common_prefix_length(list(a), o) for o in others)
        floor = rng.randrange(40)
        usable = [min(_lcp(a, o), len(a) - 1, len(o) - 1) for o in others]
        assert shared_with_waiting(a, others, lambda n: n >= floor) == sorted({n for n in usable if n >= floor})
        gap = rng.randrange(1, 9)
        kept = spaced(usable, gap)
        assert kept == sorted(kept) and set(kept) <= set(usable)
        assert all(b - a >= gap for a, b in zip(kept, kept[1:]))
        assert all(any(0 <= n - k < gap for k in kept) for n in usable)  # each left out is near a kept one
