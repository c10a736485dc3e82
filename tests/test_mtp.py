"""MTP speculative decoding: lossless greedy, preserved sampling, per-row acceptance, policy.

The reference is always the same engine with ``mtp="off"``. The model is a qwen3_5 (hybrid
GatedDeltaNet + attention) factory checkpoint whose MTP head was self-distilled on the
greedy continuations of ``default_prompts(64)``: drafts for those prompts are mostly
accepted and drafts for unseen prompts mostly rejected, so one batch holds rows that
accept different numbers of drafts.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_tandem import Engine, SamplingParams
from mlx_tandem.errors import InvalidRequestError, ModelLoadError
from mlx_tandem.options import EngineOptions
from mlx_tandem.spec import batch as spec_batch
from mlx_tandem.spec.acceptance import Drafter
from mlx_tandem.spec.mtp_head import MTPHeadError
from mlx_tandem.spec.policy import AutoPolicy
from mlx_tandem.testing.mtp_distill import default_prompts

from .numerics import repetition_penalty_scores, same_distribution, same_draws, same_greedy, same_greedy_rows

TRAINED = default_prompts(64)
UNSEEN = default_prompts(40, seed=7)
PROMPTS = TRAINED[:60] + UNSEEN  # 100 prompts


async def _run(path, prompts, params, **options):
    engine = Engine(path, show_progress=False, **options)
    await engine.start()
    try:
        outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        return [o.token_ids for o in outs], engine.stats()
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def greedy_reference(qwen3_5_mtp_path):
    return asyncio.run(_run(qwen3_5_mtp_path, PROMPTS, {"max_tokens": 24}, mtp="off", max_batch_size=8))[0]


@pytest.mark.parametrize("batch,depth", [(1, 3), (8, 2), (8, 1)])
def test_greedy_output_identical_with_mtp(qwen3_5_mtp_path, greedy_reference, monkeypatch, batch, depth):
    keeps = []
    real_rollback = spec_batch.rollback

    def spy(cache, records, fed, keep):
        keeps.append(list(keep))
        return real_rollback(cache, records, fed, keep)

    monkeypatch.setattr(spec_batch, "rollback", spy)
    outs, stats = asyncio.run(_run(qwen3_5_mtp_path, PROMPTS, {"max_tokens": 24}, mtp="on",
                                   max_batch_size=batch, mtp_depth=depth))
    same_greedy_rows(outs, greedy_reference, judge=qwen3_5_mtp_path, prompts=PROMPTS)
    mtp = stats["mtp"]
    assert mtp["spec_steps"] > 0 and mtp["plain_steps"] == 0
    assert mtp["acceptance_rate"] > 0.15, mtp  # speculation really ran and accepted drafts
    assert mtp["drafted"] == depth * mtp["draft_rows"]
    if batch > 1:  # rows that kept different numbers of tokens in the same step
        assert any(len(set(k)) > 1 for k in keeps)
    assert any(max(k) == depth + 1 for k in keeps) and any(min(k) == 1 for k in keeps)


def test_greedy_output_identical_with_mtp_on_a_mixture_of_experts_checkpoint(qwen3_5_moe_mtp_path):
    """Qwen3.5-MoE / Qwen3.6-35B-A3B: the head's experts are stored fused, as the
    backbone's (``experts.gate_up_proj``); the head once failed to load from them. Its
    router and experts verify, accept and roll back per row like a dense layer's."""
    outs = {}
    for mode in ("off", "on"):
        outs[mode], stats = asyncio.run(_run(qwen3_5_moe_mtp_path, PROMPTS[:40], {"max_tokens": 24}, mtp=mode,
                                             max_batch_size=8))
    same_greedy_rows(outs["on"], outs["off"], judge=qwen3_5_moe_mtp_path, prompts=PROMPTS[:40])
    assert stats["mtp"]["spec_steps"] > 0 and stats["mtp"]["acceptance_rate"] > 0.15, stats["mtp"]


