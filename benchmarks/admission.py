"""Memory-aware admission: peak memory and throughput with and without a budget, in one run.

The same burst (a few long prompts among many short ones, greedy, all submitted at once)
runs twice on a hybrid Qwen3.5-layout model (GatedDeltaNet + attention):
  (a) unbounded: every request starts at once (the budget is the machine's);
  (b) budgeted: ``request_memory_bytes`` set to a share of what (a) reserved at its peak.
mlx-lm pads every row of a batch to the longest, so in (a) the short requests decode in a
batch as long as the long prompts. It prints, per run, the ledger's largest reservation, the
largest the batch caches really held (prompt and decode batches, read after every step),
the peak memory above the weights (MLX's own counter, read on the engine thread: the caches
plus a step's transient activations, which the budget does not govern), the generated
tokens/s and their ratios, checks that
both runs produced the same tokens (admission must not change an answer), and writes JSON
and a PNG plot.

    python benchmarks/admission.py results/admission.json           # full
    python benchmarks/admission.py results/admission.json --quick   # under a minute
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx_tandem  # noqa: E402,F401  - OpenBLAS before mlx
import report  # noqa: E402  - benchmarks/report.py
from mlx_tandem import Engine, SamplingParams, _platform  # noqa: E402
from mlx_tandem.testing import make_tiny_model  # noqa: E402

FULL = dict(sizes=dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1408, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64),
            long=(4, 3000), short=(28, 40), max_tokens=48, budget_share=0.35)
QUICK = dict(sizes=dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=4, head_dim=64),
             long=(2, 1500), short=(14, 40), max_tokens=24, budget_share=0.35)
CONTEXT = 8192


def burst(cfg) -> list[list[int]]:
    """Long prompts first, then the short ones: token ids, so no template or tokenizer noise."""
    (n_long, long_len), (n_short, short_len) = cfg["long"], cfg["short"]
    lengths = [long_len] * n_long + [short_len + i % 7 for i in range(n_short)]
    return [[10 + (j * 31 + i * 7) % 1900 for j in range(n)] for i, n in enumerate(lengths)]


def run(model_path: Path, prompts, max_tokens: int, budget) -> dict:
    engine = Engine(model_path, show_progress=False, max_batch_size=len(prompts), mtp="off",
                    prefix_cache_bytes=0, request_memory_bytes=budget).start_sync()
    try:
        import mlx.core as mx

        engine.complete_sync(prompts[-1], SamplingParams(max_tokens=2))  # warm-up
        base = engine.run_on_owner_thread(lambda: (mx.clear_cache(), mx.reset_peak_memory(),
                                                   mx.get_active_memory())[-1])
        reserved, caches, batches, sizes = [], [], [], []
        lane = engine._core._lanes["text"]
        lane_step = lane.step

        def step():  # after every step, on the owner thread: the reservation and the real caches
            out = lane_step()
            sizes.append(out[1].batch_size)
            if out[1].generation_tokens:  # a decode step, as stats() averages its batch sizes
                batches.append(out[1].batch_size)
            reserved.append(engine._core._memory.reserved())
            caches.append(sum(c.nbytes for batch in (lane._gen._generation_batch, lane._gen._prompt_batch)
                              for c in (batch.prompt_cache or [])))
            return out

        lane.step = step
        params = SamplingParams(max_tokens=max_tokens)
        t0 = time.perf_counter()
        streams = [engine.open_complete_stream_sync(p, params) for p in prompts]
        outs = [s.collect() for s in streams]
        wall = time.perf_counter() - t0
        peak = engine.run_on_owner_thread(mx.get_peak_memory) - base
        stats = engine.stats()
    finally:
        engine.close_sync()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"budget_bytes": stats["memory"]["budget_bytes"], "peak_bytes_over_weights": peak,
            "max_reserved_bytes": max(reserved), "max_cache_bytes": max(caches), "wall_s": wall, "generated_tokens": tokens,
            # The burst's own batch sizes and TTFTs: stats() counts the warm-up request too.
            "tokens_per_s": tokens / wall, "max_batch_size": max(sizes),
            "mean_batch_size": sum(batches) / len(batches), "memory_waits": stats["memory"]["waits"],
            "mean_ttft_s": sum(o.time_to_first_token for o in outs) / len(outs),
            "token_ids": [o.token_ids for o in outs]}


def bench(args) -> dict:
    from tqdm.auto import tqdm

    cfg = QUICK if args.quick else FULL
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="tandem-bench-"))
    model_path = model_dir / ("bench-qwen3_5-quick" if args.quick else "bench-qwen3_5")
    if not (model_path / "config.json").exists():
        print(f"building the benchmark model at {model_path} ...", flush=True)
        make_tiny_model("qwen3_5", model_path, seed=0, max_position_embeddings=CONTEXT, **cfg["sizes"])
    prompts = burst(cfg)
    print(f"model: qwen3_5 {cfg['sizes']}, float32, BLAS {_platform.active_blas()}, {os.cpu_count()} CPUs; "
          f"{cfg['long'][0]} prompts of {cfg['long'][1]} tokens and {cfg['short'][0]} of about "
          f"{cfg['short'][1]}, {cfg['max_tokens']} new tokens each, all at once, MTP off")
    bar = tqdm(total=2, desc="admission benchmark", unit="run")
    unbounded = run(model_path, prompts, cfg["max_tokens"], None)
    bar.update()
    budget = int(cfg["budget_share"] * unbounded["max_reserved_bytes"])
    budgeted = run(model_path, prompts, cfg["max_tokens"], budget)
    bar.update()
    bar.close()
    same = unbounded.pop("token_ids") == budgeted.pop("token_ids")
    return {"model": str(model_path), "sizes": cfg["sizes"], "long": cfg["long"], "short": cfg["short"],
            "max_tokens": cfg["max_tokens"], "unbounded": unbounded, "budgeted": budgeted,
            "peak_ratio_budgeted_over_unbounded": budgeted["peak_bytes_over_weights"] / unbounded["peak_bytes_over_weights"],
            "throughput_ratio_budgeted_over_unbounded": budgeted["tokens_per_s"] / unbounded["tokens_per_s"],
            "outputs_identical": same}


def plot(results: dict, plt):
    """Peak memory above the weights, the budget, and tokens/s, the two runs side by side."""
    runs = [("(a) unbounded", results["unbounded"]), ("(b) budgeted", results["budgeted"])]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(7, 3.2))
    mib = 2 ** 20
    x = range(len(runs))
    ax1.bar([i - 0.2 for i in x], [r["max_cache_bytes"] / mib for _, r in runs], 0.4, label="batch caches")
    ax1.bar([i + 0.2 for i in x], [r["peak_bytes_over_weights"] / mib for _, r in runs], 0.4,
            label="peak, transients included")
    ax1.axhline(results["budgeted"]["budget_bytes"] / mib, color="tab:red", ls="--", label="budget of (b)")
    ax1.set_xticks(list(x), [n for n, _ in runs])
    ax1.set_ylabel("MiB above the weights")
    ax1.legend(fontsize=7)
    ax2.bar([n for n, _ in runs], [r["tokens_per_s"] for _, r in runs], color=["tab:gray", "tab:blue"])
    ax2.set_ylabel("generated tokens/s")
    fig.suptitle("Memory-aware admission: one burst, two budgets")
    return fig


def main(argv=None) -> int:
    args, results = report.measure(__doc__, "smaller model and burst (under a minute)", bench, argv)
    mib = 2 ** 20
    print(f"\n{'run':<10} {'budget':>8} {'reserved':>9} {'caches':>7} {'peak':>6} {'tok/s':>7} "
          f"{'max batch':>10} {'waits':>6} {'TTFT s':>7}   (MiB; peak: above the weights, transients included)")
    for name in ("unbounded", "budgeted"):
        r = results[name]
        print(f"{name:<10} {r['budget_bytes'] / mib:>8.0f} {r['max_reserved_bytes'] / mib:>9.1f} "
              f"{r['max_cache_bytes'] / mib:>7.1f} {r['peak_bytes_over_weights'] / mib:>6.1f} {r['tokens_per_s']:>7.1f} {r['max_batch_size']:>10} "
              f"{r['memory_waits']:>6} {r['mean_ttft_s']:>7.2f}")
    print(f"caches (b)/(a): {results['budgeted']['max_cache_bytes'] / results['unbounded']['max_cache_bytes']:.2f}; "
          f"peak memory (b)/(a): {results['peak_ratio_budgeted_over_unbounded']:.2f}; "
          f"tokens/s (b)/(a): {results['throughput_ratio_budgeted_over_unbounded']:.2f}; "
          f"same tokens: {results['outputs_identical']}")
    report.write(results, args.output, plot)
    if not results["outputs_identical"]:
        print("FAILED: the budgeted run's greedy outputs differ from the unbounded run's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
