"""MTP speculative decoding inside mlx-lm's continuous batch.

Three pieces plug into mlx-lm 0.32's ``BatchGenerator`` without forking it:

- ``MTPTextModel`` wraps the backbone for prefill and plain decode steps: it returns the
  same logits and also writes the MTP head's cache entries, so the head always has the
  history it was trained with, whatever mix of plain and speculative steps ran before.
- ``MTPGenerationBatch`` (a ``GenerationBatch``) decides per step whether to speculate.
  A speculative step drafts k tokens per row with the head, verifies all rows' drafts in
  one backbone forward, accepts per row, and rolls every cache back per row.
- ``SpecBatchGenerator`` installs that batch. Rows enter it the usual way (prefill, then
  ``extend``), so admission, removal and cache extraction are mlx-lm's.

A step may emit several tokens for a row; each goes out as its own ``Response`` (in order),
so mlx-lm's counters and the lane's event loop need no change. The per-position processing
of drafting rows held to a grammar or penalised is in walks.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import BatchGenerator, GenerationBatch

from ..constraints import keep_mask
from ..params import SamplingParams
from .acceptance import Drafter
from .mtp_cache import BatchMTPCache, MTPKVCache
from .policy import AutoPolicy
from .verify import drop_shared_padding, rollback, verify_hidden
from .walks import GrammarWalk, PenaltyWalk

logger = logging.getLogger(__name__)


def _logits(lm, hidden: mx.array) -> mx.array:
    if lm.args.tie_word_embeddings:
        return lm.model.embed_tokens.as_linear(hidden)
    return lm.lm_head(hidden)


def _keep_mask(banned: tuple[tuple[int, ...], ...], vocab: int) -> mx.array | None:
    """(B, V) False at each row's banned ids (RowSpec.banned); None when no row bans any."""
    if not any(banned):
        return None
    return mx.array(np.stack([keep_mask(ids, vocab) for ids in banned]))


def _verified_logprobs(logits: mx.array, rows: list, drafting: list[bool]) -> dict[int, mx.array]:
    """Drafting rows that asked for logprobs: the verify's log-probabilities at each of the
    block's positions, (k+1, V), after the row's ban and grammar mask, as a plain step has
    them (its processors, then the ban the logprobs gather applies). Position j is the
    target's distribution for the token after j drafts: an accepted draft's, or the next
    token's where acceptance stopped (under sampling that one is drawn from the residual
    distribution speculative sampling needs, whose law is this one)."""
    want = [i for i, (r, d) in enumerate(zip(rows, drafting)) if d and r.logprobs]
    if not want:
        return {}
    lg = logits[mx.array(want)].astype(mx.float32)
    lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
    return {i: lp[n] for n, i in enumerate(want)}


def _bias_matrix(biases: tuple, vocab: int) -> mx.array | None:
    """(B, V) each row's ``logit_bias`` (RowSpec.bias) as an additive matrix; None when no
    row has one."""
    if not any(biases):
        return None
    out = np.zeros((len(biases), vocab), dtype=np.float32)
    for i, pairs in enumerate(biases):
        for t, b in pairs:
            out[i, t] += b
    return mx.array(out)


def _ban(logits: mx.array, keep: mx.array | None, bias: mx.array | None = None) -> mx.array:
    """``logits`` (B, V) or (B, T, V) plus each row's logit bias, then with the banned ids
    at -inf, as the row's bias processor (its first) and its ban do in a plain step. The
    bias and the ban are history-free: every drafted and verified position gets them."""
    if bias is not None:
        logits = logits + (bias[:, None, :] if logits.ndim == 3 else bias).astype(logits.dtype)
    if keep is None:
        return logits
    if logits.ndim == 3:
        keep = keep[:, None, :]
    return mx.where(keep, logits, mx.array(-float("inf"), dtype=logits.dtype))