def test_max_tokens_and_eos_exact_with_multi_token_steps(qwen3_5_mtp_path):
    params = {"max_tokens": 7}
    ref, _ = asyncio.run(_run(qwen3_5_mtp_path, TRAINED[:16], params, mtp="off"))
    got, stats = asyncio.run(_run(qwen3_5_mtp_path, TRAINED[:16], params, mtp="on", mtp_depth=3))
    same_greedy_rows(got, ref, judge=qwen3_5_mtp_path, prompts=TRAINED[:16])
    assert all(len(t) <= 7 for t in got)
    assert stats["mtp"]["accepted"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_acceptance_counts_only_drafts_that_reached_the_output(qwen3_5_mtp_path, max_tokens):
    # Every row drafts in every step (greedy, mtp="on"), and a step emits the pending token
    # plus the accepted drafts, so the output is exactly one token per row-step plus the
    # accepted drafts; drafts accepted past max_tokens are dropped and must not count.
    async def run():
        async with Engine(qwen3_5_mtp_path, show_progress=False, mtp="on", mtp_depth=3) as engine:
            outs = await asyncio.gather(*(engine.complete(p, {"max_tokens": max_tokens}) for p in TRAINED[:8]))
            return sum(o.usage.completion_tokens for o in outs), engine.stats()["mtp"]

    emitted, mtp = asyncio.run(run())
    assert mtp["plain_steps"] == 0 and mtp["spec_steps"] > 0
    assert emitted == mtp["draft_rows"] + mtp["accepted"], mtp



def test_acceptance_counts_no_drafts_past_a_stop_string(qwen3_5_mtp_path):
    """A stop string is found after the step (on the text): the drafts accepted after it
    in the same block never reached the output and must not count."""
    async def run():
        async with Engine(qwen3_5_mtp_path, show_progress=False, mtp="on", mtp_depth=3) as engine:
            free = await asyncio.gather(*(engine.complete(p, {"max_tokens": 16}) for p in TRAINED[:8]))
            base = engine.stats()
            # Each row stops at a piece of its own free answer, a few tokens in.
            stops = [[engine.tokenizer.decode(o.token_ids[4:6]).strip() or o.text[-3:]] for o in free]
            outs = await asyncio.gather(*(engine.complete(p, {"max_tokens": 16, "stop": s})
                                          for p, s in zip(TRAINED[:8], stops)))
            after = engine.stats()
            mtp = {k: after["mtp"][k] - base["mtp"][k] for k in ("draft_rows", "accepted")}
            return outs, mtp, after["generation_tokens"] - base["generation_tokens"]

    outs, mtp, generated = asyncio.run(run())
    assert sum(o.finish_reason == "stop" for o in outs) >= 4
    assert sum(o.usage.completion_tokens for o in outs) == mtp["draft_rows"] + mtp["accepted"] == generated, mtp


def test_a_snapshot_sees_a_step_and_its_stop_strings_whole(qwen3_5_mtp_path):
    """A stop string takes back the drafts accepted past it after the step's tokens are
    counted: a snapshot taken between the two read generation_tokens fall (12, then 11; an
    audit). Polled from another thread while rows stop, the counters never go back."""
    import threading

    async def run():
        async with Engine(qwen3_5_mtp_path, show_progress=False, mtp="on", mtp_depth=3) as engine:
            free = await asyncio.gather(*(engine.complete(p, {"max_tokens": 16}) for p in TRAINED[:8]))
            stops = [[engine.tokenizer.decode(o.token_ids[4:6]).strip() or o.text[-3:]] for o in free]
            seen, done = [], threading.Event()

            def poll():
                while not done.is_set():
                    snap = engine.stats()
                    seen.append((snap["generation_tokens"], snap["mtp"]["accepted"]))

            poller = threading.Thread(target=poll)
            poller.start()
            try:
                for _ in range(4):
                    outs = await asyncio.gather(*(engine.complete(p, {"max_tokens": 16, "stop": s})
                                                  for p, s in zip(TRAINED[:8], stops)))
                    assert sum(o.finish_reason == "stop" for o in outs) >= 4
            finally:
                done.set()
                poller.join()
            return seen

    seen = asyncio.run(run())
    assert len(seen) > 50
    back = [(a, b) for a, b in zip(seen, seen[1:]) if b[0] < a[0] or b[1] < a[1]]
    assert not back, back[:5]


def test_rows_with_processors_and_seeded_rows_match_plain_decoding(qwen3_5_mtp_path):
    """Rows that cannot draft (logits processors; seeded sampling under "auto") share the
    speculative batch and still produce their plain-decoding output: exactly on the CPU,
    up to a near-tie on a GPU."""
    prompts = TRAINED[:8]
    params = [{"max_tokens": 16, "repetition_penalty": 1.3} if i % 2 else
              {"max_tokens": 16, "temperature": 0.8, "seed": i} for i in range(8)]

    async def run(mode):
        engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp=mode)
        await engine.start()
        try:
            # Greedy rows that do draft keep the batch speculating.
            outs = await asyncio.gather(*(engine.complete(p, q) for p, q in zip(prompts, params)),
                                        *(engine.complete(p, {"max_tokens": 16, "mtp": "on"}) for p in prompts))
            return [o.token_ids for o in outs[:8]], engine.stats()["mtp"]
        finally:
            await engine.close()

    ref, _ = asyncio.run(run("off"))
    got, mtp = asyncio.run(run("auto"))
    # Exact on the CPU; on a GPU the speculative batch's forward has another shape, so a
    # row may part where its draw or its penalised argmax is a near-tie (tests/numerics.py).
    for i, (g, r, prompt) in enumerate(zip(got, ref, prompts)):
        if i % 2:
            same_greedy(g, r, judge=qwen3_5_mtp_path, prompt_ids=prompt, what=f"request {i}",
                        scores=repetition_penalty_scores(1.3))
        else:
            same_draws(g, r, judge=qwen3_5_mtp_path, prompt_ids=prompt, seed=i, temperature=0.8,
                       what=f"request {i}")
    assert mtp["spec_steps"] > 0


def test_sampled_distribution_matches_plain_sampling(qwen3_5_mtp_path):
    """Speculative sampling keeps the output distribution.

    top_k=2 leaves a tiny vocabulary: the first three generated tokens take at most 8 joint
    values. 1200 seeded samples per mode, chi-square test of homogeneity on the first two
    and the first three tokens; we reject only at p < 0.001 (fixed seeds: deterministic).
    The factory backbone's distributions are flat, so sampled continuations leave the
    greedy paths the head was distilled on and most drafts are rejected: this exercises the
    residual resampling branch above all (the acceptance branch is measured in isolation
    below); a few hundred drafts are still accepted."""
    n = 1200
    prompt = TRAINED[3]

    async def run(mode):
        engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp=mode, max_batch_size=32, mtp_depth=2)
        await engine.start()
        try:
            outs = await asyncio.gather(*(engine.complete(prompt, {
                "max_tokens": 3, "temperature": 0.6, "top_k": 2, "seed": 1000 * (mode == "on") + i,
                "mtp": mode}) for i in range(n)))
            return [tuple(o.token_ids[:3]) for o in outs], engine.stats()["mtp"]
        finally:
            await engine.close()

    plain, _ = asyncio.run(run("off"))
    spec, mtp = asyncio.run(run("on"))
    assert mtp["accepted"] >= 100 and mtp["drafted"] > 2000
    same_distribution(plain, spec)


