"""Per-position processing in a speculative step: each drafted and verified position of a
drafting row processed as a plain step there would process it. Owner thread only.

- ``GrammarWalk``: a row held to a grammar takes x and the drafts in turn, each position
  masked by the call a plain step would make there, and goes back to where verification
  stopped.
- ``PenaltyWalk``: a row's penalties (pure functions of the token context) applied at each
  position with the context a plain step there would hold.

A token ban and a logit bias need no walk: they change every position alike (batch.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from .batch import RowSpec


class GrammarWalk:
    """One speculative step's walk of the drafting rows held to a grammar (``RowSpec.grammar``).

    Position j (the token after x and the first j drafts) is masked as a plain step would
    mask it: the grammar takes x and those drafts, then makes that position's mask call.
    The same mask holds the head's draft there (so it drafts what the grammar allows) and
    the verified logits. A draft the grammar refuses, or an EOS, ends the row's walk: the
    verification accepts nothing after it. ``settle`` takes each grammar back to the
    position verification accepted up to. Each position costs a host sync of the drafts
    (the masks depend on them); the rows' walks run on the host, in turn.
    """

    def __init__(self, rows: list[RowSpec], idx: list[int], x: mx.array, k: int, contexts):
        self.rows, self.idx, self.k = rows, idx, k
        self.alive = {i: True for i in idx}
        self.states: dict[int, list] = {i: [] for i in idx}
        # Per position: the mask, or None where the grammar leaves it free (a lazy call
        # grammar's text between calls).
        self.masks: dict[int, list[Optional[np.ndarray]]] = {i: [] for i in idx}
        self._xs = x.tolist()
        self._contexts = contexts

    @classmethod
    def of(cls, rows: list[RowSpec], drafting: list[bool], x: mx.array, k: int, contexts):
        idx = [i for i, (r, d) in enumerate(zip(rows, drafting)) if d and r.grammar is not None]
        return cls(rows, idx, x, k, contexts) if idx else None

    def advance(self, position: int, last: mx.array | None) -> None:
        """The mask of ``position`` for every live row (taking the draft before it first)."""
        ds = last.tolist() if last is not None else None
        for i in self.idx:
            if not self.alive[i]:
                continue
            g = self.rows[i].grammar
            try:
                if position == 0:
                    g.walk_start(self._contexts[i]._size)  # mlx-lm 0.32 TokenBuffer's length
                    g.walk_take(self._xs[i])  # the pending token, sampled at the last call
                else:
                    d, last = ds[i], self.masks[i][-1]
                    allowed = last is None or last[d]
                    if not allowed or d in g.eos or not g.takes(d):
                        # Refused (never accepted: p = 0), or the row ends at this EOS if it
                        # is accepted; a token the mask allowed but the matcher refuses is
                        # masked after all.
                        if allowed and d not in g.eos:
                            if last is None:
                                last = self.masks[i][-1] = np.ones(self._vocab, dtype=bool)
                            last[d] = False
                        self.alive[i] = False
                        continue
                    g.walk_take(d)
                self.masks[i].append(g.walk_allowed(self._vocab))
                self.states[i].append(g.state())
            except Exception as exc:  # noqa: BLE001 - this request fails after the step, alone
                self.rows[i].on_error(exc)
                self.alive[i] = False
                self.states[i] = None

    def mask(self, logits: mx.array, position: int, last: mx.array | None) -> mx.array:
        """(B, V) draft logits at ``position``, the grammar rows masked."""
        self._vocab = logits.shape[-1]
        self.advance(position, last)
        rows = [i for i in self.idx if self.states[i] is not None and len(self.masks[i]) > position
                and self.masks[i][position] is not None]
        if not rows:
            return logits
        sel = mx.array(rows)
        keep = mx.array(np.stack([self.masks[i][position] for i in rows]))
        logits[sel] = mx.where(keep, logits[sel], mx.array(-float("inf"), dtype=logits.dtype))
        return logits

    def mask_all(self, logits: mx.array) -> mx.array:
        """(B, k+1, V) verify logits, the grammar rows masked at every position walked
        (positions past a row's walk are never accepted)."""
        rows = [i for i in self.idx if self.states[i] is not None]
        if not rows:
            return logits
        B, T, V = logits.shape
        keep = np.ones((len(rows), T, V), dtype=bool)
        for n, i in enumerate(rows):
            for j, m in enumerate(self.masks[i]):
                if m is not None:
                    keep[n, j] = m
        sel = mx.array(rows)
        logits[sel] = mx.where(mx.array(keep), logits[sel], mx.array(-float("inf"), dtype=logits.dtype))
        return logits

    def settle(self, blocks: list[list[int]], acc: list[int], contexts) -> None:
        """Each grammar back at the position verification accepted up to (its mask call
        made, the tokens before it taken), and its token context whole, as after that many
        plain steps."""
        for i in self.idx:
            states = self.states[i]
            if not states:
                continue
            # A refused draft is never accepted; past an accepted EOS the row ends there.
            self.rows[i].grammar.restore(states[min(acc[i], len(states) - 1)])
            contexts[i].update_and_fetch(mx.array(blocks[i][: acc[i] + 1], dtype=mx.int32))


class PenaltyWalk:
    """One speculative step's drafting rows whose processors are penalties (``RowSpec.
    penalties``: the repetition penalty, OpenAI's presence and frequency penalties). Each
    is a pure function of the token context, so position j (the token after x and the first
    j drafts) is processed as a plain step would process it, with the context that step
    would hold: the row's tokens, x and those drafts. The drafts are processed alike (a head
    drafting unpenalized tokens would be rejected where the penalty bites). ``settle`` puts
    the accepted tokens in the row's context, as that many plain steps would."""

    def __init__(self, rows: list[RowSpec], idx: list[int], x: mx.array, contexts):
        self.rows, self.idx, self._contexts = rows, idx, contexts
        # The context a plain step feeding x holds (mlx-lm 0.32 TokenBuffer's contents).
        self._base = {i: mx.concatenate([contexts[i]._buffer[: contexts[i]._size], x[i: i + 1].astype(mx.int32)])
                      for i in idx}

    @classmethod
    def of(cls, rows: list[RowSpec], drafting: list[bool], x: mx.array, contexts):
        idx = [i for i, (r, d) in enumerate(zip(rows, drafting)) if d and r.penalties]
        return cls(rows, idx, x, contexts) if idx else None

    def _processed(self, i: int, context: mx.array, logits: mx.array) -> mx.array:
        for p in self.rows[i].penalties:
            logits = p(context, logits)
        return logits

    def draft(self, logits: mx.array, drafts: list[mx.array]) -> mx.array:
        """(B, V) draft logits at position ``len(drafts)``, the penalty rows processed."""
        for i in self.idx:
            context = mx.concatenate([self._base[i], *(d[i: i + 1].astype(mx.int32) for d in drafts)])
            logits[i: i + 1] = self._processed(i, context, logits[i: i + 1])
        return logits

    def verify(self, logits: mx.array, drafts: mx.array) -> mx.array:
        """(B, k+1, V) verify logits, the penalty rows processed at every position."""
        for i in self.idx:
            block = mx.concatenate([self._base[i], drafts[i].astype(mx.int32)])
            size = self._base[i].shape[0]
            logits[i] = mx.concatenate([self._processed(i, block[: size + j], logits[i, j][None])
                                        for j in range(logits.shape[1])])
        return logits

    def settle(self, blocks: list[list[int]], acc: list[int], walked: set) -> None:
        """The accepted tokens (x and the accepted drafts) into each row's context; a row the
        grammar walk also took is settled there (GrammarWalk.settle)."""
        for i in self.idx:
            if i not in walked:
                self._contexts[i].update_and_fetch(mx.array(blocks[i][: acc[i] + 1], dtype=mx.int32))
