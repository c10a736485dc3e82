"""The demo-model training script: runs, checkpoints, resumes, and exports a checkpoint that
the engine (MLX) loads and computes exactly as the trainer (PyTorch) did."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_demo_model.py"


def _run(out: Path, steps: int, *extra: str) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(steps), "--batch", "4",
                           "--n-dialogues", "24", "--save-every", "1", "--max-len", "832", *extra],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _trainer_module():
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torch_logits(final: Path, ids: np.ndarray):
    """Backbone and MTP-head logits of the exported checkpoint, computed by the trainer's modules."""
    import torch
    from safetensors.torch import load_file

    T = _trainer_module()
    config = json.loads((final / "config.json").read_text())
    trainee = T.Trainee(T.Qwen3_5TextConfig(**config["text_config"])).float().eval()
    trainee.load_hf({k: v.float() for k, v in load_file(str(final / "model.safetensors")).items()})
    tokens = torch.from_numpy(ids)
    with torch.no_grad():
        inner = trainee.lm.model
        h = inner(input_ids=tokens).last_hidden_state
        hs = h[:, :-1]
        pos = torch.arange(hs.shape[1])[None]
        mtp = trainee.mtp(inner.embed_tokens(tokens[:, 1:]), hs, inner.rotary_emb(hs, pos[None].expand(3, -1, -1)))
        return trainee.lm.lm_head(h)[0].numpy(), trainee.lm.lm_head(mtp)[0].numpy()


def _mlx_logits(final: Path, ids: np.ndarray):
    """The same logits as the engine computes them: mlx-lm's model and the engine's MTP head."""
    from mlx_lm.utils import load_model

    from mlx_tandem.spec.mtp_head import load_mtp_head

    model, config = load_model(final)
    model.set_dtype(mx.float32)
    lm = getattr(model, "language_model", model)
    x = mx.array(ids)
    h = lm.model(x)
    head = load_mtp_head(final, lm, config, dtype=mx.float32)
    mtp = head(lm.model.embed_tokens(x[:, 1:]), h[:, :-1])
    return np.array(lm.lm_head(h)[0]), np.array(lm.lm_head(mtp)[0])


# The second run resumes inside the warm-up (a copy step, then a lookup step) and goes on
# through a dialogue step, a selection-drill step and a drill step, on a wider MLP.
WARMUP = ("--copy-warmup-steps", "1", "--lookup-steps", "1", "--drill-every", "3", "--copy-warmup-length", "48",
          "--init", "hf", "--rope-theta", "10000", "--intermediate-size", "896", "--selection-every", "2",
          "--n-selections", "12")


@pytest.mark.parametrize("options", [(), WARMUP, ("--bf16",)], ids=["defaults", "drills-hf-init-theta", "bf16"])
def test_train_resume_export(tmp_path, options):
    from mlx_tandem import Engine

    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    steps = 5 if options == WARMUP else 3
    _run(resumed, 1, *options)
    assert json.loads((resumed / "checkpoint" / "state.json").read_text()) == {"step": 1}
    log = _run(resumed, steps, *options)
    assert "resumed at step 1" in log
    _run(straight, steps, *options)

    # A resumed run ends with exactly the weights of an uninterrupted one.
    final = resumed / "final"
    weights = mx.load(str(final / "model.safetensors"))
    reference = mx.load(str(straight / "final" / "model.safetensors"))
    assert weights.keys() == reference.keys()
    assert all(mx.array_equal(weights[k], reference[k]).item() for k in weights)

    assert any(k.startswith("mtp.") for k in weights)
    assert all(v.dtype == mx.float16 for v in weights.values())
    assert (final / "model.safetensors").stat().st_size < 25 * 2**20
    text_config = json.loads((final / "config.json").read_text())["text_config"]
    assert text_config["rope_parameters"]["rope_theta"] == (10000 if options == WARMUP else 1e7)
    assert text_config["intermediate_size"] == (896 if options == WARMUP else 768)

    # MLX computes what PyTorch trained: backbone and MTP head, over a sequence long enough
    # for several GatedDeltaNet chunks.
    ids = np.random.default_rng(0).integers(0, 2000, size=(1, 150)).astype(np.int64)
    torch_main, torch_mtp = _torch_logits(final, ids)
    mlx_main, mlx_mtp = _mlx_logits(final, ids)
    for ours, theirs in ((mlx_main, torch_main), (mlx_mtp, torch_mtp)):
        assert np.abs(ours - theirs).max() < 2e-2 * np.abs(theirs).max()

    engine = Engine(final, show_progress=False)
    try:
        out = engine.chat_sync([{"role": "user", "content": "hi"}], {"max_tokens": 4})
        assert out.usage.completion_tokens == 4 or out.finish_reason == "stop"
    finally:
        engine.close_sync()


def test_bf16_autocast_trains_the_same_model_at_lower_precision(tmp_path):
    """--bf16 changes the arithmetic, not what is trained: after the same steps on the same
    batches its weights moved from the initial ones the way float32's did, not exactly alike."""
    moved = {}
    for name, extra in (("fp32", ()), ("bf16", ("--bf16",))):
        _run(tmp_path / name, 3, "--lr", "1e-3", *extra)
        final = mx.load(str(tmp_path / name / "final" / "model.safetensors"))
        init = mx.load(str(tmp_path / name / "init" / "model.safetensors"))
        moved[name] = np.concatenate([np.array(final[k].astype(mx.float32) - init[k].astype(mx.float32)).ravel()
                                      for k in sorted(init)])
    fp32, bf16 = moved["fp32"], moved["bf16"]
    # Measured: cosine 0.99, the difference 14% of float32's update (Adam moves every weight
    # by about the lr, so a sign flipped by rounding on a tiny gradient counts in full).
    assert fp32 @ bf16 / (np.linalg.norm(fp32) * np.linalg.norm(bf16)) > 0.9
    assert 0 < np.linalg.norm(fp32 - bf16) < 0.5 * np.linalg.norm(fp32)