def test_acceptance_rule_reproduces_target_distribution():
    """The acceptance maths alone, on a 6-token vocabulary with a deliberately wrong draft
    distribution: the first emitted token must follow the target's filtered, tempered
    distribution (total variation < 0.015 over 60000 rows, in batches of 10000: MLX 0.32's
    CUDA backend fails to launch one of these kernels on 60000 rows at once)."""
    mx.random.seed(0)
    V, B, chunks = 6, 10000, 6
    params = [SamplingParams(temperature=0.7, top_k=4)] * B
    target = mx.array([2.0, 1.0, 0.5, 0.2, -1.0, 0.0])
    draft = mx.array([0.0, 2.0, 1.0, 0.0, 0.5, 0.1])
    firsts, accepts = [], []
    for _ in range(chunks):
        drafter = Drafter(params, [None] * B, [True] * B, 1, V)
        d = drafter.choose(0, mx.broadcast_to(draft, (B, V)))
        logits = mx.broadcast_to(mx.stack([target, target]), (B, 2, V))
        accepted, nxt = drafter.accept(logits, d[:, None])
        firsts.append(np.array(mx.where(accepted > 0, d, nxt)))
        accepts.append(np.array(accepted))
    counts = np.bincount(np.concatenate(firsts), minlength=V) / (B * chunks)
    lp = np.array(target) - np.log(np.exp(np.array(target)).sum())
    lp[np.argsort(-lp)[4:]] = -np.inf
    p = np.exp(lp / 0.7)
    p /= p.sum()
    assert 0.5 * np.abs(counts - p).sum() < 0.015, (counts, p)
    assert 0.2 < float((np.concatenate(accepts) > 0).mean()) < 0.9  # both branches exercised


def test_a_draft_the_target_cannot_sample_is_never_accepted():
    """Acceptance is u * q(d) < p(d) with u from [0, 1): at u = 0 the rule "<=" accepted a
    draft of target probability 0 (here outside top_k=1), a token a plain step never samples."""
    V = 16
    drafter = Drafter([SamplingParams(temperature=1.0, top_k=1)], [None], [True], 1, V)
    d = drafter.choose(0, mx.where(mx.arange(V) == 5, 10.0, -10.0)[None])
    assert d.tolist() == [5]
    target = mx.broadcast_to(mx.where(mx.arange(V) == 3, 10.0, -10.0), (1, 2, V))
    for u in (0.0, 1e-30, 0.5):
        drafter.uniform = mx.full((1, 1), u)
        accepted, nxt = drafter.accept(target, d[:, None])
        assert accepted.tolist() == [0] and nxt.tolist() == [3], u


def test_acceptance_runs_in_float32_for_bf16_models():
    """The acceptance maths of a bf16 model run in float32: in bf16 the distribution MTP
    sampled from moved by up to 0.7% (total variation) from plain sampling's."""
    from mlx_tandem.spec.acceptance import row_logprobs

    logits = (mx.random.normal((2, 3, 64), key=mx.random.key(0)) * 4).astype(mx.bfloat16)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)]
    got = row_logprobs(logits, params)
    assert got.dtype == mx.float32
    assert mx.array_equal(got, row_logprobs(logits.astype(mx.float32), params))


def test_auto_policy_measures_and_chooses():
    pol = AutoPolicy(explore_steps=2, probe_every=10)
    decisions = [pol.speculate(4) for _ in range(4)]
    assert decisions == [True, True, False, False] or decisions[:2] == [True, True]
    for _ in range(2):
        pol.record(4, speculative=True, seconds=2.0, gain=1.2)
        pol.record(4, speculative=False, seconds=1.0)
    assert pol.predicted_speedup(4) == pytest.approx(0.6)
    assert [pol.speculate(4) for _ in range(9)] == [False] * 9
    assert pol.speculate(4) is True  # periodic re-measurement of the losing mode
    pol.record(3, speculative=True, seconds=1.0, gain=2.5)  # same bucket as 4
    assert pol.predicted_speedup(4) > 0.6
    # A head that gains nothing is never used, however the timings fall (a busy machine
    # slowed the plain steps and the ratio alone said to speculate).
    idle = AutoPolicy(explore_steps=2, probe_every=1000)
    for _ in range(2):
        idle.speculate(1), idle.speculate(1)
        idle.record(1, speculative=True, seconds=1.0, gain=1.02)
        idle.record(1, speculative=False, seconds=3.0)
    assert idle.predicted_speedup(1) > 1 and not any(idle.speculate(1) for _ in range(20))


def test_auto_policy_times_a_plain_probe_while_speculation_wins():
    """MTPGenerationBatch times a plain step only after a plain one (the step right after a
    speculative one has no pipelined forward to wait for). A one-step probe was therefore
    never timed, and t_plain kept its first measures while speculation won (review h169):
    the probe is two plain steps, and the second one's time counts."""
    pol = AutoPolicy(explore_steps=2, probe_every=8)
    timed, last_plain = [], False
    for step in range(200):
        spec = pol.speculate(1)
        if spec:
            pol.record(1, speculative=True, seconds=1.0, gain=3.0)
        elif last_plain:  # the batch's rule: a plain step is timed after a plain one
            pol.record(1, speculative=False, seconds=0.9 if step < 20 else 0.5)
            timed.append(step)
        last_plain = not spec
    assert len([t for t in timed if t >= 20]) >= 15  # each probe timed once
    assert pol.buckets[1].t_plain == pytest.approx(0.5, abs=0.02)  # the new cost was learnt
    assert pol.predicted_speedup(1) == pytest.approx(1.5, abs=0.1)


def test_auto_mode_stops_speculating_when_drafts_are_rejected(qwen3_5_path, caplog):
    """The plain factory head is random: "auto" explores, measures ~0 acceptance and
    decodes plainly from then on, and the log says the head may not be the model's."""
    with caplog.at_level(logging.WARNING, logger="mlx_tandem"):
        outs, stats = asyncio.run(_run(qwen3_5_path, UNSEEN[:4], {"max_tokens": 48}, mtp="auto"))
    ref, _ = asyncio.run(_run(qwen3_5_path, UNSEEN[:4], {"max_tokens": 48}, mtp="off"))
    same_greedy_rows(outs, ref, judge=qwen3_5_path, prompts=UNSEEN[:4])
    mtp = stats["mtp"]
    assert mtp["plain_steps"] > 3 * mtp["spec_steps"] > 0
    assert mtp["accepted"] < 0.05 * mtp["drafted"]
    assert sum("may not be this model's" in r.getMessage() for r in caplog.records) == 1


