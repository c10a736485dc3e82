"""SpecPrefill scoring: draft-attention importance against an explicit full-sequence reference,
exact query capture, chunk-size independence, no lasting change to the draft, chunk selection.

The reference recomputes every attention layer's queries and keys from the layer's weights on
the whole sequence (prompt + greedy lookahead, no cache) and applies softmax by hand; the scorer
gets its queries from the live cached forward. Equal scores mean the captured queries are the
ones the layer attends with, the GQA mapping is right, and only attention layers vote.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask, create_ssm_mask, scaled_dot_product_attention
from mlx_lm.models.cache import make_prompt_cache

from mlx_tandem.errors import InvalidRequestError, ModelLoadError
from mlx_tandem.specprefill.scoring import DraftScorer, _layer_importance, _QueryRecorder, select_chunks

from .numerics import tolerance

PROMPT = [int(t) for t in np.random.RandomState(3).randint(10, 2000, 40)]


@pytest.fixture(scope="module")
def models(tiny_models):
    loaded = {}

    def get(kind):
        if kind not in loaded:
            loaded[kind] = mlx_lm.load(str(tiny_models.get(kind)))[0]
        return loaded[kind]

    return get


def _score(model, tokens, **kw) -> DraftScorer:
    scorer = DraftScorer(model, tokens, **kw)
    while not scorer.advance():
        pass
    return scorer


def _reference_qk(attn, x):
    """Queries and keys of one attention layer on the whole sequence, from its weights."""
    B, L, _ = x.shape
    if hasattr(attn, "q_norm"):  # qwen3_5 full attention: gated q_proj (query | gate per head)
        heads, kv_heads = attn.num_attention_heads, attn.num_key_value_heads
        q, _gate = mx.split(attn.q_proj(x).reshape(B, L, heads, -1), 2, axis=-1)
        q = attn.q_norm(q)
        k = attn.k_norm(attn.k_proj(x).reshape(B, L, kv_heads, -1))
    else:  # llama
        heads, kv_heads = attn.n_heads, attn.n_kv_heads
        q = attn.q_proj(x).reshape(B, L, heads, -1)
        k = attn.k_proj(x).reshape(B, L, kv_heads, -1)
    return attn.rope(q.transpose(0, 2, 1, 3)), attn.rope(k.transpose(0, 2, 1, 3))


def _reference(model, prompt, lookahead):
    """(lookahead tokens, scores) by brute force: no cache, explicit softmax per attention layer."""
    seq = list(prompt)
    for _ in range(lookahead):
        seq.append(int(mx.argmax(model(mx.array(seq)[None])[0, -1]).item()))
    n, total = len(prompt), len(seq)
    h = model.model.embed_tokens(mx.array(seq)[None])
    causal = mx.tril(mx.ones((total, total), dtype=mx.bool_))
    per_layer = []
    for layer in model.layers:
        linear = getattr(layer, "is_linear", False)
        if not linear:
            attn = layer.self_attn
            q, k = _reference_qk(attn, layer.input_layernorm(h))
            k = mx.repeat(k, q.shape[1] // k.shape[1], axis=1)  # head h reads kv head h // group
            logits = mx.where(causal, (q @ k.transpose(0, 1, 3, 2)) * attn.scale, -math.inf)
            probs = mx.softmax(logits, axis=-1)[0, :, n:, :n]  # (heads, lookahead steps, prompt)
            per_layer.append(probs.mean(axis=1).max(axis=0))
        mask = create_ssm_mask(h) if linear else create_attention_mask(h)
        h = layer(h, mask=mask, cache=None)
    return seq[n:], np.array(mx.mean(mx.stack(per_layer), axis=0)), len(per_layer)


@pytest.mark.parametrize("kind", ["draft", "llama", "qwen3_5"])
def test_scores_match_brute_force_reference(models, kind):
    model = models(kind)
    scorer = _score(model, PROMPT, lookahead=5, step_size=16)
    tokens, expected, n_layers = _reference(model, PROMPT, 5)
    assert scorer.lookahead_tokens == tokens
    assert scorer.scores.dtype == np.float32 and scorer.scores.shape == (len(PROMPT),)
    assert len(scorer.attention_layers) == n_layers
    np.testing.assert_allclose(scorer.scores, expected, **tolerance(rtol=1e-4, atol=1e-6))
    # Random weights still give a non-uniform ranking worth selecting from.
    assert scorer.scores.max() > 2 * scorer.scores.min()


def test_hybrid_model_scores_with_attention_layers_only(models):
    model = models("qwen3_5")
    scorer = _score(model, PROMPT, lookahead=4)
    assert scorer.attention_layers == [i for i, layer in enumerate(model.layers) if not layer.is_linear]
    assert scorer.attention_layers == [1, 3]
    assert scorer.scores.shape == (len(PROMPT),) and np.isfinite(scorer.scores).all()
    assert (scorer.scores > 0).all()


def test_layer_importance_known_values():
    # Zero queries: uniform attention over the visible keys, so step t gives 1 / (n + t + 1).
    n, steps, heads, kv_heads, dim = 6, 3, 4, 2, 8
    keys = mx.random.normal((1, kv_heads, n + steps, dim), key=mx.random.key(0))
    got = _layer_importance(mx.zeros((1, heads, steps, dim)), keys, 0.5, n)
    expected = np.mean([1 / (n + t + 1) for t in range(steps)])
    np.testing.assert_allclose(np.array(got), np.full(n, expected), rtol=1e-6)
    # GQA: query head 1 (group 0) must read kv head 0, whose key 3 it matches strongly;
    # kv head 1 has its strong key at 5, which no query head of group 1 looks for.
    keys = mx.zeros((1, kv_heads, n + steps, dim))
    keys[0, 0, 3, 0] = 50.0
    keys[0, 1, 5, 0] = 50.0
    queries = mx.zeros((1, heads, steps, dim))
    queries[0, 1, :, 0] = 1.0
    got = np.array(_layer_importance(queries, keys, 1.0, n))
    assert got[3] > 0.999 and got.argmax() == 3
    np.testing.assert_allclose(got[5], expected, rtol=1e-6)


def test_captured_queries_reproduce_attention_output(models):
    model = models("llama")
    attn = model.layers[1].self_attn
    cache = make_prompt_cache(model)[1]
    x = mx.random.normal((1, len(PROMPT), model.args.hidden_size), key=mx.random.key(1))
    step = mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(2))
    attn(x, mask="causal", cache=cache)
    recorder = _QueryRecorder(attn.rope)
    attn.rope = recorder
    try:
        out = attn(step, mask=None, cache=cache)
    finally:
        attn.rope = recorder.rope
    queries, new_keys = recorder._outputs
    keys, values = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    assert mx.array_equal(new_keys, keys[..., -1:, :])
    ref = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale)
    np.testing.assert_allclose(np.array(attn.o_proj(ref.transpose(0, 2, 1, 3).reshape(1, 1, -1))),
                               np.array(out), rtol=1e-5, atol=1e-6)
    # Installed on every layer, the recorders leave the forward exactly as it was.
    tokens = mx.array(PROMPT)[None]
    before = model(tokens)
    recorders = [_QueryRecorder(layer.self_attn.rope) for layer in model.layers]
    for layer, rec in zip(model.layers, recorders):
        layer.self_attn.rope = rec
    try:
        wrapped = model(tokens)
    finally:
        for layer, rec in zip(model.layers, recorders):
            layer.self_attn.rope = rec.rope
    assert mx.array_equal(wrapped, before)


@pytest.mark.parametrize("kind", ["draft", "qwen3_5"])
def test_scores_do_not_depend_on_step_size(models, kind):
    model = models(kind)
    scorer = DraftScorer(model, PROMPT, lookahead=4, step_size=7)
    calls = 1
    while not scorer.advance():
        assert scorer.scores is None and not scorer.done
        calls += 1
    assert calls == math.ceil((len(PROMPT) - 1) / 7) + 1
    whole = _score(model, PROMPT, lookahead=4, step_size=512)
    assert scorer.lookahead_tokens == whole.lookahead_tokens
    np.testing.assert_allclose(scorer.scores, whole.scores, **tolerance(rtol=1e-4, atol=1e-7))


def test_done_is_idempotent_and_model_unchanged(models):
    model = models("llama")
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    ropes = [layer.self_attn.rope for layer in model.layers]
    before = model(mx.array(PROMPT)[None])
    scorer = _score(model, PROMPT)
    scores = scorer.scores
    assert scorer.advance() is True and scorer.done and scorer.scores is scores
    assert scorer.cache is None  # the draft's KV memory is released
    assert [layer.self_attn.rope for layer in model.layers] == ropes
    after = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    assert after.keys() == params.keys() and all(np.array_equal(after[k], params[k]) for k in params)
    assert mx.array_equal(model(mx.array(PROMPT)[None]), before)


def test_single_token_prompt(models):
    scorer = DraftScorer(models("draft"), [42], lookahead=3)
    assert scorer.advance() is True  # no prefill chunk: the one token goes in with the lookahead
    assert scorer.scores.shape == (1,) and 0.0 < scorer.scores[0] <= 1.0


def test_invalid_arguments(models):
    model = models("draft")
    with pytest.raises(InvalidRequestError):
        DraftScorer(model, [])
    with pytest.raises(InvalidRequestError):
        DraftScorer(model, PROMPT, lookahead=0)
    with pytest.raises(InvalidRequestError):
        DraftScorer(model, PROMPT, step_size=0)


class _NoRope(nn.Module):
    def __call__(self, x, mask=None, cache=None):
        return x


class _FusedRopeAttention(llama.Attention):
    """Ropes queries and keys in one call: the scorer cannot tell them apart, and must say so."""

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        qk = self.rope(mx.concatenate([q, k], axis=1), offset=cache.offset)
        q, k = mx.split(qk, [self.n_heads], axis=1)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_unsupported_attention_raises_model_load_error(tiny_models):
    model = mlx_lm.load(str(tiny_models.get("draft")))[0]
    original = model.layers[0].self_attn
    model.layers[0].self_attn = _NoRope()
    with pytest.raises(ModelLoadError, match="_NoRope"):
        DraftScorer(model, PROMPT)

    fused = _FusedRopeAttention(model.args)
    fused.update(original.parameters())
    model.layers[0].self_attn = fused
    scorer = DraftScorer(model, PROMPT, step_size=512)
    with pytest.raises(ModelLoadError, match="_FusedRopeAttention"):
        while not scorer.advance():
            pass
    assert type(fused.rope) is nn.RoPE  # restored after the failure


# --------------------------------------------------------------------------- select_chunks
def test_select_chunks_keeps_ends_and_top_chunks():
    scores = np.zeros(100)
    scores[40:50] = 5.0  # chunk 4
    scores[60:70] = 3.0  # chunk 6
    scores[70:80] = 4.0  # chunk 7
    runs = select_chunks(scores, start=0, end=100, keep_pct=0.5, chunk_size=10)
    # ceil(0.5 * 10) = 5 chunks: first, last, then 4, 7, 6; 6 and 7 merge.
    assert runs == [(0, 10), (40, 50), (60, 80), (90, 100)]
    assert sum(e - s for s, e in runs) == 50


def test_select_chunks_always_keeps_first_and_last():
    scores = np.ones(50)
    scores[0:10] = scores[40:50] = 0.0  # the ends score lowest, and are kept anyway
    assert select_chunks(scores, start=0, end=50, keep_pct=0.2, chunk_size=10) == [(0, 10), (40, 50)]
    assert select_chunks(scores, start=0, end=50, keep_pct=0.01, chunk_size=10) == [(0, 10), (40, 50)]
    assert select_chunks(scores, start=0, end=8, keep_pct=0.01, chunk_size=10) == [(0, 8)]


@pytest.mark.parametrize("keep_pct,n_chunks", [(0.3, 10), (0.7, 10), (0.25, 7), (0.5, 3), (0.9, 11)])
def test_select_chunks_count(keep_pct, n_chunks):
    scores = np.random.RandomState(0).rand(n_chunks * 4)
    runs = select_chunks(scores, start=0, end=n_chunks * 4, keep_pct=keep_pct, chunk_size=4)
    kept = sum(e - s for s, e in runs) // 4
    assert kept == max(math.ceil(round(keep_pct * n_chunks, 9)), 2)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(runs, runs[1:]))  # sorted, merged, disjoint


def test_select_chunks_ties_prefer_earlier_chunks():
    scores = np.ones(60)  # six equal chunks: the earliest middle chunks win
    assert select_chunks(scores, start=0, end=60, keep_pct=0.6, chunk_size=10) == [(0, 30), (50, 60)]


def test_select_chunks_aligns_at_the_end_so_the_last_chunk_is_whole():
    """The last chunk (always kept) is a whole chunk of the prompt's end, where a chat puts
    its question; aligned at the start it was the remainder, a few template tokens."""
    scores = np.zeros(40)
    scores[18:23] = 1.0  # chunk [18, 23) of chunks aligned at 33
    runs = select_chunks(scores, start=7, end=33, keep_pct=0.5, chunk_size=5)
    # chunks: [7,8) [8,13) [13,18) [18,23) [23,28) [28,33); keep ceil(0.5 * 6) = 3
    assert runs == [(7, 8), (18, 23), (28, 33)]


def test_select_chunks_full_and_empty():
    scores = np.random.RandomState(1).rand(30)
    assert select_chunks(scores, start=3, end=29, keep_pct=1.0, chunk_size=4) == [(3, 29)]
    assert select_chunks(scores, start=10, end=10, keep_pct=0.5, chunk_size=4) == []
    assert select_chunks(scores, start=12, end=10, keep_pct=0.5, chunk_size=4) == []


@pytest.mark.parametrize("keep_pct", [0.0, -0.1, 1.01, float("nan")])
def test_select_chunks_rejects_bad_keep_pct(keep_pct):
    with pytest.raises(InvalidRequestError):
        select_chunks(np.ones(10), start=0, end=10, keep_pct=keep_pct, chunk_size=2)


def test_select_chunks_rejects_bad_arguments():
    with pytest.raises(InvalidRequestError):
        select_chunks(np.ones(10), start=0, end=10, keep_pct=0.5, chunk_size=0)
    with pytest.raises(InvalidRequestError):
        select_chunks(np.ones(10), start=0, end=11, keep_pct=0.5, chunk_size=2)
