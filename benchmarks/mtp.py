"""MTP speculative decoding: speedup against plain decoding, and against the ideal.

The bench model is a hybrid qwen3_5 factory checkpoint (GatedDeltaNet + attention) whose
MTP head is self-distilled on the backbone's own greedy continuations of the benchmark
prompts (``mlx_tandem.testing.mtp_distill``), so its acceptance is high on exactly this
traffic -- what a trained head gives on its own model's outputs. ``--model PATH`` runs any
checkpoint with an MTP head instead (e.g. the trained demo model).

Side by side in one run, greedy, for batch 1 and batch 8:
  - decode tokens/s with an engine without MTP and one with MTP (depth k), runs interleaved;
  - the measured acceptance a (accepted / drafted) and tokens per row per step T;
  - the ideal speedup for that T and the measured costs of one plain forward (1 token),
    one verify forward (k+1 tokens) and one draft pass of the head:
        ideal = T * c_plain / (k * c_draft + c_verify)
    (T, not E(a) = (1 - a^(k+1)) / (1 - a): that formula takes a as each draft's chance
    given the ones before it were accepted, while a counts the drafts after a rejection
    too, so E(a) fell short of T and the ideal with it: 2.86 against 2.91 at a = 95%);
    (the costs are bare mlx forwards, timed apart from the runs: on a quiet machine the gap
    to ideal is the engine's own overhead; on a noisy one the probes may land above or below,
    and "of ideal" can pass 100%);
  - whether both engines produced identical tokens;
  - memory of the matching vision checkpoint (qwen3_5_vl) alone and with the text lane's
    model built on its arrays (it shares every array: the growth should be ~0).

    python benchmarks/mtp.py results/mtp.json            # full
    python benchmarks/mtp.py results/mtp.json --quick    # a few minutes (the first run distils the head)
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx_tandem  # noqa: E402,F401  - OpenBLAS before mlx
import report  # noqa: E402  - benchmarks/report.py
from mlx_tandem import Engine  # noqa: E402
from mlx_tandem.testing import make_tiny_model  # noqa: E402
from mlx_tandem.testing.mtp_distill import default_prompts, distill_mtp_head  # noqa: E402

FULL = dict(sizes=dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
                       linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=4),
            prompts=32, max_tokens=64, distill_steps=400)
QUICK = dict(sizes=dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
                        linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=2),
             prompts=16, max_tokens=32, distill_steps=250)
BATCHES = (1, 8)
REPEATS = 3  # interleaved runs per engine and batch size; the best is kept


def forward_costs(path: Path, batch: int, depth: int, reps: int = 10, blocks: int = 5) -> dict:
    """Seconds per bare forward: plain (1 token), verify (k+1 tokens), one draft pass. The
    fastest of ``blocks`` means of ``reps`` calls each: on a shared machine the minimum is
    the cost, the rest is other load."""
    import mlx.core as mx
    from mlx_lm.generate import _merge_caches
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from mlx_tandem.spec.batch import MTPTextModel, _logits
    from mlx_tandem.spec.mtp_head import load_mtp_head

    model, config = load_model(path)
    model.set_dtype(mx.float32)
    lm = model.language_model
    head = load_mtp_head(path, lm, config, dtype=mx.float32)
    wrapped = MTPTextModel(model, head)
    cache = _merge_caches([make_prompt_cache(wrapped) for _ in range(batch)])
    prompt = mx.random.randint(0, 1000, (batch, 48))
    mx.eval(wrapped(prompt, cache))
    n = wrapped.n_backbone
    backbone, mtp = cache[:n], cache[n:]

    def timed(fn):
        mx.eval(fn())
        best = float("inf")
        for _ in range(blocks):
            t0 = time.perf_counter()
            for _ in range(reps):
                mx.eval(fn())
            best = min(best, (time.perf_counter() - t0) / reps)
        return best

    tok1 = mx.zeros((batch, 1), dtype=mx.int32)
    tokk = mx.zeros((batch, depth + 1), dtype=mx.int32)
    hid = mtp[0].pending
    return {
        "plain": timed(lambda: model(tok1, backbone)),
        "verify": timed(lambda: model(tokk, backbone)),
        "draft": timed(lambda: _logits(lm, head(lm.model.embed_tokens(tok1), hid, mtp))),
    }


def vlm_memory(root: Path, sizes: dict) -> dict:
    """The mlx arrays of a VLM alone and with the text lane's model built on its arrays."""
    import gc
    import json as _json

    import mlx.core as mx
    from mlx_vlm import load

    from mlx_tandem.model_loader import text_model_from_vlm

    path = root / "bench-qwen3_5-vl"
    if not (path / "config.json").exists():
        make_tiny_model("qwen3_5_vl", path, seed=0, mtp_layers=1, **sizes)
    gc.collect()
    vlm, _ = load(str(path))
    vlm.set_dtype(mx.float32)
    mx.eval(vlm.parameters())
    # mlx's own count of live array bytes (the process's peak RSS, read after the engines
    # ran, said nothing about these models and could not differ between the two readings)
    alone = {"mlx_active_bytes": mx.get_active_memory()}
    text = text_model_from_vlm(vlm, _json.loads((path / "config.json").read_text()))
    mx.eval(text.parameters())
    both = {"mlx_active_bytes": mx.get_active_memory()}
    grown = both["mlx_active_bytes"] - alone["mlx_active_bytes"]
    return {"vlm_alone": alone, "vlm_plus_text_model": both,
            "growth_fraction": grown / max(1, alone["mlx_active_bytes"])}