def test_per_request_override(qwen3_5_mtp_path):
    async def run():
        engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp="off")
        await engine.start()
        try:
            await engine.complete(TRAINED[0], {"max_tokens": 8, "mtp": "on"})
            off = engine.stats()["mtp"]
        finally:
            await engine.close()
        engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp="on")
        await engine.start()
        try:
            await engine.complete(TRAINED[0], {"max_tokens": 8, "mtp": False})
            return off, engine.stats()["mtp"]
        finally:
            await engine.close()

    engine_off, request_off = asyncio.run(run())
    assert engine_off["spec_steps"] == 0  # engine "off" loads no head: requests cannot force it
    assert request_off["drafted"] == 0
    with pytest.raises(InvalidRequestError):
        SamplingParams(mtp="sometimes")
    with pytest.raises(InvalidRequestError):
        Engine(qwen3_5_mtp_path, mtp_depth=4)


# ---------------------------------------------------------------------- loading the head
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, fn):
    f = path / "model.safetensors"
    w, metadata = mx.load(str(f), return_metadata=True)
    w = fn(dict(w))
    mx.eval(w)
    f.unlink()
    mx.save_safetensors(str(f), w, metadata=metadata)


def test_head_under_language_model_prefix_loads_the_same(qwen3_5_mtp_path, tmp_path):
    alt = _copy(qwen3_5_mtp_path, tmp_path / "alt")
    _rewrite(alt, lambda w: {("language_model." + k if k.startswith("mtp.") else k): v for k, v in w.items()})
    a, sa = asyncio.run(_run(qwen3_5_mtp_path, TRAINED[:4], {"max_tokens": 12}, mtp="on"))
    b, sb = asyncio.run(_run(alt, TRAINED[:4], {"max_tokens": 12}, mtp="on"))
    assert a == b and sa["mtp"]["accepted"] == sb["mtp"]["accepted"] > 0


def test_head_added_beside_a_converted_backbone_loads_as_the_original(qwen3_5_mtp_path, tmp_path, caplog):
    """mlx_lm.convert (the usual quantized form) drops mtp.* and marks its files "mlx"; users
    add the original's mtp.* tensors back in a file of their own. The head read from it is
    the original's whatever the backbone's layout: HF's tensors (marked "pt", or not marked)
    and mlx-converted ones (norms shifted, marked "mlx"). Before, the converted backbone's
    layout decided, HF's norms loaded off by one, and the head accepted no draft."""
    from mlx.utils import tree_flatten
    from mlx_lm import convert
    from mlx_lm.utils import load_model

    from mlx_tandem.model_loader import load_text_model
    from mlx_tandem.spec.mtp_head import is_zero_centred_norm, load_mtp_head

    def head_of(path):
        model, config = load_model(path)
        return dict(tree_flatten(load_mtp_head(path, model.language_model, config, dtype=mx.float32).parameters()))

    original = head_of(qwen3_5_mtp_path)
    converted = tmp_path / "q8"
    convert(str(qwen3_5_mtp_path), mlx_path=str(converted), quantize=True, q_bits=8, q_group_size=32)
    raw = {k: v for k, v in mx.load(str(qwen3_5_mtp_path / "model.safetensors")).items() if k.startswith("mtp.")}
    shifted = {k: (v + 1.0 if is_zero_centred_norm(k, v) else v) for k, v in raw.items()}
    for name, tensors, metadata in (("pt", raw, {"format": "pt"}), ("unmarked", raw, None),
                                    ("mlx", shifted, {"format": "mlx"})):
        path = _copy(converted, tmp_path / name)
        mx.save_safetensors(str(path / "model-mtp.safetensors"), tensors, metadata=metadata)
        head = head_of(path)
        assert head.keys() == original.keys()
        assert all(mx.array_equal(head[k], original[k]).item() for k in original), name
    # A quantized model computes in its floating dtype; the packed weights are uint32.
    with caplog.at_level(logging.INFO, logger="mlx_tandem"):
        loaded = load_text_model(converted, show_progress=False)
    assert loaded.dtype == load_text_model(qwen3_5_mtp_path, show_progress=False).dtype != "mlx.core.uint32"
    assert "8-bit affine, group 32" in caplog.text


def test_add_mtp_head_gives_a_quantized_checkpoint_its_head_back(qwen3_5_mtp_path, tmp_path):
    """``mlx-tandem-add-mtp-head ORIGINAL CONVERTED`` (spec/add_head.py): an 8-bit conversion
    has no head ("on" refuses it); with the original's head added back it speculates, its
    drafts are accepted, and its greedy output is its own without MTP."""
    from mlx_lm import convert

    from mlx_tandem.spec.add_head import main

    converted = tmp_path / "q8"  # 4 bits move this tiny backbone too far for its distilled head
    convert(str(qwen3_5_mtp_path), mlx_path=str(converted), quantize=True, q_bits=8, q_group_size=32)
    with pytest.raises(MTPHeadError, match="converters such as mlx_lm.convert leave them out"):
        asyncio.run(_run(converted, TRAINED[:1], {"max_tokens": 2}, mtp="on"))
    assert main([str(qwen3_5_mtp_path), str(converted)]) == 0
    on, stats = asyncio.run(_run(converted, TRAINED[:6], {"max_tokens": 16}, mtp="on"))
    off, _ = asyncio.run(_run(converted, TRAINED[:6], {"max_tokens": 16}, mtp="off"))
    same_greedy_rows(on, off, judge=converted, prompts=TRAINED[:6])
    # 25% here (83% on the unquantized original: 8 bits still move a tiny backbone); the
    # head read with its norms off by one accepted none.
    assert stats["mtp"]["accepted"] > 0.1 * stats["mtp"]["drafted"] > 0
    assert main([str(tmp_path / "nowhere"), str(converted)]) == 1