class MTPTextModel(nn.Module):
    """The backbone plus its MTP head; the row cache is ``backbone caches + head caches``."""

    def __init__(self, model, head):
        super().__init__()
        self.model_ = model  # mlx-lm Model (qwen3_5), kept under a name that is not "model"
        self.head = head
        self.lm = model.language_model
        self.n_backbone = len(self.lm.layers)

    @property
    def layers(self):
        return self.lm.layers

    def make_cache(self):
        return self.model_.make_cache() + [MTPKVCache() for _ in self.head.layers]

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None):
        n = self.n_backbone
        hidden = self.lm.model(inputs, cache[:n], input_embeddings=input_embeddings)
        feed_history(self.head, self.lm.model.embed_tokens, cache[n:], inputs, hidden)
        return _logits(self.lm, hidden)


def feed_history(head, embed, caches, tokens: mx.array, hidden: mx.array) -> None:
    """Write the head's entries for tokens just fed to the backbone (prefill or plain step).

    Entry t pairs h_t with token t+1: the new tokens pair with [pending, hidden[:-1]], and
    the hidden state of each row's last real token becomes its new ``pending``.
    """
    first: BatchMTPCache = caches[0]
    B, S = tokens.shape
    prev = first.pending if first.pending is not None else mx.zeros((B, 1, hidden.shape[-1]), hidden.dtype)
    fresh = mx.logical_not(first.has_pending)  # rows whose first entry is a dummy
    for c in caches:
        c.hide_first_entry(fresh)
    lengths = first.lengths
    head(embed(tokens), mx.concatenate([prev, hidden[:, :-1]], axis=1), caches)
    if lengths is None:
        ends = mx.full((B,), S, dtype=mx.int32)
    else:  # right-padded prefill: only the first `lengths` positions of each row are real
        ends = mx.clip(lengths, 0, S).astype(mx.int32)
        for c in caches:
            c.lengths = lengths - S
    last = mx.take_along_axis(hidden, mx.maximum(ends - 1, 0).reshape(B, 1, 1), axis=1)
    got = ends > 0
    first.pending = mx.where(got[:, None, None], last, prev)
    first.has_pending = first.has_pending | got


def write_accepted(head, embed, caches, tokens: mx.array, hidden: mx.array, counts: list[int]) -> None:
    """After a verify: entries for the accepted drafts, pairing verify hidden i with draft i+1."""
    top = max(counts)
    if top == 0:
        return
    pad = [top - c for c in counts]
    ragged = any(pad)
    if ragged:
        for c in caches:
            c.prepare(right_padding=pad)
    head(embed(tokens[:, :top]), hidden[:, :top], caches)
    if ragged:
        for c in caches:
            c.finalize()
        drop_shared_padding(caches)


@dataclass
class RowSpec:
    """What the speculative step needs to know about one request."""

    params: SamplingParams
    sampler: Any  # the row's own sampler (None: greedy), as given to the generator
    drafts: bool  # may this row draft? (no user processors; a grammar, bias, penalties; mode allows it)
    forces: bool  # mode "on": speculate even when "auto" would not
    # Token ids the row may never emit (constraints.TokenBan: tool_choice="none", or no
    # tools). History-free, so drafts and verified positions are masked alike.
    banned: tuple[int, ...] = ()
    # The row's one processor when it is a grammar (closing.GrammarProcessor: a
    # response_format, a forced call; tool_call_grammar.LazyToolCallGrammar: calls under
    # "auto"): the step walks the drafts through it to mask each verified position as a
    # plain step would, then takes it back to where verification stopped (GrammarWalk).
    # ``on_error`` fails the request as the processor's guard would in a plain step.
    grammar: Any = None
    on_error: Any = None
    logprobs: bool = False  # the request asked for logprobs: keep the verify's distributions
    # Its logit_bias as (id, bias) pairs: history-free as a ban, so a biased row drafts and
    # every drafted and verified position is biased as its bias processor biases a plain step.
    bias: tuple = ()
    # Its penalty processors (pure functions of the token context): a penalized row drafts,
    # each position processed with the context a plain step there would hold (PenaltyWalk).
    penalties: tuple = ()


#: A head that has had at least this many drafts checked and accepted under this share of
#: them is probably not this model's: a quantized head, norms read in the wrong convention,
#: another checkpoint's head. Output stays exact (every draft is verified); only speed is lost.
LOW_ACCEPTANCE_AFTER, LOW_ACCEPTANCE = 32, 0.05