def test_training_step_benchmark(tmp_path):
    """benchmarks/training_step.py runs end to end (it is not run elsewhere in the suite), and
    its ratios are those of the tokens/s it reports."""
    out = tmp_path / "training_step.json"
    bench = SCRIPT.parents[1] / "benchmarks" / "training_step.py"
    proc = subprocess.run([sys.executable, str(bench), str(out), "--steps", "1", "--batch", "2", "--length", "48"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    tok_s = result["tokens_per_s"]
    assert set(tok_s) == {"torch", "torch_bf16", "mlx"} and all(v > 0 for v in tok_s.values())
    assert result["torch_over_mlx"] == pytest.approx(tok_s["torch"] / tok_s["mlx"])
    assert result["torch_bf16_over_torch"] == pytest.approx(tok_s["torch_bf16"] / tok_s["torch"])
    assert out.with_suffix(".png").exists()


def test_word_consistent_tokenizer_option(tmp_path):
    """--word-consistent-tokenizer trains the tokenizer on the run's own dialogues, with merges
    inside words only: a word splits the same after a space as alone."""
    from transformers import AutoTokenizer

    from mlx_tandem.testing.factory import make_tiny_model

    _run(tmp_path, 1, "--word-consistent-tokenizer")
    tok = AutoTokenizer.from_pretrained(tmp_path / "init")
    records = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    word = max((w for r in records for m in r["messages"] for w in (m.get("content") or "").split()
                if w.isalpha()), key=len)
    assert tok.encode(" " + word) == tok.encode(" ") + tok.encode(word)
    make_tiny_model("qwen3_5", tmp_path / "plain", seed=0)
    plain = AutoTokenizer.from_pretrained(tmp_path / "plain")  # the plain factory tokenizer
    # The dialogues are in its corpus: the run's own text takes fewer tokens than with the plain tokenizer.
    text = "\n".join(_trainer_module().rendered_texts(records))
    assert len(tok.encode(text)) < len(plain.encode(text))


def test_training_batches_schedule():
    """Copy drills, then lookup drills, then the dialogues with every Nth step a drill (copy
    and lookup in turn); with no drills asked for, exactly the dialogue batches."""
    import torch

    T = _trainer_module()
    rng = np.random.default_rng(0)
    examples = [(rng.integers(10, 500, n).tolist(), [1] * n) for n in rng.integers(20, 60, 40)]

    def take(n, **kw):
        data = T.training_batches(examples, batch_size=4, seed=3, vocab=1000, pad_id=0, **kw)
        return [next(data) for _ in range(n)]

    plain = take(6)
    dialogues = T.batches(examples, 4, 3, 0)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(plain, dialogues))

    mixed = take(10, copy_steps=2, copy_length=32, lookup_steps=1, drill_every=3)
    kinds = ["copy" if t.shape == (8, 32) else "lookup" if t.shape == (16, T.LOOKUP_LENGTH) else "dialogue"
             for t, *_ in mixed]
    assert kinds == ["copy", "copy", "lookup", "dialogue", "dialogue", "copy", "dialogue", "dialogue", "lookup",
                     "dialogue"]
    # The dialogues are the same batches, in the same order, as without drills.
    assert all(torch.equal(t, p[0]) for (t, *_), p in zip([b for b, k in zip(mixed, kinds) if k == "dialogue"], plain))
    # Only the lookup drills carry their answers' starts (what --lookup-until-first-id judges).
    assert [b[2] is not None for b in mixed] == [k == "lookup" for k in kinds]
    # The lookup marks are the last four plain tokens; the drills draw from the seed.
    lookup = mixed[2][0]
    assert lookup.max() <= 999 and (lookup == 996).any()
    again = take(10, copy_steps=2, copy_length=32, lookup_steps=1, drill_every=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(mixed, again))

    # Selection drills take every Nth dialogue-phase step unless a copy or lookup drill falls on it.
    selections = [([7] * n, [0] * (n - 2) + [1, 1]) for n in rng.integers(20, 60, 12)]
    picked = take(12, copy_steps=1, copy_length=32, drill_every=4, selections=selections, selection_every=2)
    kinds = ["copy" if t.shape == (8, 32) else "lookup" if t.shape == (16, T.LOOKUP_LENGTH)
             else "selection" if (t == 7).any() else "dialogue" for t, *_ in picked]
    assert kinds == ["copy", "dialogue", "selection", "dialogue", "copy", "dialogue", "selection", "dialogue",
                     "lookup", "dialogue", "selection", "dialogue"]
    assert all(torch.equal(t, p[0]) for (t, *_), p in zip([b for b, k in zip(picked, kinds) if k == "dialogue"], plain))
    # At 1, every step that is not a copy or lookup drill is a batch of selection drills.
    alone = take(8, copy_length=32, drill_every=4, selections=selections, selection_every=1)
    kinds = ["copy" if t.shape == (8, 32) else "lookup" if t.shape == (16, T.LOOKUP_LENGTH)
             else "selection" if ((t == 7) | (t == 0)).all() else "other" for t, *_ in alone]
    assert kinds == ["selection"] * 3 + ["copy"] + ["selection"] * 3 + ["lookup"]


def _probe_module():
    spec = importlib.util.spec_from_file_location("probe_tool_selection", SCRIPT.parent / "probe_tool_selection.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_probe_made_up_split():
    """The probe's made-up split: fresh dialogues over tools from ``synthetic_tools``, each
    calling a listed tool, the right one not always listed first, the same for the same seed."""
    probe = _probe_module()

    records = probe.made_up_records(60, seed=7)
    assert records == probe.made_up_records(60, seed=7) and len(records) == 60
    firsts = []
    for r in records:
        listed = [t["function"]["name"] for t in r["tools"]]
        calls = [c["function"]["name"] for m in r["messages"] for c in m.get("tool_calls") or []]
        assert calls and set(calls) <= set(listed)
        firsts.append(listed.index(calls[0]))
    assert max(firsts) > 0  # shuffled: a model cannot learn "the first listed"


def _calls(record) -> list[str]:
    return [c["function"]["name"] for m in record["messages"] for c in m.get("tool_calls") or []]


def test_probe_prefixed_records_rename_every_listed_tool_and_its_calls_alike():
    """``--prefixed``: every listed name gets its own prefix, each call follows its tool, and a
    request that quoted the name quotes the new one."""
    probe = _probe_module()

    records = probe.made_up_records(60, seed=8)
    renamed = probe.prefixed_records(records, seed=1)
    multi = [r for r in records if len(r["tools"]) >= 2 and r["messages"][1].get("tool_calls")]
    assert len(renamed) == len(multi) > 10 and renamed == probe.prefixed_records(records, seed=1)
    for old, new in zip(multi, renamed):
        names = {a["function"]["name"]: b["function"]["name"] for a, b in zip(old["tools"], new["tools"])}
        assert all(b != a and b.lower().endswith(a.lower()) for a, b in names.items())
        described = [(a["function"]["description"], b["function"]["description"])
                     for a, b in zip(old["tools"], new["tools"])]
        assert all(a == b for a, b in described)
        assert _calls(new) == [names[c] for c in _calls(old)]


def test_probe_ablated_tools_change_one_part_of_every_entry_of_a_copy():
    probe = _probe_module()
    tools = next(r["tools"] for r in probe.made_up_records(30, seed=9) if len(r["tools"]) >= 2)
    before = json.dumps(tools)
    for part, key in (("descriptions", "description"), ("parameters", "parameters"), ("names", "name")):
        blind = probe.ablated_tools(tools, part)
        for old, new in zip(tools, blind, strict=True):
            changed = {k for k in old["function"] if old["function"][k] != new["function"][k]}
            assert changed == {key}, part
        names = [t["function"]["name"] for t in blind]
        assert len(set(names)) == len(names)
    assert json.dumps(tools) == before  # a copy: the probe decides on both lists
    rotated = probe.ablated_tools(tools, "rotated")
    assert [t["function"]["description"] for t in rotated] == [
        t["function"]["description"] for t in tools[1:] + tools[:1]]
    assert [t["function"]["name"] for t in rotated] == [t["function"]["name"] for t in tools]
    with pytest.raises(ValueError):
        probe.ablated_tools(tools, "types")


def test_probe_ablation_decides_again_on_the_emptied_list(monkeypatch):
    """``--ablate``: each selection is decided a second time, on the list without that part;
    where the part was empty already, the second decision is the first one, pick for pick."""
    import torch

    probe = _probe_module()
    model = Path(__file__).resolve().parents[2] / "src" / "mlx_tandem" / "models"
    tok, trainee, _ = probe.load(next(model.iterdir()))

    def calls_first(r):
        return next(m for m in r["messages"] if m["role"] == "assistant").get("tool_calls")

    records = [r for r in probe.held_out_examples(120, seed=4)
               if r["kind"] == "tool" and len(r["tools"]) >= 2 and calls_first(r)][:4]
    blank = [{**r, "tools": probe.ablated_tools(r["tools"], "descriptions")} for r in records]
    seen = []
    template = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda msgs, tools=None, **kw: (
        seen.append(json.dumps(tools)), template(msgs, tools=tools, **kw))[1])
    with torch.no_grad():
        res = probe.probe(tok, trainee, blank, ablate="descriptions")
        assert res["n_selection"] == len(records)
        assert res["same_pick"] == 1.0 and res["selection_ablated"] == res["selection"]
        seen.clear()
        probe.probe(tok, trainee, records[:1], ablate="names")
        # Where two listed names part, the greedy pick is the one with the larger share there.
        parted = 0
        for r in probe.held_out_examples(200, seed=5):
            if r["kind"] != "tool" or len(r["tools"]) != 2 or not calls_first(r):
                continue
            one = probe.probe(tok, trainee, [r])
            if one["n_domain"] == 1:
                assert 0 < one["parting_mass_domain"] <= 1
                assert (one["selection_domain"] == 1.0) == (one["parting_share_domain"] > 0.5), one
                assert one["parting_share_domain_chance"] == 0.5  # two names part into two tokens
                parted += 1
        assert parted >= 3
    assert any('"tool_a"' in t for t in seen) and any(records[0]["tools"][0]["function"]["name"] in t for t in seen)


def _drive(warmup, losses, n, *, replay=0, lookup=1, lookup_losses=()):
    """Draw ``n`` steps from ``training_batches`` with ``warmup`` deciding the copy warm-up and
    ``lookup`` the lookup drills, feeding each phase its next loss (``losses[i]`` after warm-up
    step i, ``lookup_losses[j]`` after lookup step j) as the trainer does; the first ``replay``
    draws are a resumed run's replay (no losses). Returns the batches and their kinds."""
    T = _trainer_module()
    rng = np.random.default_rng(0)
    examples = [(rng.integers(10, 500, k).tolist(), [1] * k) for k in rng.integers(20, 60, 40)]
    data = T.training_batches(examples, batch_size=4, seed=3, vocab=1000, pad_id=0, copy_steps=warmup,
                              copy_length=32, lookup_steps=lookup)
    phases = (warmup, T.DrillPhase(lookup) if isinstance(lookup, int) else lookup)
    out, looked = [], 0
    for i in range(n):
        tokens, *_ = next(data)
        phase = T.drill_phase_of(i, *phases)
        if phase == "copy" and i >= replay:
            warmup.record(losses[i])
        elif phase == "lookup":
            if i >= replay and looked < len(lookup_losses):  # a fixed count needs none
                phases[1].record(lookup_losses[looked])
            looked += 1
        out.append(tokens)
    kinds = ["copy" if t.shape == (8, 32) else "lookup" if t.shape == (16, T.LOOKUP_LENGTH) else "dialogue"
             for t in out]
    return out, kinds


def test_copy_warmup_goes_on_until_the_head_forms_and_resumes_where_it_would_end():
    """With a target, the copy warm-up outlasts its minimum until the mean repeat loss of its
    last steps is at or under the target; a run resumed inside it ends it at the same step."""
    import torch

    T = _trainer_module()
    losses = [7.6, 7.6, 7.5, 0.5, 0.1, 0.1, 0.1]
    warmup = T.DrillPhase(2, target=1.0, max_steps=10, window=2)
    batches, kinds = _drive(warmup, losses, 7)
    # Means over two steps: 7.6, 7.55, 4.0, then 0.3 after step 5.
    assert kinds == ["copy"] * 5 + ["lookup", "dialogue"]
    assert warmup.end == 5 and not warmup.failed

    # Without a target the count alone decides, as before.
    _, plain = _drive(T.DrillPhase(2), losses, 4)
    assert plain == ["copy", "copy", "lookup", "dialogue"]

    # A checkpoint after step 3 (state saved then), resumed: the same batches, the same end.
    at3 = T.DrillPhase(2, target=1.0, max_steps=10, window=2)
    _drive(at3, losses, 3)
    resumed = T.DrillPhase(2, target=1.0, max_steps=10, window=2)
    resumed.restore(json.loads(json.dumps(at3.state())), 3)
    again, kinds_again = _drive(resumed, losses, 7, replay=3)
    assert kinds_again == kinds and resumed.end == 5
    assert all(torch.equal(a, b) for a, b in zip(batches, again))


def test_copy_warmup_gives_up_at_its_cap():
    T = _trainer_module()
    warmup = T.DrillPhase(2, target=1.0, max_steps=4)
    _, kinds = _drive(warmup, [7.6] * 10, 5)
    assert kinds == ["copy"] * 4 + ["lookup"]
    assert warmup.failed and warmup.state()["end"] is None  # undecided on disk: a larger cap resumes it


def test_lookup_drills_go_on_until_learned_and_resume_where_they_would_end():
    """The lookup drills, given a target, decide their end the same way, counted from the end of
    the copy warm-up; the learning rate holds its peak through both phases as far as decided."""
    import torch

    T = _trainer_module()
    lookup_losses = [6.0, 6.0, 5.0, 1.0, 1.0, 1.0]

    def phases():
        return T.DrillPhase(2), T.DrillPhase(1, target=2.5, max_steps=10, window=2)

    copy, lookup = phases()
    batches, kinds = _drive(copy, [7.0] * 9, 9, lookup=lookup, lookup_losses=lookup_losses)
    # Means over two lookup steps: 6.0, 6.0, 5.5, 3.0, then 1.0 after the fifth.
    assert kinds == ["copy"] * 2 + ["lookup"] * 5 + ["dialogue"] * 2
    assert lookup.end == 5 and not lookup.failed
    assert T.constant_lr_steps(8, copy, lookup) == 7
    # With --dialogue-steps the run's length follows the drills: 2 + 5 drill steps, then 3.
    assert T.total_steps(copy, lookup, 100, 3) == 10 and T.total_steps(copy, lookup, 100, None) == 100

    # A checkpoint after step 5 (three lookup steps in), resumed: the same batches, the same end.
    at5 = phases()
    _drive(*at5[:1], [7.0] * 5, 5, lookup=at5[1], lookup_losses=lookup_losses)
    assert T.constant_lr_steps(4, *at5) == 5  # undecided: the peak holds at least to the next step
    assert T.total_steps(*at5, 100, 3) is None  # and so is the run's length
    copy2, resumed = phases()
    resumed.restore(json.loads(json.dumps(at5[1].state())), 5 - copy2.end)
    again, kinds_again = _drive(copy2, [7.0] * 9, 9, replay=5, lookup=resumed, lookup_losses=lookup_losses)
    assert kinds_again == kinds and resumed.end == 5
    assert all(torch.equal(a, b) for a, b in zip(batches, again))

    # At its cap with the loss still high: failed, and undecided on disk.
    copy, capped = T.DrillPhase(2), T.DrillPhase(1, target=2.5, max_steps=3)
    _, kinds = _drive(copy, [7.0] * 6, 6, lookup=capped, lookup_losses=[6.0] * 6)
    assert kinds == ["copy"] * 2 + ["lookup"] * 3 + ["dialogue"]
    assert capped.failed and capped.state()["end"] is None


def test_first_id_of_lookup_drills_is_read_at_each_answer_start(tmp_path):
    """``Trainee.losses`` with the answer starts: the share of rows whose answer's first token
    is the backbone's argmax, read at the right position. Rows whose first answer token is set
    to the model's own pick count, the others not (a later token cannot change that pick: the
    model is causal)."""
    import torch

    from mlx_tandem.testing.factory import make_tiny_model

    sys.path.insert(0, str(SCRIPT.parent))
    from copy_drills import lookup_batch

    T = _trainer_module()
    make_tiny_model("qwen3_5", tmp_path / "model", seed=0)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    trainee = T.Trainee(T.Qwen3_5TextConfig(**config["text_config"])).float().eval()
    vocab = config["text_config"]["vocab_size"] - 8
    tokens, mask, starts = lookup_batch(torch.Generator().manual_seed(0), 12, T.LOOKUP_LENGTH, 0, vocab - 4,
                                        T.lookup_marks(vocab))
    rows = torch.arange(12)
    with torch.no_grad():
        picks = trainee.lm(input_ids=tokens).logits[rows, starts - 1].argmax(-1)
        hit = torch.tensor([r % 3 == 0 for r in range(12)])  # 4 of 12
        tokens[rows, starts] = torch.where(hit, picks, (picks + 1) % vocab)
        main, _, first_id = trainee.losses(tokens, mask, starts)
        assert first_id == pytest.approx(4 / 12)  # a float32 mean
        assert trainee.losses(tokens, mask)[2] is None and torch.equal(trainee.losses(tokens, mask)[0], main)


def _fail_then_resume(out: Path, common: list[str], failing: list[str], resuming: list[str], message: str):
    """Run the trainer with ``failing`` options: it must exit 1 with ``message`` in its log,
    export nothing and keep its checkpoint. Then rerun it with ``resuming``: it must finish and
    export. Returns the failed run's checkpoint state and the resumed run's log."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    base = [sys.executable, str(SCRIPT), "--out", str(out), "--batch", "4", "--n-dialogues", "24", "--save-every",
            "1", "--max-len", "832", "--copy-warmup-steps", "1", "--copy-warmup-length", "48", "--init", "hf", *common]
    proc = subprocess.run([*base, *failing], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert not (out / "final").exists()
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    proc = subprocess.run([*base, *resuming], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "final" / "model.safetensors").exists()
    return state, proc.stderr


def test_trainer_stops_without_a_head_and_resumes_with_a_larger_cap(tmp_path):
    """No head by --copy-warmup-max-steps: exit 1 with the reason and nothing exported, the
    checkpoint kept; rerun with a looser target, it resumes and finishes."""
    state, log = _fail_then_resume(tmp_path, ["--steps", "4"],
                                   ["--copy-warmup-until", "0.001", "--copy-warmup-max-steps", "2"],
                                   ["--copy-warmup-until", "100"], "no induction head after 2 copy steps")
    assert state["step"] == 2 and state["copy_warmup"]["end"] is None and len(state["copy_warmup"]["losses"]) == 2
    assert "resumed at step 2" in log and "copy warm-up done after 2 steps" in log


def test_trainer_stops_when_lookup_is_not_learned_and_resumes_with_a_larger_cap(tmp_path):
    """Lookup not learned by --lookup-max-steps: exit 1 with the reason and nothing exported, the
    checkpoint kept; rerun with a looser target, it resumes inside the lookup drills and finishes.
    Resumed with --dialogue-steps 3: 1 copy + 2 lookup steps, then 3 dialogue steps (not --steps 5)."""
    state, log = _fail_then_resume(tmp_path, ["--steps", "5", "--lookup-steps", "1"],
                                   ["--lookup-until", "0.001", "--lookup-max-steps", "2"],
                                   ["--lookup-until", "100", "--dialogue-steps", "3"],
                                   "lookup not learned after 2 lookup steps")
    assert state["step"] == 3 and state["lookup"]["end"] is None and len(state["lookup"]["losses"]) == 2
    assert "copy_warmup" not in state  # no target for the copy warm-up: nothing to keep
    assert "resumed at step 3" in log and "lookup drills done after 2 steps" in log
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text())["step"] == 6


def test_lookup_judged_by_its_first_id(tmp_path):
    """--lookup-until-first-id: the lookup phase records the share of rows that miss the
    answer's first id; not reached by --lookup-max-steps, the run stops with that measure in
    its reason, and resumed with a target it meets, it finishes. It replaces --lookup-until."""
    state, log = _fail_then_resume(tmp_path, ["--steps", "5", "--lookup-steps", "1"],
                                   ["--lookup-until-first-id", "1.0", "--lookup-max-steps", "2"],
                                   ["--lookup-until-first-id", "0", "--dialogue-steps", "3"],
                                   "lookup not learned after 2 lookup steps (lookup first-id miss rate")
    misses = state["lookup"]["losses"]
    assert len(misses) == 2 and all(0 < m <= 1 for m in misses)  # an untrained model misses some of 16
    assert "lookup drills done after 2 steps: lookup first-id miss rate" in log
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "both"), "--lookup-until", "3",
                           "--lookup-until-first-id", "0.5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "replaces --lookup-until" in proc.stderr


def test_time_fit_fills_what_is_left_of_the_budget():
    """--time-budget: the dialogue steps that fit in what is left, from the first timed ones."""
    T = _trainer_module()
    fit = T.TimeFit(100.0)
    assert all(fit.record(0.5, done) is None for done in range(1, T.FIT_PROBE_STEPS))
    fitted = fit.record(0.5, T.FIT_PROBE_STEPS)  # (100 s - the moment spent here) / 0.5 s, plus the timed steps
    assert T.FIT_PROBE_STEPS + 195 <= fitted <= T.FIT_PROBE_STEPS + 199 and fit.step_time == 0.5
    spent = T.TimeFit(60.0, started=time.perf_counter() - 61)  # the budget counts from the run's start
    assert [spent.record(1.0, d) for d in range(1, T.FIT_PROBE_STEPS + 1)][-1] == T.FIT_PROBE_STEPS  # none left
    resumed = T.TimeFit(60.0, started=time.perf_counter() - 61)  # steps done before a resume count
    assert [resumed.record(1.0, d) for d in range(11, T.FIT_PROBE_STEPS + 11)][-1] == T.FIT_PROBE_STEPS + 10


def test_time_fit_refits_as_the_pace_changes():
    """Run 39 fitted once from 20 steps and ran 7 minutes over: the fit is retaken every
    REFIT_EVERY steps from the latest REFIT_WINDOW, so a run whose steps slow down still ends
    within its budget, and one whose steps speed up uses what it gains."""
    T = _trainer_module()
    now = [0.0]
    fit = T.TimeFit(1000.0, started=0.0, clock=lambda: now[0])

    def steps(n: int, seconds: float, done: int) -> tuple[int, list]:
        fits = []
        for _ in range(n):
            now[0] += seconds
            done += 1
            fits.append(fit.record(seconds, done))
        return done, [f for f in fits if f is not None]

    done, fits = steps(T.FIT_PROBE_STEPS, 1.0, 0)
    assert fits == [T.FIT_PROBE_STEPS + 980]  # 980 s left at 1 s a step
    done, fits = steps(T.REFIT_EVERY - 1, 2.0, done)
    assert fits == []  # between refits the last fit holds
    done, fits = steps(1, 2.0, done)
    slow = (T.FIT_PROBE_STEPS + 2 * T.REFIT_EVERY) / (T.FIT_PROBE_STEPS + T.REFIT_EVERY)  # mean s a step
    left = 1000.0 - now[0]
    assert fits == [done + int(left / slow)] and fit.step_time == slow
    assert fits[0] < T.FIT_PROBE_STEPS + 980  # slower: fewer steps
    done, fits = steps(T.REFIT_WINDOW, 0.5, done)  # faster, and the window forgets the slow ones
    assert fit.step_time == 0.5 and fits[-1] == done + int((1000.0 - now[0]) / 0.5)
    now[0] = 2000.0  # over budget: no steps beyond those done
    done, fits = steps(T.REFIT_EVERY, 0.5, done)
    assert fits == [done]


def test_prepare_then_train_within_a_time_budget(tmp_path):
    """--prepare-only writes what training reads and trains nothing; a --time-budget run then
    fits its dialogue steps (here none beyond the timed ones: the budget is spent), keeps them in
    its checkpoint, and a rerun resumes the finished run and only exports. --num-layers sizes
    the model."""
    log = _run(tmp_path, 1, "--prepare-only", "--num-layers", "2")
    assert "prepared" in log
    assert {"data.jsonl", "examples.json", "init"} <= {p.name for p in tmp_path.iterdir()}
    assert not (tmp_path / "checkpoint").exists() and not (tmp_path / "final").exists()
    budget = ("--num-layers", "2", "--time-budget", "0.0001")
    fitted = _trainer_module().FIT_PROBE_STEPS
    log = _run(tmp_path, 1, *budget)
    assert f"time budget: {fitted} dialogue steps fitted" in log
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text()) == {"step": fitted,
                                                                               "dialogue_steps": fitted}
    assert json.loads((tmp_path / "final" / "config.json").read_text())["text_config"]["num_hidden_layers"] == 2
    log = _run(tmp_path, 1, *budget)
    assert f"resumed at step {fitted}" in log and "fitted" not in log


def test_a_fitted_schedule_survives_a_resume_without_the_budget(tmp_path):
    """A run fitted by --time-budget and stopped early keeps its fitted schedule when it is
    resumed without the option (the learning rate must go on decaying over the same steps)."""
    probe = _trainer_module().FIT_PROBE_STEPS
    _run(tmp_path, 1, "--num-layers", "2", "--time-budget", "30", "--stop-after", str(probe + 1))
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["step"] == probe + 1 and state["dialogue_steps"] > probe + 1
    log = _run(tmp_path, 1, "--num-layers", "2", "--stop-after", str(probe + 2))
    assert f"resumed at step {probe + 1}" in log
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text()) == {
        "step": probe + 2, "dialogue_steps": state["dialogue_steps"]}


def test_encoded_dialogues_cache_survives_a_tokenizers_upgrade():
    """The encoding cache's key reads the tokenizer's serialization with null as "": tokenizers
    0.23.2 and 0.23.3 serialize the same BPE model differently, and the same dialogues must
    not be re-encoded (minutes for 80,000) on a machine with the other version. Any real
    change (a merge) still changes the key."""
    from types import SimpleNamespace

    T = _trainer_module()

    def tok(model: dict):
        return SimpleNamespace(backend_tokenizer=SimpleNamespace(to_str=lambda: json.dumps({"model": model})))

    old = {"type": "BPE", "continuing_subword_prefix": None, "merges": [["a", "b"]], "vocab": {"a": 0, "b": 1}}
    new = {**old, "continuing_subword_prefix": ""}
    assert T._tokenizer_fingerprint(tok(old)) == T._tokenizer_fingerprint(tok(new))
    assert T._tokenizer_fingerprint(tok(old)) != T._tokenizer_fingerprint(tok({**old, "merges": [["b", "a"]]}))


def test_encoded_dialogues_cache_is_kept_per_chat_template(tmp_path):
    """The same records and tokenizer under another chat template are other tokens: the cache
    encodes them again instead of handing back the old template's (run 34 changed only the
    template and would have trained on the stale encoding)."""
    from transformers import AutoTokenizer

    from mlx_tandem.testing.factory import make_tiny_model

    sys.path.insert(0, str(SCRIPT.parent))
    from demo_data import generate

    T = _trainer_module()
    make_tiny_model("qwen3_5", tmp_path / "model", seed=0)
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    records = [r for r in generate(60, seed=3) if r.get("tools")][:4]
    assert records
    cache = tmp_path / "examples.json"
    before = T.load_examples(tok, records, 4096, cache)
    assert T.load_examples(tok, records, 4096, cache) == before  # the same template: read back
    tok.chat_template = tok.chat_template.replace("# Tools", "# Functions")
    after = T.load_examples(tok, records, 4096, cache)
    assert after != before and after == T.load_examples(tok, records, 4096, None)


def test_kept_records_are_checked_against_the_options_that_made_them(tmp_path):
    """A run directory's generated records are reused only for the options that made them: a
    resume with another drill option stops with an error instead of training on the old drills
    (a resume with another --selection-lexical once did). Records another tool wrote, with no
    options beside them (``demo_data.py --json-top-up``, run 32b), are taken as they are."""
    T = _trainer_module()
    made = []

    def make(tag):
        made.append(tag)
        return [{"tag": tag, "i": i} for i in range(3)]

    path = tmp_path / "selections.jsonl"
    first = T.load_records(path, lambda: make("a"), {"lexical": 0.5, "seed": 1})
    assert first == [{"tag": "a", "i": i} for i in range(3)] and made == ["a"]
    assert T.load_records(path, lambda: make("b"), {"seed": 1, "lexical": 0.5}) == first and made == ["a"]
    with pytest.raises(T.StaleRecords, match="lexical"):
        T.load_records(path, lambda: make("c"), {"lexical": 1.0, "seed": 1})
    assert made == ["a"]
    written = tmp_path / "data.jsonl"
    written.write_text(json.dumps({"tag": "top-up"}) + "\n")
    assert T.load_records(written, lambda: make("d"), {"n": 5}) == [{"tag": "top-up"}] and made == ["a"]


def test_trainer_refuses_drills_made_with_other_options(tmp_path):
    """The trainer turns stale records into a command-line error, naming the file."""
    drills = ("--prepare-only", "--num-layers", "2", "--selection-every", "2", "--n-selections", "8")
    _run(tmp_path, 1, *drills)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", "1", "--batch", "4",
                           "--n-dialogues", "24", "--max-len", "832", *drills, "--selection-lexical", "1.0"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "selections.jsonl was generated with" in proc.stderr


def test_drills_alone_encode_no_dialogues(tmp_path):
    """--selection-every 1 trains on selection drills alone: the dialogues it never uses are
    not encoded (no cache written), while the drills are."""
    _run(tmp_path, 1, "--prepare-only", "--num-layers", "2", "--selection-every", "1", "--n-selections", "8")
    assert (tmp_path / "selection_examples.json").exists()
    assert not (tmp_path / "examples.json").exists()
    _run(tmp_path / "both", 1, "--prepare-only", "--num-layers", "2", "--selection-every", "2", "--n-selections", "8")
    assert (tmp_path / "both" / "examples.json").exists()


def test_write_jsonl_leaves_no_partial_file(tmp_path, monkeypatch):
    """A write that fails part-way leaves no data file, so the next run regenerates instead of
    training on half the records; a whole write replaces the file, and a missing directory is made."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from demo_data import write_jsonl

    def failing():
        yield {"a": 1}
        raise RuntimeError("killed")

    path = tmp_path / "data.jsonl"
    with pytest.raises(RuntimeError):
        write_jsonl(failing(), path)
    assert list(tmp_path.iterdir()) == []  # neither the data nor its partial write
    write_jsonl([{"a": 1}, {"b": 2}], path)
    write_jsonl([{"c": 3}], path)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"c": 3}]
    nested = tmp_path / "run" / "data.jsonl"  # demo_data.py --out into a directory not made yet
    write_jsonl([{"d": 4}], nested)
    assert [json.loads(line) for line in nested.read_text().splitlines()] == [{"d": 4}]


