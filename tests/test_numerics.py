"""The comparison of tests/numerics.py, exercised on any backend: outputs may part only at a
near-tie of the model's own logits, and nowhere else; with no tie allowed, nowhere."""

from __future__ import annotations

import mlx.core as mx
import pytest

from . import numerics
from .reference import _load, reference_greedy

N = 12


@pytest.fixture
def gpu_rules(monkeypatch):
    monkeypatch.setattr(numerics, "EXACT", False)
    monkeypatch.setattr(numerics, "NEAR_TIE", 0.05)


@pytest.fixture(params=["path", "engine"])
def judge(request, qwen3_5_path, qwen3_5_engine):
    return qwen3_5_path if request.param == "path" else qwen3_5_engine


def _ranked(path, ids):
    """Tokens by the reference model's next-token logit, best first, with the logits."""
    model, _ = _load(str(path))
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    return mx.argsort(-logits).tolist(), logits.tolist()


def test_identical_outputs_pass_on_every_backend(qwen3_5_path, judge):
    ids = [5, 17, 300, 41, 9]
    want = reference_greedy(qwen3_5_path, ids, N)
    assert numerics.same_greedy(list(want), want, judge=judge, prompt_ids=ids)


def test_with_no_tie_allowed_any_parting_fails(qwen3_5_path, monkeypatch):
    monkeypatch.setattr(numerics, "NEAR_TIE", 0.0)  # the CPU backend with mlx's bundled BLAS
    ids = [5, 17, 300, 41, 9]
    want = reference_greedy(qwen3_5_path, ids, N)
    order, _ = _ranked(qwen3_5_path, ids + want[:3])
    got = want[:3] + [order[1]] + want[4:]
    with pytest.raises(AssertionError, match="diverged"):
        numerics.same_greedy(got, want, judge=qwen3_5_path, prompt_ids=ids)


def test_batching_moves_a_decode_rows_logits_well_within_the_near_tie(qwen3_5_path):
    """What NEAR_TIE rests on: a one-token row's logits alone against the same row in a
    batch (OpenBLAS computes one row and many in different orders; the bundled BLAS not)."""
    model, _ = _load(str(qwen3_5_path))
    worst = 0.0
    for token in (5, 17, 300, 41, 9, 777):
        alone = model(mx.array([[token]]))[0, -1]
        for rows in (2, 3, 5, 8):
            batched = model(mx.array([[token]] * rows))[:, -1]
            worst = max(worst, mx.abs(batched - alone).max().item())
    if numerics.NEAR_TIE == 0:
        assert worst == 0.0
    else:
        assert worst <= numerics.NEAR_TIE / (10 if numerics.EXACT else 1), worst


def test_a_parting_passes_only_within_the_near_tie(gpu_rules, qwen3_5_path, judge, monkeypatch):
    ids = [5, 17, 300, 41, 9]
    want = reference_greedy(qwen3_5_path, ids, N)
    order, logits = _ranked(qwen3_5_path, ids + want[:3])
    assert order[0] == want[3]
    runner_up = want[:3] + [order[1]] + [0] * (N - 4)  # the rest is not compared
    gap = logits[order[0]] - logits[order[1]]

    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 1.01 + 1e-6)
    with pytest.warns(numerics.NearTieParting, match="parted at token 3"):
        assert numerics.same_greedy(runner_up, want, judge=judge, prompt_ids=ids) is False
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 0.99)
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_greedy(runner_up, want, judge=judge, prompt_ids=ids)
    # A token far down the ranking is a clear loser: an engine bug, not kernel noise.
    monkeypatch.setattr(numerics, "NEAR_TIE", 0.05)
    far = want[:3] + [order[len(order) // 2]] + want[4:]
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_greedy(far, want, judge=judge, prompt_ids=ids)


def test_an_early_stop_is_judged_against_the_best_eos(gpu_rules, qwen3_5_path):
    ids = [5, 17, 300, 41, 9]
    want = reference_greedy(qwen3_5_path, ids, N)
    order, logits = _ranked(qwen3_5_path, ids + want[:2])
    eos = max(_load(str(qwen3_5_path))[1].eos_token_ids, key=lambda t: logits[t])
    gap = logits[want[2]] - logits[eos]
    assert gap > 0.05  # the factory model does not nearly stop here
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_greedy(want[:2], want, judge=qwen3_5_path, prompt_ids=ids)


def test_gpu_tolerances_only_widen(monkeypatch):
    assert numerics.tolerance(1e-4, 1e-6) == ({"rtol": 1e-4, "atol": 1e-6} if numerics.EXACT else
                                              {"rtol": 1e-2, "atol": 1e-2})
    monkeypatch.setattr(numerics, "EXACT", False)
    assert numerics.tolerance(0.5, 0.2) == {"rtol": 0.5, "atol": 0.2}


def test_text_prompts_are_judged_as_the_engine_encodes_them(gpu_rules, qwen3_5_path, judge, monkeypatch):
    text = "alpha beta gamma"
    ids = _load(str(qwen3_5_path))[1].encode(text, add_special_tokens=False)
    want = reference_greedy(qwen3_5_path, ids, N)
    order, logits = _ranked(qwen3_5_path, ids + want[:3])
    gap = logits[order[0]] - logits[order[1]]
    runner_up = want[:3] + [order[1]]
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 1.01 + 1e-6)
    with pytest.warns(numerics.NearTieParting):
        assert numerics.same_greedy(runner_up, want, judge=judge, prompt_ids=text) is False
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 0.99)
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_greedy(runner_up, want, judge=judge, prompt_ids=text)