@dataclass
class SpecStats:
    spec_steps: int = 0
    plain_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_rows: int = 0  # row-steps that drafted (for mean accepted per step)
    warned: bool = False

    def count(self, *, drafted: int, accepted: int, rows: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.draft_rows += rows
        if not self.warned and self.drafted >= LOW_ACCEPTANCE_AFTER and self.accepted < LOW_ACCEPTANCE * self.drafted:
            self.warned = True
            logger.warning("the MTP head accepted %d of %d drafts: its weights may not be this model's "
                           "(a quantized head, another checkpoint's head, or norms in the wrong "
                           "convention); output is unchanged, but speculation gains nothing",
                           self.accepted, self.drafted)

    def snapshot(self) -> dict:
        return {
            "spec_steps": self.spec_steps,
            "plain_steps": self.plain_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "draft_rows": self.draft_rows,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_accepted_per_step": self.accepted / self.draft_rows if self.draft_rows else 0.0,
        }


@dataclass
class SpecConfig:
    head: Any
    depth: int
    mode: str  # engine default: "auto" | "on" | "off"
    rows: dict = field(default_factory=dict)  # uid -> RowSpec
    stats: SpecStats = field(default_factory=SpecStats)
    policy: AutoPolicy = field(default_factory=AutoPolicy)


class MTPGenerationBatch(GenerationBatch):
    spec: SpecConfig  # set by SpecBatchGenerator
    _last_plain = False  # was the previous step plain (so its forward is pipelined)?
    # The last step's ban mask and bias matrix, and the rows' bans and biases they were built
    # for: each is B x vocab (megabytes for a real vocabulary), and rarely changes between steps.
    _keep: tuple = ((), None)
    _bias: tuple = ((), None)

    # ------------------------------------------------------------------ policy
    def _wants_spec(self, rows: list[RowSpec]) -> bool:
        if not any(r.drafts for r in rows):
            return False
        if any(r.forces for r in rows):
            return True
        if self.spec.mode == "on":
            return True
        return self.spec.policy.speculate(len(rows))

    def next(self):
        if not self.uids:
            return []
        rows = [self.spec.rows[uid] for uid in self.uids]
        spec = self._wants_spec(rows)
        drafting = [r.drafts for r in rows]
        tic = time.perf_counter()
        if not spec:
            # A plain step evaluates the previous step's pipelined forward: right after a
            # speculative step there is none, so that step's time is not a plain step's cost.
            steady = self._last_plain
            out = super().next()
            # mlx-lm evaluates only the step's tokens; the backbone's caches come along as
            # their inputs, the head's entries (feed_history) do not. Left lazy they pile up
            # step after step, holding each step's hidden state, until a speculative step or
            # a finished row's cache copy evaluates them all in one stall (measured: 170 ms
            # after 400 plain steps of a tiny model, every other stream waiting).
            if self.prompt_cache:
                mx.async_eval([c.state for c in self.prompt_cache[self.model.n_backbone:]])
            self._last_plain = True
            self.spec.stats.plain_steps += 1
            if steady:
                self.spec.policy.record(len(rows), speculative=False, seconds=time.perf_counter() - tic)
            return out
        self._last_plain = False
        out, gain = self._speculative_next(rows, drafting)
        self.spec.stats.spec_steps += 1
        self.spec.policy.record(len(rows), speculative=True, seconds=time.perf_counter() - tic, gain=gain)
        return out

    # ------------------------------------------------------------------ one speculative step
    def _speculative_next(self, rows: list[RowSpec], drafting: list[bool]):
        spec = self.spec
        lm = self.model.lm
        embed = lm.model.embed_tokens
        n = self.model.n_backbone
        backbone, mtp = self.prompt_cache[:n], self.prompt_cache[n:]
        k = spec.depth
        B = len(self.uids)
        x = self._next_tokens
        drafter = Drafter([r.params for r in rows], [r.sampler for r in rows], drafting, k,
                          lm.args.vocab_size)

        # Draft: depth 1 pairs the last backbone hidden with x (an exact history entry);
        # deeper drafts chain the head's own output and are removed after the verify.
        bans = tuple(r.banned for r in rows)
        if self._keep[0] != bans:
            self._keep = (bans, _keep_mask(bans, lm.args.vocab_size))
        keep = self._keep[1]
        biases = tuple(r.bias if d else () for r, d in zip(rows, drafting))  # plain rows: a processor
        if self._bias[0] != biases:
            self._bias = (biases, _bias_matrix(biases, lm.args.vocab_size))
        bias = self._bias[1]
        walk = GrammarWalk.of(rows, drafting, x, k, self._token_context)
        pens = PenaltyWalk.of(rows, drafting, x, self._token_context)
        hid, tok, drafts = mtp[0].pending, x[:, None], []
        for depth in range(k):
            m = spec.head(embed(tok), hid, mtp)
            lg = _ban(_logits(lm, m)[:, -1], keep, bias)
            if pens is not None:  # the penalties before the grammar, as a plain step's processors
                lg = pens.draft(lg, drafts)
            if walk is not None:  # a grammar row drafts what its grammar allows there
                lg = walk.mask(lg, depth, drafts[-1] if drafts else None)
            d = drafter.choose(depth, lg)
            drafts.append(d)
            hid, tok = m, d[:, None]
        if walk is not None:
            walk.advance(k, drafts[-1])  # the bonus position's mask
        drafts = mx.stack(drafts, axis=1)  # (B, k)

        # Verify every row's block in one forward.
        inputs = mx.concatenate([x[:, None], drafts], axis=1)
        hidden, records = verify_hidden(lm, inputs, backbone)
        raw = _logits(lm, hidden)
        logits = _ban(raw, keep, bias)
        if pens is not None:
            logits = pens.verify(logits, drafts)
        if walk is not None:  # each verified position masked as a plain step masks it
            logits = walk.mask_all(logits)
        accepted, nxt = drafter.accept(logits, drafts)
        # The distribution each row's x was drawn from (the last step's), for its logprobs.
        x_logprobs = list(self._next_logprobs) if len(self._next_logprobs) == B else [None] * B
        # Processors see the logits a plain step gives them: the ban comes after them there
        # (BannedSampler, or TokenBan as the last processor), and a processor that reads the
        # whole vocabulary (a mean, an entropy) turned -inf into NaN.
        nxt, next_logprobs = self._plain_rows_next(drafting, raw[:, 0], x, nxt)
        verified = _verified_logprobs(logits, rows, drafting)
        mx.eval(accepted, nxt, inputs)
        acc = accepted.tolist()
        for i, lp in verified.items():  # the next x is drawn at the first position not accepted
            next_logprobs[i] = lp[acc[i]]
        blocks = inputs.tolist()
        if walk is not None:
            walk.settle(blocks, acc, self._token_context)
        if pens is not None:
            pens.settle(blocks, acc, set(walk.idx) if walk is not None else set())
        # Emit before rolling back, so a row that finishes inside its block (max_tokens or
        # a stop token before its last accepted draft) is cut back to its finish: its cache
        # then holds exactly its tokens and can be handed back for the prefix cache.
        emitted, finishes = self._emit_tokens(blocks, acc)

        # Roll back: backbone keeps each row's emitted tokens; the head drops its chained
        # entries and gets exact ones for the kept drafts; pending = hidden at the last one.
        rollback(backbone, records, k + 1, emitted)
        if k > 1:
            for c in mtp:
                c.trim(k - 1)
        kept = [n - 1 for n in emitted]
        write_accepted(spec.head, embed, mtp, drafts, hidden, kept)
        mtp[0].pending = mx.take_along_axis(hidden, mx.array(kept, dtype=mx.int32).reshape(B, 1, 1), axis=1)

        self._next_tokens = nxt
        self._next_logprobs = next_logprobs
        # mlx-lm (0.32) keeps the tokens a plain step fed in _current_tokens, and extend()
        # concatenates a joining row's onto them; only a plain step resets them. Left as
        # they are, speculative steps let them grow by a row (and a graph node) per request
        # for the life of the engine.
        self._current_tokens, self._current_logprobs = None, []
        responses = self._responses(blocks, emitted, finishes, x_logprobs, verified)

        # Count what reached the output: drafts accepted past a row's max_tokens or stop
        # are dropped, and counting them would flatter both the stats and the auto policy.
        n_draft_rows = sum(drafting)
        spec.stats.count(drafted=k * n_draft_rows, accepted=sum(e - 1 for e, d in zip(emitted, drafting) if d),
                         rows=n_draft_rows)
        return responses, sum(emitted) / B

    def _plain_rows_next(self, drafting: list[bool], logits0: mx.array, x: mx.array,
                         nxt: mx.array) -> tuple[mx.array, list]:
        """Rows that do not draft take their next token exactly as a plain step would:
        their processors on position-0 logits, then their own sampler. Also each row's
        distribution it was drawn from ((V,), as a plain step keeps it; None for drafting rows)."""
        plain = [i for i, d in enumerate(drafting) if not d]
        logprobs = [None] * len(drafting)
        if not plain:
            return nxt, logprobs
        picks = []
        for i in plain:
            tok, logprobs[i] = self._sample_processed(i, logits0[i: i + 1], x[i: i + 1])
            picks.append(tok)
        idx = mx.array(plain)
        nxt = mx.array(nxt)
        nxt[idx] = mx.concatenate(picks).astype(nxt.dtype)
        return nxt, logprobs

    def _sample_processed(self, i: int, lg: mx.array, fed: mx.array) -> tuple[mx.array, mx.array]:
        """Row i's next token from logits (1, V) after feeding ``fed``: processors, then
        sampler; and the log-probabilities it was drawn from, (V,)."""
        processors = self.logits_processors[i] or ()
        if processors:
            context = self._token_context[i].update_and_fetch(fed)
            for proc in processors:
                lg = proc(context, lg)
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        sampler = self.samplers[i] if self.samplers and self.samplers[i] is not None else self.fallback_sampler
        return sampler(lp).reshape(1), lp[0]

    def _emit_tokens(self, blocks: list[list[int]], accepted: list[int]) -> tuple[list[int], list]:
        """Append each row's kept tokens (x and its accepted drafts) up to its finish; return
        how many each row emitted and its finish reason (None while it goes on)."""
        emitted, finishes = [], []
        for i in range(len(self.uids)):
            finish = None
            kept = blocks[i][: accepted[i] + 1]
            for j, tok in enumerate(kept):
                self.tokens[i].append(tok)
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self._matchers[i].advance(tok):
                    finish = "stop"
                if finish:
                    break
            emitted.append(j + 1)
            finishes.append(finish)
        return emitted, finishes

    def _responses(self, blocks: list[list[int]], emitted: list[int], finishes: list, x_logprobs: list,
                   verified: dict) -> list:
        """One response per emitted token; like a plain step, a finished row hands back its
        cache (rolled back to its last token) and leaves the batch. A row's first token
        carries the distribution it was drawn from (``x_logprobs``), an accepted draft the
        verify's at its place (``verified``, for rows that asked for logprobs)."""
        responses, keep = [], []
        for i, uid in enumerate(self.uids):
            n, finish = emitted[i], finishes[i]
            for j, tok in enumerate(blocks[i][:n]):
                last = finish is not None and j == n - 1
                responses.append(self.Response(
                    uid=uid, token=tok,
                    logprobs=x_logprobs[i] if j == 0 else (verified[i][j - 1] if i in verified else None),
                    finish_reason=finish if last else None,
                    prompt_cache=self.extract_cache(i) if last else None,
                    all_tokens=self.tokens[i] if last else None))
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


class SpecBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator whose decode batch speculates with the model's MTP head."""

    def __init__(self, model: MTPTextModel, spec: SpecConfig, **kwargs):
        super().__init__(model, **kwargs)
        self.spec = spec
        batch = MTPGenerationBatch.empty(self.model, self.sampler)
        batch.spec = spec
        self._generation_batch = batch

    def forget(self, uids) -> None:
        for uid in uids:
            self.spec.rows.pop(uid, None)