async def run_engine(engine: Engine, prompts: list[str], batch: int, max_tokens: int):
    """Prompts in rounds of ``batch`` concurrent requests; (token ids, decode seconds)."""
    outs = []
    before = engine.stats()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += await asyncio.gather(*(engine.complete(p, {"max_tokens": max_tokens})
                                       for p in prompts[i:i + batch]))
    wall = time.perf_counter() - t0
    after = engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    return [o.token_ids for o in outs], tokens, wall, after, before


async def bench(args) -> dict:
    from tqdm.auto import tqdm

    cfg = QUICK if args.quick else FULL
    k = args.depth
    if args.model:
        path = Path(args.model)
        prompts = default_prompts(cfg["prompts"], seed=11)
    else:
        root = Path(args.model_dir or tempfile.mkdtemp(prefix="tandem-bench-"))
        path = root / ("bench-qwen3_5-mtp-quick" if args.quick else "bench-qwen3_5-mtp")
        prompts = default_prompts(cfg["prompts"])
        if not (path / "config.json").exists():
            print(f"building the benchmark model at {path} and distilling its MTP head ...", flush=True)
            make_tiny_model("qwen3_5", path, seed=0, mtp_layers=1, **cfg["sizes"])
            distilled = distill_mtp_head(path, prompts=prompts, max_tokens=cfg["max_tokens"],
                                         steps=cfg["distill_steps"], show_progress=True)
            print(f"distilled: top-1 agreement {100 * distilled['top1_agreement']:.1f}% on its training data")
    max_tokens = cfg["max_tokens"]
    plain = Engine(path, mtp="off", max_batch_size=max(BATCHES), show_progress=False)
    spec = Engine(path, mtp="on", mtp_depth=k, max_batch_size=max(BATCHES), show_progress=False)
    await plain.start()
    await spec.start()
    for e in (plain, spec):  # warm-up
        await e.complete(prompts[0], {"max_tokens": 4})
    results = {"model": str(path), "depth": k, "max_tokens": max_tokens, "prompts": len(prompts), "runs": []}
    bar = tqdm(total=len(BATCHES) * 2 * REPEATS, desc="MTP benchmark", unit="run")
    for batch in BATCHES:
        row = {"batch": batch}
        tps = {"off": [], "on": []}
        for rep in range(REPEATS):  # interleaved: off, on, off, on, ...
            for name, engine in (("off", plain), ("on", spec)):
                ids, tokens, wall, after, before = await run_engine(engine, prompts, batch, max_tokens)
                tps[name].append(tokens / wall)
                row[f"ids_{name}"] = ids
                if name == "on":
                    m0, m1 = before["mtp"], after["mtp"]
                    drafted = m1["drafted"] - m0["drafted"]
                    accepted = m1["accepted"] - m0["accepted"]
                    rows = m1["draft_rows"] - m0["draft_rows"]
                    row.update(acceptance=accepted / drafted if drafted else 0.0,
                               tokens_per_row_step=1 + (accepted / rows if rows else 0.0))
                bar.update()
        row["identical"] = row.pop("ids_off") == row.pop("ids_on")
        row["tps_off"], row["tps_on"] = max(tps["off"]), max(tps["on"])  # best of each: less noise
        row["speedup"] = row["tps_on"] / row["tps_off"]
        costs = forward_costs(path, batch, k)
        row["costs_s"] = costs
        ideal(row, k)
        results["runs"].append(row)
    bar.close()
    results["engine_stats"] = spec.stats()
    await plain.close()
    await spec.close()
    results["memory"] = vlm_memory(path.parent, cfg["sizes"])
    return results


