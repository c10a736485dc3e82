"""Closing mode: steer a grammar-constrained row to a valid end within its token budget.

Random or weak weights, and any model near its ``max_tokens``, would otherwise leave a JSON
string or object open ("length", broken JSON). ``GrammarProcessor`` masks each step to the
grammar and, near the end of the budget, onto a short completion that ``closing_path``
finds by simulation on a copy of the matcher (see docs/design.md, "Budget").
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import numpy as np

from .errors import ConstraintError
from .token_classes import TokenClasses, allowed_tokens

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
# The longest completion a search walks (each token a consume and a mask, on the engine
# thread, while every other row waits). A search walked up to the whole budget: a schema
# whose smallest answer is thousands of tokens (400 required rows) held every stream for
# seconds at its first token, in proportion to max_tokens (review h157). A completion
# longer than this is far from any end a search could steer to; the row is looked at
# again as its own tokens shorten it. The cost: a row whose completion is still longer
# than this when its budget runs out is not steered: 256 left a tool call of 40 required
# numbers (about 370 tokens) unsteered; 512 closes it, and walks about 0.2 s at most on
# the factory model (a tool call of 80, about 730 tokens, still ends with "length").
_SEARCH_CAP = 512
# A choice of at most this many tokens, one of them markup (a special token such as
# <tool_call>), is judged branch by branch near the end of the budget (GrammarProcessor).
_BRANCH_CHOICES = 4
# Within _STRUCTURE_SLACK of the end, any choice of at most this many tokens: the next key
# or parameter name is spelled in as many first tokens as there are names ("n", "no", "c",
# "code", ...), one of them an optional one that no longer fits.
_SMALL_CHOICES = 24
# Within _SLACK of the end, where a choice not judged takes the whole completion: an enum of
# twenty values begins in about forty first tokens.
_CLOSING_CHOICES = 64
# Choices are judged one by one (as above) only where the completion is at most this long:
# each choice is a search that walks it, and a tool call of 40 required numbers (about 330
# tokens) judged 24 choices a step, 0.7 s a step for 60 steps while every row waited. A
# longer completion is steered and forced whole, as before choices were judged.
_JUDGED_COMPLETION = 64


def closing_path(matcher, tiers: TokenClasses, eos: frozenset[int], limit: int,
                 hints: Sequence[Sequence[int]] = (), long_words: bool = False,
                 text_markup: bool = False) -> Optional[list[int]]:
    """A short completion from the matcher's state (on a copy), or None if over ``limit``.

    ``long_words``: outside free text, content (an enum value, a key, ``true``) goes longest
    token first, which spells it in fewer tokens but loses some ways out that single bytes
    find; ``GrammarProcessor`` tries it only where the budget is tight.

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
    4. a candidate in turn: each step without progress takes the next one, going on
       from where the last such step left off (progress does not restart the round):
       where every candidate leaves the set as it was (free text held to an unanchored
       pattern such as ``[0-9]{3}``), repeating the best one would never reach the
       content that lets the string close.
    In free text, before 3, each of ``hints`` (token ids of a witness of a pattern,
    pattern_witness.py) is tried whole: taken if the grammar takes it and it lets the
    string close (a quote, or EOS, allowed after it and not before). In a string held to
    "foo" no single token shows progress, and turning through candidates never spells it.
    Ending the grammar counts as progress.
    ``text_markup`` (``Constraint.text_markup``: an XML call, whose values are raw text):
    in free text a quote is content, not a way out, and following it wandered (a raw
    value closed 15 tokens later than it could); the hints that end the free text
    (``</parameter>``) are tried first. Elsewhere every hint the grammar takes whole is
    taken first: the hints are markup every completion writes (the end of a value, of the
    call, the opening of a required parameter), and greedy steps wrote every optional
    parameter whose name began like a required one, and a number to its sixteenth digit.
    Judging a candidate costs a consume, a mask and, when it is refused, a rollback, on the
    engine thread: ``_TRY_BUDGET`` bounds the refusals per simulation, then only the best
    closer is judged and step 4 goes on in turn. Tested on fuzzed schemas, formats, patterns and grammars, on the factory and
    the demo tokenizers.
    """
    tier, length, quote_first, awkward, partial = tiers[:5]
    vocab = tier.shape[0]
    closer = tier == 1
    # In free text a special token the grammar allows is markup that ends it (the
    # ``</think>`` before an answer, ``after_reasoning``): a closer. Among the vocabulary's
    # content it was never among the candidates tried, and reasoning ran to "length".
    in_text = np.where(tiers.special, 1, np.where(closer & ~quote_first, 4, tier))
    in_structure = np.where(closer & quote_first, np.where(length > 1, 4, 2), tier)
    lone_quote = quote_first & (length == 1)
    ends = quote_first | (tier == 0)  # what ends a string, or the grammar
    m = matcher.deep_copy()
    path: list[int] = []
    allowed = allowed_tokens(m, vocab, tiers.respelled)
    seen = Counter([allowed.tobytes()])  # visits of each allowed set since the last closer
    budget, same_closes, stuck, turned = _TRY_BUDGET, 0, 0, 0

    def take(tok: int) -> np.ndarray:
        if not m.consume_token(tok):
            raise ValueError(tok)
        return allowed_tokens(m, vocab, tiers.respelled)

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

    def spell(ids: Sequence[int], leave: bool = False, whole: bool = False) -> Optional[np.ndarray]:
        """Take all of ``ids`` if the grammar does and they let the string (or the grammar)
        end where it could not before, or they end the free text themselves (a raw XML
        value and its ``</parameter>``, xml_calls.py); else undo. A witness of one string's
        pattern also fits in other strings (a code's "AA-0000" in an email address) and
        would lengthen them for nothing. ``leave``: only if they end the free text;
        ``whole``: whenever the grammar takes them all (markup every completion writes)."""
        nonlocal budget
        n = m.try_consume_tokens(list(ids))
        if n == len(ids):
            after = allowed_tokens(m, vocab, tiers.respelled)
            # Left the free text: only where it began in free text (in a narrow string or
            # a number few tokens are allowed before and after alike).
            left = m.is_stopped() or (free_text and 2 * int(after.sum()) <= vocab)
            if whole or left or (not leave and (after & ends & ~allowed).any()):
                return after
        m.rollback(n)
        budget -= 1
        return None

    try:
        # Below the limit, so the EOS or token taken next still fits within it.
        while len(path) < limit:
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
                usable = allowed & ~partial
                if stuck < _AWKWARD_AFTER:
                    usable &= ~awkward
            if not usable.any():
                usable = allowed
            longest = (t < 3) | ((t == 4) & (long_words and not free_text))
            score = np.where(usable, t * 100_000 + np.where(longest, -length, length), np.iinfo(np.int64).max)
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
            spelled: Sequence[int] = ()
            if text_markup and budget > 0:  # 0: what ends a raw value, or markup to write
                for ids in hints:
                    if (ids and allowed[ids[0]] and len(path) + len(ids) < limit
                            and (after := spell(ids, leave=True, whole=not free_text)) is not None):
                        *spelled, tok = ids
                        break
            for i in closing if tok is None else ():  # 1
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
            # 3, first: a pattern's witness, wherever the grammar takes its first token: a
            # string held to a narrow pattern ("[a-z]+@...") allows far less than half the
            # vocabulary, so it is not free text, and the witness was never tried there.
            if tok is None and budget > 0:
                for ids in hints:
                    if (ids and allowed[ids[0]] and len(path) + len(ids) < limit
                            and (after := spell(ids)) is not None):  # room to close
                        *spelled, tok = ids
                        break
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
            path.extend(spelled)
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
                 vocab_size: int, hints: Sequence[Sequence[int]] = (), text_markup: bool = False):
        self.matcher = matcher
        self._tiers = tiers
        self._hints = hints
        self._text_markup = text_markup  # Constraint.text_markup
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._max_tokens = int(max_tokens)
        self._vocab = int(vocab_size)
        self._calls = 0
        self._forced: list[int] = []
        self._estimate = 0  # tokens the last simulated completion needed
        self._longest_fit = 0  # the longest completion of a choice judged at the last search
        # The last completion found, kept from the state the row is in now: advanced when the
        # row emits its first token, else (``_path_stale``) to be checked before it is used.
        self._path: Optional[list[int]] = None
        self._path_stale = False
        self._path_set = b""  # the allowed set where that completion was found
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
        self._consumed += 1
        if self._path and self._path[0] == tok and not self._path_stale:
            self._path = self._path[1:] or None  # the row took the completion's next token: still exact
        elif self._path is not None:
            self._path_stale = True

    def _completion(self, allowed: np.ndarray, remaining: int) -> Optional[list[int]]:
        """A completion from here: the last one found, where it still holds, else a search.

        Near the end of the budget a search runs at every token, and one costs milliseconds
        (tens of candidate tokens judged per step of the completion): at max_tokens near a
        schema's smallest answer that halved batch-1 decoding (benchmarks/structured.py).
        The last completion stays exact while the row takes its tokens; after content (a
        token that leaves the allowed set as it was, as inside a string) it is checked
        whole on a copy of the matcher, which costs a consume per token and no masks."""
        path = self._path
        if path is not None and self._path_stale:
            if allowed.tobytes() != self._path_set or len(path) > remaining:
                path = None
            else:
                body = path[:-1] if path and path[-1] in self._eos else path  # EOS ends it
                probe = self.matcher.deep_copy()
                if probe.try_consume_tokens(body) != len(body) or not (probe.is_stopped() or probe.is_accepting()):
                    path = None
        if path is None:
            path = self._search(self.matcher, remaining)
            self._path_set = allowed.tobytes()
        self._path, self._path_stale = path, False
        return path

    def _search(self, matcher, limit: int) -> Optional[list[int]]:
        """``closing_path`` from ``matcher``'s state; where it is tight (the completion will
        be forced, or none fits), also spelled in longer tokens, which can be several
        shorter (an enum value in one token, not three): the shorter of the two."""
        path = closing_path(matcher, self._tiers, self._eos, limit=limit, hints=self._hints,
                            text_markup=self._text_markup)
        if path is None or len(path) >= limit - _SLACK:
            short = closing_path(matcher, self._tiers, self._eos, limit=limit, hints=self._hints, long_words=True,
                                 text_markup=self._text_markup)
            if short is not None and (path is None or len(short) < len(path)):
                path = short
        return path

    def _fitting_branches(self, allowed: np.ndarray, remaining: int, path: Optional[list[int]],
                          capped: bool = False) -> tuple[np.ndarray, Optional[list[int]], bool]:
        """At a choice that a special token opens (a tool call or a document, another call
        or the end), or at any small choice once the budget is within ``_STRUCTURE_SLACK``
        of the completion (a JSON key, an XML call's next ``<parameter=`` or its
        ``</function>``), keep the branches a completion still fits after.

        The greedy search picks one branch without looking ahead, and a call is twice as
        long as a small document: with tools and a JSON response_format, a budget that
        fitted the document ended with "length" in a call the model opened (or that the
        search took); an optional key or parameter opened near the end did the same, at
        eight tokens over the closing length on every seed. A search per choice: judged
        near the end only (sooner, it tripled the grammar's cost per token in
        benchmarks/structured.py). ``capped``: the row's own completion is longer than
        ``_SEARCH_CAP``, so not near the end: only a special token's choice is judged, as
        where the completion is longer than ``_JUDGED_COMPLETION``.

        The third value: whether every choice kept is known to leave a completion that
        fits (judged, or the one choice there is, on the completion found)."""
        n = min(allowed.shape[0], self._tiers.special.shape[0])
        choices = np.flatnonzero(allowed[:n])
        known = not allowed[n:].any()  # no id past the tokenizer's vocabulary, never judged
        special = 1 < len(choices) <= _BRANCH_CHOICES and self._tiers.special[choices].any()
        near = not capped and (path is None or remaining - _STRUCTURE_SLACK <= len(path) <= _JUDGED_COMPLETION)
        tight = near
        closing = near and (path is None or len(path) >= remaining - _SLACK)
        judged = special or (tight and 1 < len(choices) <= (_CLOSING_CHOICES if closing else _SMALL_CHOICES))
        self._longest_fit = 0
        if not judged:
            return allowed, path, known and path is not None and len(choices) == 1 and int(choices[0]) == path[0]
        fits: dict[int, list[int]] = {}
        for tok in (int(t) for t in choices):
            if tok in self._eos:
                fits[tok] = [tok]
                continue
            probe = self.matcher.deep_copy()
            if not probe.consume_token(tok):
                continue
            # Not capped (_SEARCH_CAP): a choice is taken away only where it is known not to
            # fit, and a capped search cannot tell. A branch's search walks its completion,
            # or the budget where none fits: a tool call of hundreds of tokens opened beside
            # a short response_format stayed open at max_tokens 300 and ended with "length"
            # (review h160). Judged only at a special token's choice or near the end.
            rest = [min(self._eos)] if probe.is_stopped() else self._search(probe, remaining - 1)
            if rest is not None and 1 + len(rest) <= remaining:  # a match's EOS needs room too
                fits[tok] = [tok, *rest]
                self._longest_fit = max(self._longest_fit, len(fits[tok]))
        if not fits:
            return allowed, path, False
        if len(fits) == len(choices):
            return allowed, path, known and path is not None
        kept = np.zeros_like(allowed)
        kept[list(fits)] = True
        if path is None or path[0] not in fits:
            path = min(fits.values(), key=len)
            self._path, self._path_stale, self._path_set = path, False, allowed.tobytes()
        return kept, path, True

    def mask(self, logits):
        """The logits for the next token, masked to the grammar (one call per token)."""
        import mlx.core as mx

        allowed = self.next_allowed(logits.shape[-1])
        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))

    # ------------------------------------------------------------------ speculative steps
    # A speculative step walks the row's drafts through the grammar (consume, then the next
    # position's mask, as plain decoding would call it), then goes back to the position the
    # verification accepted up to (spec/walks.py).
    _STATE = ("_calls", "_forced", "_estimate", "_path", "_path_stale", "_path_set", "_next_check",
              "_retry_at", "_failed", "closed_early", "_consumed")
    _consumed = 0  # tokens the matcher has taken (to roll it back)

    def state(self) -> tuple:
        """What ``restore`` needs to bring the row back here (lists copied)."""
        return tuple(list(v) if isinstance(v, list) else v for v in (getattr(self, n) for n in self._STATE))

    def restore(self, state: tuple) -> None:
        back = self._consumed - state[-1]
        if back:
            self.matcher.rollback(back)
        for name, value in zip(self._STATE, state):
            setattr(self, name, list(value) if isinstance(value, list) else value)

    @property
    def eos(self) -> frozenset[int]:
        return self._eos

    def takes(self, tok: int) -> bool:
        """Would the grammar take ``tok`` now (no change to the matcher)?"""
        return self.matcher.validate_tokens([int(tok)]) == 1

    def walk_start(self, context_size: int) -> None:
        """A speculative step's walk begins (spec/walks.GrammarWalk); nothing to set up."""

    def walk_take(self, tok: int) -> None:
        """Take ``tok`` as the next plain call would: the token sampled at the last call."""
        if self._calls > 0:
            self.consume(tok)

    def walk_allowed(self, vocab: int) -> Optional[np.ndarray]:
        """The next position's mask call (None would mean: no mask there)."""
        return self.next_allowed(vocab)

    def next_allowed(self, vocab: int) -> np.ndarray:
        """The tokens the next position allows, as a (vocab,) bool array (one call per
        token: this is what ``mask`` applies)."""
        self._calls += 1
        remaining = self._max_tokens - self._calls + 1  # tokens left, this one included
        # Simulate at the start (the smallest answer's length) and whenever the budget left
        # is within twice the last estimate: cheap far from the end, exact near it.
        # Also re-simulate far from the end, at shrinking intervals: the completion grows
        # while the model nests ("[[[[..."), so the last estimate alone can be far too low.
        steer = current = None
        if not self._forced and self._calls >= self._retry_at and (
                self._calls >= self._next_check or remaining <= 2 * self._estimate + _STRUCTURE_SLACK):
            current = allowed_tokens(self.matcher, vocab, self._tiers.respelled)
            limit = min(remaining, _SEARCH_CAP)
            path = self._completion(current, limit)
            capped = path is None and limit < remaining
            current, path, all_fit = self._fitting_branches(current, remaining, path, capped)
            if path is None and capped:
                # Longer than a search walks: not a failure, and far from the end. Look
                # again later, less often, as after a failed search, but never give up,
                # and never past the point where a completion the cap holds could be tight.
                self._retry_at = self._calls + max(4, min(remaining // 4, remaining - _SEARCH_CAP - _STRUCTURE_SLACK))
            elif path is None:
                # None fits now (or the search found none): look again later, less often,
                # since the model may reach a state it can close from; a failed search
                # walks the whole budget, so after _MAX_FAILED_SEARCHES stop looking.
                self._failed += 1
                self._retry_at = (self._calls + max(4, remaining // 4) if self._failed < _MAX_FAILED_SEARCHES
                                  else self._max_tokens + 1)
            elif len(path) >= remaining - _SLACK and not all_fit:
                # The budget only just covers a completion, and not every choice here is
                # known to leave one that fits: take it. (Taking one token at a time and
                # judging each next choice again kept a few more of the model's choices
                # after a forced string, but searched 20 times as often.)
                self._forced = list(path)
                self.closed_early = True
            else:
                # Far from the end, or every choice here leaves a completion that fits (a
                # few were judged one by one): the model chooses, and the next token is
                # looked at again. Before (an audit), a regex "(yes|no)" at max_tokens=4
                # was forced to its shortest branch, whatever the model preferred.
                # The next look is timed by the longest branch kept, whichever the model
                # takes: timed by the shortest (a one-key document), a tool call of 370
                # tokens opened beside it with 60 to spare was looked at again only after
                # 100 tokens of digits, and ended with "length".
                horizon = max(len(path), self._longest_fit)
                self._estimate = horizon
                self._next_check = self._calls + max(1, (remaining - horizon - _SLACK) // 4)
                if len(path) >= remaining - _STRUCTURE_SLACK and self._tiers.tier[path[0]] <= 2 and not all_fit:
                    steer = path[0]  # a closer, separator or EOS, where the choice was not judged
        if self._forced:
            allowed = np.zeros(vocab, dtype=bool)
            allowed[self._forced.pop(0)] = True
        else:
            allowed = current if current is not None else allowed_tokens(self.matcher, vocab, self._tiers.respelled)
            classes = self._tiers
            n = min(allowed.shape[0], classes.structural.shape[0])  # logits may be wider than the vocab
            if steer is not None and not (allowed[n:].any() or (
                    allowed[:n] & ~(classes.structural[:n] | classes.quote_first[:n])).any()):
                # Near the end, at a choice of structure only (a new key, item, nesting or
                # call, or the closer), close: one such token can lengthen the completion
                # past any fixed slack (a long optional key, a dict entry holding an object).
                # Where a token may go on with the value (a digit, a letter of an enum
                # value), the choice is the model's.
                allowed = np.zeros_like(allowed)
                allowed[steer] = True
        return allowed