def test_init_from_goes_on_from_an_exported_model(tmp_path):
    """--init-from starts from a run's exported weights, tokenizer and config: one step at a
    tiny learning rate stays next to them, where a fresh start is far away."""
    first, second = tmp_path / "first", tmp_path / "second"
    _run(first, 3, "--num-layers", "2", "--lr", "0.02")
    _run(second, 1, "--init-from", str(first / "final"), "--lr", "1e-6")
    assert (second / "init" / "tokenizer.json").read_bytes() == (first / "final" / "tokenizer.json").read_bytes()
    before = mx.load(str(first / "final" / "model.safetensors"))
    after = mx.load(str(second / "final" / "model.safetensors"))
    assert after.keys() == before.keys()
    moved = max(mx.abs(after[k].astype(mx.float32) - before[k].astype(mx.float32)).max().item() for k in after)
    assert moved < 2e-3  # an fp16 step at most
    fresh = mx.load(str(first / "init" / "model.safetensors"))  # the factory's random start
    assert max(mx.abs(fresh[k].astype(mx.float32) - before[k].astype(mx.float32)).max().item()
               for k in before if k in fresh) > 2e-2


def test_stop_after_exports_mid_schedule_and_the_run_goes_on_later(tmp_path):
    """--stop-after N checkpoints and exports at step N of a longer schedule; a rerun without
    it resumes there and finishes the schedule."""
    _run(tmp_path, 4, "--num-layers", "2", "--stop-after", "2")
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text()) == {"step": 2}
    assert (tmp_path / "final" / "model.safetensors").exists()
    log = _run(tmp_path, 4, "--num-layers", "2")
    assert "resumed at step 2" in log
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text()) == {"step": 4}