def _seeded(engine, ids, seed, temperature, n=N, **extra):
    from mlx_tandem import SamplingParams

    async def run():
        return await engine.complete(ids, SamplingParams(max_tokens=n, seed=seed, temperature=temperature, **extra))
    return run


async def test_a_seeded_draw_is_reconstructed_exactly(qwen3_5_path, qwen3_5_engine):
    """What same_draws rests on: each draw of a seeded row is the token whose bin of the
    CDF (logits over temperature) holds the uniform number of its key (mlx 0.32's
    categorical on one row). A changed sampler fails here, not as a false parting. The
    reference model's logits may differ from the engine's by rounding (OpenBLAS, a GPU): a
    draw rebuilt otherwise must then lie at a border, as same_draws judges."""
    ids = [5, 17, 300, 41, 9]
    for seed, temperature in ((3, 0.8), (11, 1.0), (12, 1.5)):
        out = list((await _seeded(qwen3_5_engine, ids, seed, temperature)()).token_ids)
        key = mx.random.key(seed)
        for i, tok in enumerate(out):
            key, sub = mx.random.split(key)
            _, logits = _ranked(qwen3_5_path, ids + out[:i])
            x = mx.array(logits)[None] * (1.0 / temperature)
            u = mx.random.uniform(shape=(1,), key=sub).item()
            rebuilt = int(mx.sum(mx.cumsum(mx.softmax(x, axis=-1), axis=-1)[0] <= u).item())
            if rebuilt != tok:
                numerics.same_draws(out[:i] + [rebuilt], out[:i + 1], judge=qwen3_5_path, prompt_ids=ids,
                                    seed=seed, temperature=temperature, what=f"seed {seed}")