def test_add_mtp_head_writes_nothing_it_should_not(qwen3_5_mtp_path, tmp_path, capsys):
    """A destination whose own weights hold a head is left as it is (a duplicate shard was
    written); one it cannot write into is a one-line error, with no shard left half-written
    (a traceback before: an audit)."""
    from mlx_tandem.spec.add_head import HEAD_FILE, add_mtp_head, main

    has_head = _copy(qwen3_5_mtp_path, tmp_path / "has-head")
    before = sorted(p.name for p in has_head.iterdir())
    assert add_mtp_head(qwen3_5_mtp_path, has_head) is None
    assert sorted(p.name for p in has_head.iterdir()) == before

    blocked = _copy(qwen3_5_mtp_path, tmp_path / "blocked")
    _rewrite(blocked, lambda w: {k: v for k, v in w.items() if not k.startswith("mtp.")})
    (blocked / HEAD_FILE / "in-the-way").mkdir(parents=True)  # os.replace cannot put a file there
    config = (blocked / "config.json").read_text()
    assert main([str(qwen3_5_mtp_path), str(blocked)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the MTP head into") and "Traceback" not in err
    assert sorted(p.name for p in blocked.iterdir()) == sorted(["config.json", HEAD_FILE, *[
        p.name for p in qwen3_5_mtp_path.iterdir() if p.name != "config.json"]])
    assert (blocked / HEAD_FILE).is_dir() and (blocked / "config.json").read_text() == config
    assert main([str(tmp_path / "nowhere"), str(blocked)]) == 1
    assert "nowhere is not a directory" in capsys.readouterr().err
    # A shard that is not one (an LFS pointer never fetched, a truncated file): one line too.
    for junk in (b"version https://git-lfs.github.com/spec/v1\n", b"\x10\x00\x00\x00\x00\x00\x00\x00{", b""):
        (blocked / "extra.safetensors").write_bytes(junk)
        assert main([str(qwen3_5_mtp_path), str(blocked)]) == 1
        err = capsys.readouterr().err
        assert "extra.safetensors is not a readable safetensors file" in err and "Traceback" not in err


@pytest.mark.parametrize("checkpoint", ["qwen3_5_mtp_path", "qwen3_5_moe_mtp_path"])
def test_head_matches_mlx_vlm_drafter(checkpoint, request):
    """Our MTPHead (mlx-lm layers) computes what mlx-vlm's Qwen3.5 MTP drafter computes from
    the same checkpoint weights: the weight conventions (zero-centred norms, a mixture of
    experts' fused experts) agree."""
    from mlx_lm.utils import load_model
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Model as VLMDrafter
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig

    from mlx_tandem.spec.mtp_head import load_mtp_head

    qwen3_5_mtp_path = request.getfixturevalue(checkpoint)
    model, config = load_model(qwen3_5_mtp_path)
    model.set_dtype(mx.float32)
    ours = load_mtp_head(qwen3_5_mtp_path, model.language_model, config, dtype=mx.float32)
    theirs = VLMDrafter(ModelConfig.from_dict({"model_type": "qwen3_5_mtp", "text_config": config["text_config"]}))
    raw = {k: v for k, v in mx.load(str(qwen3_5_mtp_path / "model.safetensors")).items() if k.startswith("mtp.")}
    theirs.load_weights(list(theirs.sanitize(raw).items()), strict=False)
    theirs.set_dtype(mx.float32)
    emb = mx.random.normal((2, 5, config["text_config"]["hidden_size"]))
    hid = mx.random.normal(emb.shape)
    a = ours(emb, hid)
    b = theirs._forward_hidden(emb, hid, None, mx.arange(5)[None])
    assert mx.allclose(a, b, atol=1e-4).item()


@pytest.mark.parametrize("checkpoint", ["qwen3_5_mtp_path", "qwen3_5_moe_mtp_path"])
def test_mlx_vlm_drafter_beside_a_converted_model_is_its_head(checkpoint, request, tmp_path):
    """``mlx_vlm.convert --mtp`` leaves ``mtp.*`` out of the model and has its splitter write
    the head to ``<model>-mtp`` (its own names, norms shifted, experts as ``switch_mlp``).
    The engine reads it there: the same parameters as the head in the original checkpoint,
    the same greedy tokens and accepted drafts. Before, such a model decoded plainly."""
    from mlx_lm.utils import load_model
    from mlx_vlm.speculative.drafters.mtp_split import detect_mtp_splitter

    from mlx_tandem.spec.mtp_head import load_mtp_head

    original = request.getfixturevalue(checkpoint)
    converted = _copy(original, tmp_path / "model")
    _rewrite(converted, lambda w: {k: v for k, v in w.items() if not k.startswith("mtp.")})
    detect_mtp_splitter(original).split(str(original), str(tmp_path / "model-mtp"))  # what convert runs

    model, config = load_model(original)
    lm = model.language_model
    ours = dict(tree_flatten(load_mtp_head(converted, lm, config, dtype=mx.float32).parameters()))
    theirs = dict(tree_flatten(load_mtp_head(original, lm, config, dtype=mx.float32).parameters()))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in theirs)

    got, stats = asyncio.run(_run(converted, TRAINED[:4], {"max_tokens": 12}, mtp="on"))
    ref, ref_stats = asyncio.run(_run(original, TRAINED[:4], {"max_tokens": 12}, mtp="on"))
    assert got == ref and stats["mtp"]["accepted"] == ref_stats["mtp"]["accepted"] > 0

    # A quantized drafter (convert --mtp -q) is refused by name, as a quantized head is.
    shutil.rmtree(tmp_path / "model-mtp")
    detect_mtp_splitter(original).split(str(original), str(tmp_path / "model-mtp"), q_bits=8, q_group_size=32)
    with pytest.raises(MTPHeadError, match="model-mtp: the MTP head is quantized"):
        load_mtp_head(converted, lm, config)


def test_a_drafter_elsewhere_is_read_where_mtp_drafter_names_it(qwen3_5_mtp_path, tmp_path):
    """A drafter written elsewhere (``convert --mtp-output``, or a hub repo of its own) is
    read where the engine option ``mtp_drafter`` names it: the same tokens and accepted
    drafts as the original checkpoint's head. Without the option the model has no head; a
    directory that is no drafter, is not there or does not fit is a load error under "auto"
    too, as asked for by name."""
    from mlx_vlm.speculative.drafters.mtp_split import detect_mtp_splitter

    converted = _copy(qwen3_5_mtp_path, tmp_path / "model")
    _rewrite(converted, lambda w: {k: v for k, v in w.items() if not k.startswith("mtp.")})
    drafter = tmp_path / "drafters" / "qwen-mtp"
    detect_mtp_splitter(qwen3_5_mtp_path).split(str(qwen3_5_mtp_path), str(drafter))

    got, stats = asyncio.run(_run(converted, TRAINED[:4], {"max_tokens": 12}, mtp="on", mtp_drafter=str(drafter)))
    ref, ref_stats = asyncio.run(_run(qwen3_5_mtp_path, TRAINED[:4], {"max_tokens": 12}, mtp="on"))
    assert got == ref and stats["mtp"]["accepted"] == ref_stats["mtp"]["accepted"] > 0

    with pytest.raises(MTPHeadError, match="no mtp.* weights"):
        asyncio.run(_run(converted, TRAINED[:1], {"max_tokens": 2}, mtp="on"))
    # A drafter that does not fit the model (here one missing a tensor) fails the load too.
    broken = shutil.copytree(drafter, tmp_path / "broken")
    for f in broken.glob("*.safetensors"):
        weights, metadata = mx.load(str(f), return_metadata=True)
        f.unlink()
        mx.save_safetensors(str(f), {k: v for k, v in weights.items() if k != "fc.weight"}, metadata=metadata)
    for wrong, reason in ((converted, "not an MTP drafter"), (tmp_path / "nowhere", "neither a local directory"),
                          (broken, "does not fit this model")):
        with pytest.raises(ModelLoadError, match=reason):
            asyncio.run(_run(converted, TRAINED[:1], {"max_tokens": 2}, mtp="auto", mtp_drafter=str(wrong)))
    # The option is resolved like a model: two spellings of one directory are one engine option.
    assert EngineOptions(mtp_drafter=str(drafter / ".." / "qwen-mtp")) == EngineOptions(mtp_drafter=str(drafter))
    with pytest.raises(InvalidRequestError, match="mtp_drafter"):
        EngineOptions(mtp_drafter="  ")


def test_a_head_with_one_tensor_per_expert_loads_as_the_fused_one(tiny_models, tmp_path):
    """Qwen3-Next stores its experts one tensor per expert and projection; the head loads
    the same parameters from that layout as from the fused one (12 experts: "10" sorts
    before "2" as text)."""
    from mlx_lm.utils import load_model

    from mlx_tandem.spec.mtp_head import load_mtp_head

    def per_expert(weights):
        out = {}
        for k, v in weights.items():
            if k.endswith(".experts.gate_up_proj"):
                prefix = k[: -len(".gate_up_proj")]
                gate, up = mx.split(v, 2, axis=-2)
                for e in range(v.shape[0]):
                    out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate[e], up[e]
            elif k.endswith(".experts.down_proj") and k.startswith("mtp."):
                for e in range(v.shape[0]):
                    out[f"{k[: -len('.down_proj')]}.{e}.down_proj.weight"] = v[e]
            else:
                out[k] = v
        return out

    moe = tiny_models.get("qwen3_5_moe_vl", num_experts=12)
    split = _copy(moe, tmp_path / "per-expert")
    _rewrite(split, lambda w: {**{k: v for k, v in w.items() if not k.startswith("mtp.")},
                               **per_expert({k: v for k, v in w.items() if k.startswith("mtp.")})})
    model, config = load_model(moe)
    fused = load_mtp_head(moe, model.language_model, config)
    apart = load_mtp_head(split, model.language_model, config)
    a, b = dict(tree_flatten(fused.parameters())), dict(tree_flatten(apart.parameters()))
    assert a.keys() == b.keys() and any("switch_mlp" in k for k in a)
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.parametrize("key", ["mtp.fc.scales", "mtp.layers.0.mlp.experts.gate_up_proj_scales",
                                 "mtp.fc.weight_scale_inv", "mtp.fc.weight_scale_2"])
def test_a_quantized_head_is_refused_by_name_when_added_and_when_loaded(qwen3_5_mtp_path, tmp_path, key):
    """mlx's affine, fused experts', FP8 and NVFP4 quantization: the head is refused as
    quantized (it accepts almost no drafts), by the loader and by mlx-tandem-add-mtp-head,
    which wrote an FP8 head without complaint (a review)."""
    from mlx_lm.utils import load_model

    from mlx_tandem.spec.add_head import add_mtp_head
    from mlx_tandem.spec.mtp_head import load_mtp_head

    quantized = _copy(qwen3_5_mtp_path, tmp_path / "quantized")
    _rewrite(quantized, lambda w: {**w, key: mx.ones((4,))})
    model, config = load_model(qwen3_5_mtp_path)
    with pytest.raises(MTPHeadError, match="quantized"):
        load_mtp_head(quantized, model.language_model, config)
    with pytest.raises(ModelLoadError, match="quantized"):
        add_mtp_head(quantized, _copy(qwen3_5_mtp_path, tmp_path / "dest"))


def test_missing_or_broken_head_is_an_error_under_on_and_a_logged_fallback_under_auto(
        qwen3_5_mtp_path, tmp_path, caplog):
    missing = _copy(qwen3_5_mtp_path, tmp_path / "missing")
    _rewrite(missing, lambda w: {k: v for k, v in w.items() if not k.startswith("mtp.")})
    broken = _copy(qwen3_5_mtp_path, tmp_path / "broken")
    _rewrite(broken, lambda w: {k: (v[:, :-1] if k == "mtp.fc.weight" else v) for k, v in w.items()})
    for path in (missing, broken):
        with pytest.raises(MTPHeadError) as err:
            asyncio.run(_run(path, TRAINED[:1], {"max_tokens": 2}, mtp="on"))
        assert isinstance(err.value, ModelLoadError)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mlx_tandem"):
            outs, stats = asyncio.run(_run(path, TRAINED[:1], {"max_tokens": 4}, mtp="auto"))
        assert len(outs[0]) == 4 and stats["mtp"]["spec_steps"] == 0
        assert any("MTP disabled" in r.getMessage() for r in caplog.records)


def test_model_without_head_under_on_is_an_error(llama_path):
    with pytest.raises(MTPHeadError):
        asyncio.run(_run(llama_path, ["hi"], {"max_tokens": 2}, mtp="on"))


def test_single_token_prompts_and_stop_strings_match_plain_decoding(qwen3_5_mtp_path):
    """A one-token prompt has no history for the head (its first entry is masked); a stop
    string can end a request in the middle of a multi-token step."""
    async def run(mode):
        engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp=mode, mtp_depth=3)
        await engine.start()
        try:
            single = await asyncio.gather(*(engine.complete([t], {"max_tokens": 12}) for t in (5, 77, 300)))
            full = await engine.complete(TRAINED[5], {"max_tokens": 24})
            stop = full.text[len(full.text) // 2:][:3]
            stopped = await engine.complete(TRAINED[5], {"max_tokens": 24, "stop": [stop]})
            return [o.token_ids for o in single], full.text, stop, stopped.text, engine.stats()["mtp"]
        finally:
            await engine.close()

    *ref, _ = asyncio.run(run("off"))
    *got, mtp = asyncio.run(run("on"))
    assert got == ref
    assert got[3] == got[1][: got[1].index(got[2])]  # cut before the stop string, never emitted
    assert mtp["accepted"] > 0


def test_adapters_pass_the_per_call_mtp_override(qwen3_5_mtp_path):
    from langchain_mlx_tandem import ChatMLX
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.llms.mlx_tandem import MLXTandemLLM

    opts = {"show_progress": False, "mtp": "on", "max_waiting": 4321}  # a private engine
    lc = ChatMLX(model=str(qwen3_5_mtp_path), engine_options=opts, max_tokens=12)
    li = MLXTandemLLM(model=str(qwen3_5_mtp_path), engine_options=opts, max_tokens=12, mtp="off")
    engine = lc.engine
    assert li.engine is engine

    def drafted(fn):
        before = engine.stats()["mtp"]["drafted"]
        out = fn()
        return out, engine.stats()["mtp"]["drafted"] - before

    on, d_on = drafted(lambda: lc.invoke(TRAINED[1]).content)
    off, d_off = drafted(lambda: lc.invoke(TRAINED[1], mtp="off").content)
    li_off, d_li = drafted(lambda: li.chat([ChatMessage(role="user", content=TRAINED[1])]).message.content)
    assert d_on > 0 and d_off == 0 and d_li == 0
    assert on == off == li_off  # greedy: the same answer either way


def test_token_bans_keep_rows_drafting_and_hold_in_every_position(qwen3_5_mtp_path, monkeypatch):
    """A ban (tool_choice="none", or no tools) depends on no history, so banned rows still
    draft, and the speculative step masks drafts and verified positions alike: the output
    equals plain decoding under the same ban, and never holds a banned token."""
    from mlx_tandem.constraints import TokenBan
    from mlx_tandem.engine import Engine as _Engine

    prompts = TRAINED[:8]
    free, _ = asyncio.run(_run(qwen3_5_mtp_path, prompts, {"max_tokens": 16}, mtp="off"))
    # Ban tokens the rows emit after their first (inside speculative steps, not at prefill).
    banned = sorted({t for row in free for t in row[2:6]})[:6]
    assert banned

    real = _Engine._make_request

    def with_ban(self, spec, sink):
        req, parser = real(self, spec, sink)
        req.processors = list(req.processors) + [TokenBan(banned)]
        return req, parser

    monkeypatch.setattr(_Engine, "_make_request", with_ban)
    ref, _ = asyncio.run(_run(qwen3_5_mtp_path, prompts, {"max_tokens": 16}, mtp="off"))
    got, stats = asyncio.run(_run(qwen3_5_mtp_path, prompts, {"max_tokens": 16}, mtp="on", mtp_depth=2))
    assert not any(t in banned for row in ref + got for t in row)
    assert ref != free  # the ban changed the answers
    same_greedy_rows(got, ref, judge=qwen3_5_mtp_path, prompts=prompts)
    assert stats["mtp"]["spec_steps"] > 0 and stats["mtp"]["accepted"] > 0



def test_processors_see_the_logits_of_a_plain_step(qwen3_5_mtp_path):
    """A chat without tools bans the call marker after the row's processors in a plain step
    (the sampler, or TokenBan last): in a speculative step, rows that do not draft got the
    banned ids at -inf, and a processor that reads the whole vocabulary (here a centring,
    which leaves the argmax alone) turned them into NaN."""
    chats = [[{"role": "user", "content": f"Say something about item {i}."}] for i in range(4)]
    saw_inf = []

    def centre(tokens, logits):
        saw_inf.append(bool(mx.isinf(logits).any().item()))
        return logits - mx.mean(logits, axis=-1, keepdims=True)

    async def run(mode):
        async with Engine(qwen3_5_mtp_path, show_progress=False, mtp=mode) as engine:
            outs = await asyncio.gather(
                *(engine.chat(c, {"max_tokens": 16, "logits_processors": [centre]}) for c in chats),
                *(engine.complete(p, {"max_tokens": 24, "mtp": "on"}) for p in TRAINED[:4]))
            return ([o.token_ids for o in outs[:4]], [engine.apply_chat_template(c) for c in chats],
                    engine.stats()["mtp"])

    ref, prompts, _ = asyncio.run(run("off"))
    assert saw_inf and not any(saw_inf)
    got, _, mtp = asyncio.run(run("auto"))
    assert mtp["spec_steps"] > 0
    assert not any(saw_inf), "a processor saw banned ids at -inf"
    for i, (g, r, prompt) in enumerate(zip(got, ref, prompts)):
        same_greedy(g, r, judge=qwen3_5_mtp_path, prompt_ids=prompt, what=f"request {i}")


def _pending_ops(arrays) -> int:
    """Operations MLX has yet to run to produce ``arrays`` (0 once they are evaluated)."""
    import io

    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return dot.getvalue().count("shape=rectangle")


def test_plain_steps_leave_no_deferred_work_in_the_head_cache(qwen3_5_mtp_path):
    """A plain step writes the head's history (feed_history), but mlx-lm evaluates only the
    step's tokens. Unevaluated, those writes piled up step after step until a speculative
    step or a finished row's cache copy ran them all at once, stalling every stream."""
    async def run():
        engine = Engine(qwen3_5_mtp_path, show_progress=False, mtp="on")
        await engine.start()
        try:
            def pending():
                mx.synchronize()  # let the steps already scheduled finish
                batch = engine._core._lanes["text"]._gen._generation_batch
                head = batch.prompt_cache[batch.model.n_backbone:]
                arrays = [a for c in head for a in c.state if isinstance(a, mx.array)]
                return len(arrays), _pending_ops(arrays)

            eos = sorted(engine.loaded.eos_token_ids)  # ids, not an array: the processor runs on the engine thread

            def never_stop(tokens, logits):
                return logits.at[:, eos].add(-1e9)

            counts = []
            params = {"max_tokens": 80, "mtp": False, "logits_processors": [never_stop]}
            async with await engine.open_complete_stream(UNSEEN[0], params) as stream:
                async for _ in stream:
                    if len(stream.token_ids) in (5, 60):
                        counts.append(engine.run_on_owner_thread(pending))
            return counts, engine.stats()["mtp"]
        finally:
            await engine.close()

    counts, mtp = asyncio.run(run())
    assert mtp["plain_steps"] >= 60 and mtp["spec_steps"] == 0
    assert len(counts) == 2 and all(n > 0 for n, _ in counts)
    assert [ops for _, ops in counts] == [0, 0], counts


def test_speculative_steps_keep_no_tokens_of_rows_that_left(qwen3_5_mtp_path):
    """mlx-lm's extend() adds each joining row's first token to the batch's record of the
    tokens last fed, which only a plain step resets: under speculation it must not grow
    with every request the engine serves."""
    async def run():
        async with Engine(qwen3_5_mtp_path, show_progress=False, mtp="on", prefix_cache_bytes=0) as engine:
            for p in TRAINED[:12]:
                await engine.complete(p, {"max_tokens": 8})
            batch = engine._core._lanes["text"]._gen._generation_batch
            rows = engine.run_on_owner_thread(
                lambda: None if batch._current_tokens is None else batch._current_tokens.shape[0])
            return rows, len(batch._current_logprobs), engine.stats()["mtp"]

    rows, logprobs, stats = asyncio.run(run())
    assert stats["spec_steps"] > 0
    assert (rows or 0) <= 1 and logprobs <= 1, (rows, logprobs)


def test_rows_taking_turns_to_keep_most_share_no_growing_padding(qwen3_5_mtp_path, greedy_reference, monkeypatch):
    """A ragged rollback pads each row by what the row that kept most kept beyond it. Rows
    taking turns to keep most grew the padding they all share by a few slots a step until
    a row left: every row attended over it, and the batch's cache outgrew what memory
    admission reserves (the longest row plus one growth step). Acceptance is capped here
    in turns (a lossless cut: the next token is the target's at the cap), the output
    stays the plain one, and the shared padding stays within the head's one hidden entry."""
    real_accept, steps = Drafter.accept, [0]

    def in_turns(self, target_logits, drafts):
        accepted, nxt = real_accept(self, target_logits, drafts)
        B, k = drafts.shape
        turn = steps[0]
        steps[0] += 1
        cap = mx.array([k if (turn + r) % 2 == 0 else 0 for r in range(B)], dtype=accepted.dtype)
        capped = mx.minimum(accepted, cap)
        target = mx.take_along_axis(mx.argmax(target_logits, axis=-1), capped[:, None], axis=1)[:, 0]
        return capped, mx.where(capped < accepted, target, nxt)

    shared = []

    def watch(caches):
        from mlx_lm.models.cache import BatchKVCache

        shared.append(max(min(c.left_padding.tolist()) for c in caches if isinstance(c, BatchKVCache)))

    real_rollback, real_write = spec_batch.rollback, spec_batch.write_accepted

    def rollback(cache, records, fed, keep):
        watch(cache)
        return real_rollback(cache, records, fed, keep)

    def write_accepted(head, embed, caches, *args):
        watch(caches)
        return real_write(head, embed, caches, *args)

    monkeypatch.setattr(Drafter, "accept", in_turns)
    monkeypatch.setattr(spec_batch, "rollback", rollback)
    monkeypatch.setattr(spec_batch, "write_accepted", write_accepted)
    prompts = PROMPTS[:4]
    outs, stats = asyncio.run(_run(qwen3_5_mtp_path, prompts, {"max_tokens": 24}, mtp="on", mtp_depth=3,
                                   max_batch_size=4, prefix_cache_bytes=0))
    same_greedy_rows(outs, greedy_reference[:4], judge=qwen3_5_mtp_path, prompts=prompts)
    assert stats["mtp"]["accepted"] > 0 and len(shared) > 10
    assert max(shared) <= 1, shared