def test_tools_description_first_moves_each_description_before_its_name(tmp_path):
    """--tools-description-first rewrites the model's chat template so that each listed tool is
    the same JSON object with its description first (runs 34-35); a tool without a description
    is written as before, and the exported model carries the template."""
    from transformers import AutoTokenizer

    from mlx_tandem.testing.factory import make_tiny_model

    T = _trainer_module()
    model = make_tiny_model("qwen3_5", tmp_path / "model", seed=0)
    before = AutoTokenizer.from_pretrained(model)
    T.write_description_first(model)
    T.write_description_first(model)  # once is enough: a second rewrite changes nothing
    after = AutoTokenizer.from_pretrained(model)
    fn = {"name": "next_step", "description": "Smallest step greater than n.",
          "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}
    tools = [{"type": "function", "function": fn},
             {"type": "function", "function": {"name": "bare", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "user", "content": "Which step comes after 3?"}]
    old, new = (t.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
                for t in (before, after))
    moved = {"type": "function", "function": {"description": fn["description"], "name": fn["name"],
                                              "parameters": fn["parameters"]}}
    assert old != new and new == old.replace(json.dumps(tools[0]), json.dumps(moved))
    assert json.dumps(tools[1]) in new
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    with pytest.raises(ValueError, match="does not render tools"):
        T.write_description_first(tmp_path / "other")

    _run(tmp_path / "run", 1, "--num-layers", "2", "--tools-description-first")
    exported = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    assert exported.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True) == new


REPRODUCE = SCRIPT.with_name("reproduce_demo_model.py")


def _reproduce(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPRODUCE), "--out", str(out), "--smoke", *extra],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_reproduce_chains_the_lineage_into_the_shipped_models_form(tmp_path, capsys):
    """scripts/reproduce_demo_model.py runs v6's nine stages in order, each from the one before,
    and ends in the shipped model's form: its config and its description-first chat template.
    A second run skips the finished stages; a stage made by other commands stops it."""
    from mlx_tandem.default_model import is_packaged, packaged_model_path

    spec = importlib.util.spec_from_file_location("reproduce_demo_model", REPRODUCE)
    R = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = R  # a dataclass looks its module up there
    spec.loader.exec_module(R)
    names = [s.name for s in R.LINEAGE]
    assert [s.ships_as for s in R.LINEAGE if s.ships_as] == ["v3", "v4", "v5", "v6"]
    assert R.main(["--list", "--until", "run32b", "--out", str(tmp_path)]) == 0  # v4's commands, nothing run
    listed = capsys.readouterr().out.splitlines()
    assert [line for line in listed if line.startswith("#")] == ["# run30 (v3)", "# run32b (v4)"]
    assert len(listed) == 5 and not any(tmp_path.iterdir())

    proc = _reproduce(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for before, stage in zip(names, names[1:]):
        # --init-from copies the previous stage's export: weights and tokenizer go on.
        for name in ("model.safetensors", "tokenizer.json"):
            assert (tmp_path / stage / "init" / name).read_bytes() == \
                (tmp_path / before / "final" / name).read_bytes(), (stage, name)
    # The template changes once, where run 36 writes the descriptions first, and is kept after.
    templates = [(tmp_path / name / "final" / "chat_template.jinja").read_text() for name in names]
    assert [a != b for a, b in zip(templates, templates[1:])] == [name == "run36" for name in names[1:]]
    final = tmp_path / names[-1] / "final"
    assert (tmp_path / "run30" / "final" / "tokenizer.json").read_bytes() == (final / "tokenizer.json").read_bytes()
    if is_packaged():  # the shipped v6: same architecture, the template run 36 wrote and the rest kept
        shipped = packaged_model_path()
        assert json.loads((final / "config.json").read_text()) == json.loads((shipped / "config.json").read_text())
        assert (final / "chat_template.jinja").read_text() == (shipped / "chat_template.jinja").read_text()
        # The shipped model records the commands that made it; the script still runs exactly those.
        assert json.loads((shipped / "lineage.json").read_text())["runs"] == R.lineage()["runs"]
    assert json.loads((final / "lineage.json").read_text()) == R.lineage(smoke=True)

    again = _reproduce(tmp_path, "--bf16")  # the precision is not the recipe: nothing to redo
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("done before, skipped") == len(names)
    assert "train_demo_model.py" not in again.stderr  # no stage ran again

    shutil.rmtree(final)  # a stage whose export is gone is made again: its trainer resumes and exports
    remade = _reproduce(tmp_path)
    assert remade.returncode == 0, remade.stderr[-3000:]
    assert remade.stderr.count("done before, skipped") == len(names) - 1
    assert json.loads((final / "lineage.json").read_text()) == R.lineage(smoke=True)

    record = tmp_path / "run36f" / "stage.json"
    made = json.loads(record.read_text())
    made["recipe"][-1] = made["recipe"][-1].replace("--seed 41", "--seed 4")  # another recipe made this stage
    record.write_text(json.dumps(made))
    stopped = _reproduce(tmp_path)
    assert stopped.returncode != 0 and "holds a stage made by other commands" in stopped.stderr