async def test_a_draw_parts_only_next_to_the_border_it_lies_near(gpu_rules, qwen3_5_path, qwen3_5_engine,
                                                                 monkeypatch):
    ids = [5, 17, 300, 41, 9]
    seed, temperature = 3, 0.8
    want = list((await _seeded(qwen3_5_engine, ids, seed, temperature)()).token_ids)
    key = mx.random.key(seed)
    for _ in range(4):
        key, sub = mx.random.split(key)
    u = mx.random.uniform(shape=(1,), key=sub).item()
    _, logits = _ranked(qwen3_5_path, ids + want[:3])
    cdf = mx.cumsum(mx.softmax(mx.array(logits)[None] * (1.0 / temperature), axis=-1), axis=-1)[0].tolist()
    a = want[3]
    above, below = cdf[a] - u, u - (cdf[a - 1] if a else 0.0)  # to the next bin, to the one before
    neighbour, gap = (a + 1, above) if above < below else (a - 1, below)
    parted = want[:3] + [neighbour] + want[4:]
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * temperature * 1.01 + 1e-7)
    with pytest.warns(numerics.NearTieParting, match="parted at draw 3"):
        assert numerics.same_draws(parted, want, judge=qwen3_5_path, prompt_ids=ids, seed=seed,
                                   temperature=temperature) is False
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * temperature * 0.99)
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_draws(parted, want, judge=qwen3_5_path, prompt_ids=ids, seed=seed, temperature=temperature)
    # A token far from the draw's bin is an engine bug, not kernel noise.
    monkeypatch.setattr(numerics, "NEAR_TIE", 0.05)
    far = want[:3] + [(a + len(logits) // 2) % len(logits)] + want[4:]
    with pytest.raises(AssertionError, match="not a near-tie"):
        numerics.same_draws(far, want, judge=qwen3_5_path, prompt_ids=ids, seed=seed, temperature=temperature)


async def test_a_penalised_row_is_judged_on_its_penalised_logits(gpu_rules, qwen3_5_path, qwen3_5_engine):
    """repetition_penalty_scores gives what the engine's row takes the argmax of: its
    greedy output is the argmax of those scores at every step."""
    from mlx_tandem import SamplingParams

    ids = [5, 17, 300, 41, 9, 5, 17]
    n = 32
    out = await qwen3_5_engine.complete(ids, SamplingParams(max_tokens=n, repetition_penalty=1.3))
    scores = numerics.repetition_penalty_scores(1.3)
    plain = reference_greedy(qwen3_5_path, ids, n)
    assert list(out.token_ids) != list(plain)  # the penalty changes this output
    for i, tok in enumerate(out.token_ids):
        context = ids + list(out.token_ids[:i])
        _, logits = _ranked(qwen3_5_path, context)
        penalised = scores(logits, context)
        assert max(range(len(penalised)), key=penalised.__getitem__) == tok, i


async def test_answers_compared_as_text_are_judged_on_their_tokens(gpu_rules, qwen3_5_engine, monkeypatch):
    """AnswerLog: an adapter's answer that parts from its reference is judged on the
    recorded tokens of both requests: passed at a near-tie, failed past one."""
    from mlx_tandem import SamplingParams

    from .forcing import forcing_processor

    engine = qwen3_5_engine
    log = numerics.AnswerLog(monkeypatch)
    messages = [{"role": "user", "content": "which towns have boats"}]
    want = await engine.chat(messages, SamplingParams(max_tokens=N))
    assert len(log.outputs) == 1 and log.outputs[0].token_ids == want.token_ids
    ids = list(want.prompt_token_ids)
    logits = numerics._last_logits(engine, ids + want.token_ids[:3])
    order = sorted(range(len(logits)), key=lambda t: -logits[t])
    assert order[0] == want.token_ids[3]
    eos = engine.loaded.eos_token_ids[0]
    forced = want.token_ids[:3] + [order[1]] + want.token_ids[4:]
    got = await engine.chat(messages, SamplingParams(max_tokens=N, logits_processors=[forcing_processor(forced, eos)]))
    assert got.content != want.content
    gap = logits[order[0]] - logits[order[1]]
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 1.01 + 1e-6)
    with pytest.warns(numerics.NearTieParting, match="answer 0 parted at token 3"):
        assert log.same_answers([got.content], [want.content], judge=engine) == [False]
    monkeypatch.setattr(numerics, "NEAR_TIE", gap * 0.99)
    with pytest.raises(AssertionError, match="not a near-tie"):
        log.same_answers([got.content], [want.content], judge=engine)
    with pytest.raises(AssertionError, match="no recorded requests"):
        log.same_answers([got.content + "!"], [want.content], judge=engine)
    monkeypatch.setattr(numerics, "NEAR_TIE", 0.0)  # the bundled BLAS: text must be equal
    with pytest.raises(AssertionError, match="diverged"):
        log.same_answers([got.content], [want.content], judge=engine)


def test_mlx_imported_first_is_a_warning_with_its_remedy():
    """On Linux, OpenBLAS must be loaded before mlx. When the caller imported mlx first the
    engine runs on the wheel's reference BLAS (about 20x slower matmuls): that was a debug
    line only; it is a warning that says what to do."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("OpenBLAS is loaded on Linux only")
    code = "import logging; logging.basicConfig(); import mlx.core; import mlx_tandem"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" in proc.stderr and "import mlx_tandem first" in proc.stderr
    fine = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); import mlx_tandem, mlx.core"],
                          capture_output=True, text=True, timeout=120)
    assert "import mlx_tandem first" not in fine.stderr