def ideal(row: dict, k: int) -> None:
    """The row's ideal speedup: the tokens a row gained per speculative step, at the bare
    forwards' costs (a step's k draft passes and one verify against one plain forward)."""
    c = row["costs_s"]
    row["ideal_speedup"] = row["tokens_per_row_step"] * c["plain"] / (k * c["draft"] + c["verify"])
    row["fraction_of_ideal"] = row["speedup"] / row["ideal_speedup"]


def plot(results: dict, plt):
    runs = results["runs"]
    labels = [f"batch {r['batch']}" for r in runs]
    x = range(len(runs))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([i - 0.2 for i in x], [r["tps_off"] for r in runs], 0.4, label="plain decoding")
    ax.bar([i + 0.2 for i in x], [r["tps_on"] for r in runs], 0.4, label=f"MTP, depth {results['depth']}")
    for i, r in enumerate(runs):
        ax.text(i + 0.2, r["tps_on"], f"{r['speedup']:.2f}x\n(ideal {r['ideal_speedup']:.2f}x)",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"MTP speculative decoding (acceptance {runs[0]['acceptance']:.0%})")
    ax.legend(loc="upper left", fontsize=8)
    ax.margins(y=0.25)
    return fig


def main(argv=None) -> int:
    ap = report.arguments(__doc__, "smaller model and fewer prompts")
    ap.add_argument("--model", help="a checkpoint with an MTP head to benchmark instead of the bench model")
    ap.add_argument("--depth", type=int, default=2, choices=(1, 2, 3), help="draft tokens per step")
    args = report.parse(ap, argv)
    results = asyncio.run(bench(args))
    results["machine"] = report.machine()
    print(f"\nMTP depth {results['depth']}, greedy, {results['max_tokens']} new tokens per request")
    print(f"{'batch':>5} {'accept':>7} {'tok/row/step':>12} {'plain tok/s':>12} {'MTP tok/s':>10} "
          f"{'speedup':>8} {'ideal':>6} {'of ideal':>9}  identical")
    for r in results["runs"]:
        print(f"{r['batch']:>5} {r['acceptance']:>7.1%} {r['tokens_per_row_step']:>12.2f} {r['tps_off']:>12.1f} "
              f"{r['tps_on']:>10.1f} {r['speedup']:>7.2f}x {r['ideal_speedup']:>5.2f}x "
              f"{r['fraction_of_ideal']:>8.0%}  {r['identical']}")
    mem = results["memory"]
    mb = 2 ** 20
    print(f"\nVLM alone: {mem['vlm_alone']['mlx_active_bytes'] / mb:.1f} MB of mlx arrays; VLM + text model: "
          f"{mem['vlm_plus_text_model']['mlx_active_bytes'] / mb:.1f} MB: +{100 * mem['growth_fraction']:.2f}%")
    if any(r["fraction_of_ideal"] > 1 for r in results["runs"]):
        print("note: measured above ideal means the cost probes (timed apart from the runs) were "
              "disturbed by machine noise; the ideal is not an upper bound then")
    return report.finish(results, args.output, plot, all(r["identical"] for r in results["runs"]),
                         "MTP output differs from plain decoding (MTP must be lossless)")


if __name__ == "__main__":
    sys.exit(main())
