"""Continuous-batching throughput, measured side by side in one run.

For N in (1, 4, 16, 32) the same greedy chat prompts run:
  (a) one at a time through the engine,
  (b) N concurrently through the engine (continuous batching),
  (c) through mlx-lm's raw BatchGenerator, no engine around it (same prompts, all inserted at once).
(b) and (c) alternate, best of 3 (2 in quick mode); the engine runs without the prefix
cache, so a repeat does not skip its prefill. It prints aggregate generated tokens/s and the
ratios (b)/(a) and (b)/(c), checks that all three produced the same tokens, and writes JSON
to the path given (and a PNG plot next to it).

Then (d), the engine's host time per step: 16 requests on a model whose forward costs almost
nothing (hidden 64, 2 layers), through the engine and through the raw BatchGenerator,
alternating, best of 7. On a fast GPU a step of a small model takes a few milliseconds, and
what the engine adds per step (detokenizing, stop strings, handing outputs to the event
loop) shows there; on the CPU it hides behind the forward, so (b)/(c) cannot see it.

    python benchmarks/batching.py results/batching.json           # full
    python benchmarks/batching.py results/batching.json --quick   # under a minute
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
from mlx_tandem import Engine, SamplingParams, _platform  # noqa: E402
from mlx_tandem.testing import make_tiny_model  # noqa: E402

FULL = dict(sizes=dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816,
                       num_attention_heads=16, num_key_value_heads=8),
            ns=(1, 4, 16, 32), max_tokens=48, reps=3)
QUICK = dict(sizes=dict(hidden_size=768, num_hidden_layers=4, intermediate_size=2048,
                        num_attention_heads=12, num_key_value_heads=4),
             ns=(1, 4, 16), max_tokens=24, reps=2)

QUESTIONS = [
    "What does json.dumps do?", "Explain functools.lru_cache.", "How do I sort a list by length?",
    "What is pathlib.Path.read_text?", "Describe textwrap.dedent.", "What is heapq used for?",
    "Summarize the argparse module.", "What does calendar.isleap return?",
]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}] for i in range(n)]


def run_raw_batch_generator(model_path: Path, prompt_ids: list[list[int]], max_tokens: int, eos: list[int],
                            max_batch_size: int, prefill_step_size: int):
    """(c): mlx-lm's BatchGenerator alone, on this thread, with its own copy of the model."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    model, _ = load(str(model_path))
    model.set_dtype(mx.float32)
    gen = BatchGenerator(model, stop_tokens=[[e] for e in eos], completion_batch_size=max_batch_size,
                         prefill_batch_size=8, prefill_step_size=prefill_step_size)
    # Warm-up, as the engine's first request warms its model.
    gen.insert([prompt_ids[0]], max_tokens=[2])
    while gen.next_generated():
        pass
    t0 = time.perf_counter()
    uids = gen.insert(prompt_ids, max_tokens=[max_tokens] * len(prompt_ids))
    out = {u: [] for u in uids}
    pending = set(uids)
    while pending:
        for r in gen.next_generated():
            if r.token not in eos:
                out[r.uid].append(r.token)
            if r.finish_reason is not None:
                pending.discard(r.uid)
    wall = time.perf_counter() - t0
    gen.close()
    tokens = [out[u] for u in uids]
    return tokens, wall


async def bench(args) -> dict:
    from tqdm.auto import tqdm

    cfg = QUICK if args.quick else FULL
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="tandem-bench-"))
    model_path = model_dir / ("bench-llama-quick" if args.quick else "bench-llama")
    if not (model_path / "config.json").exists():
        print(f"building the benchmark model at {model_path} ...", flush=True)
        make_tiny_model("llama", model_path, seed=0, vocab_size=2048, **cfg["sizes"])
    ns, max_tokens = cfg["ns"], cfg["max_tokens"]
    n_params = None
    results = {"model": str(model_path), "sizes": cfg["sizes"], "max_tokens": max_tokens, "runs": []}
    # No prefix cache: a repeated prompt would skip its prefill, which (c) cannot.
    engine = Engine(model_path, max_batch_size=max(ns), prefill_step_size=512, show_progress=False,
                    prefix_cache_bytes=0)
    await engine.start()
    from mlx.utils import tree_flatten

    n_params = engine.run_on_owner_thread(lambda: sum(v.size for _, v in tree_flatten(engine.loaded.model.parameters())))
    results["parameters"] = n_params
    print(f"model: llama {cfg['sizes']} = {n_params / 1e6:.1f}M parameters, float32, "
          f"BLAS {_platform.active_blas()}, {os.cpu_count()} CPUs; greedy, {max_tokens} new tokens per request")
    params = SamplingParams(max_tokens=max_tokens)
    await engine.chat(prompts(1)[0], SamplingParams(max_tokens=2))  # warm-up
    eos = engine.loaded.eos_token_ids

    bar = tqdm(total=len(ns) * 3, desc="batching benchmark", unit="run")
    for n in ns:
        ps = prompts(n)
        # (a) one at a time
        t0 = time.perf_counter()
        seq = [await engine.chat(p, params) for p in ps]
        wall_a = time.perf_counter() - t0
        bar.update()
        # (b) N concurrently and (c) the raw BatchGenerator (engine idle meanwhile),
        # alternating, best of `reps`: one sample each gave (b)/(c) from 0.93 to 1.62 on a
        # loaded machine.
        ids = [engine.apply_chat_template(p) for p in ps]
        wall_b = wall_c = float("inf")
        for _ in range(cfg["reps"]):
            t0 = time.perf_counter()
            conc = await asyncio.gather(*[engine.chat(p, params) for p in ps])
            wall_b = min(wall_b, time.perf_counter() - t0)
            raw_tokens, wall = run_raw_batch_generator(model_path, ids, max_tokens, eos, max(ns), 512)
            wall_c = min(wall_c, wall)
        bar.update(2)

        tokens = sum(len(o.token_ids) for o in conc)
        same = ([o.token_ids for o in seq] == [o.token_ids for o in conc] == raw_tokens)
        row = {
            "n": n, "tokens": tokens,
            "one_at_a_time_tps": tokens / wall_a, "engine_concurrent_tps": tokens / wall_b,
            "raw_batch_generator_tps": tokens / wall_c,
            "ratio_b_over_a": wall_a / wall_b, "ratio_b_over_c": wall_c / wall_b,
            "outputs_identical": same,
        }
        results["runs"].append(row)
    bar.close()
    results["engine_stats"] = engine.stats()
    await engine.close()
    results["host_overhead"] = await host_overhead(model_dir)
    return results


HOST = dict(sizes=dict(hidden_size=64, num_hidden_layers=2, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2), n=16, max_tokens=128, repeats=7)


async def host_overhead(model_dir: Path) -> dict:
    """(d): milliseconds per decode step, engine against raw mlx-lm, on a near-free forward."""
    cfg = HOST
    path = model_dir / "bench-llama-host"
    if not (path / "config.json").exists():
        make_tiny_model("llama", path, seed=0, vocab_size=2048, **cfg["sizes"])
    n, max_tokens = cfg["n"], cfg["max_tokens"]
    async with Engine(path, max_batch_size=n, prefill_step_size=512, show_progress=False, mtp="off") as engine:
        ids = [engine.apply_chat_template(p) for p in prompts(n)]
        eos = engine.loaded.eos_token_ids
        params = SamplingParams(max_tokens=max_tokens)
        await engine.complete(ids[0], SamplingParams(max_tokens=2))  # warm-up
        best_engine = best_raw = float("inf")
        for _ in range(cfg["repeats"]):
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(engine.complete(i, params) for i in ids))
            best_engine = min(best_engine, time.perf_counter() - t0)
            raw, wall = run_raw_batch_generator(path, ids, max_tokens, eos, n, 512)
            best_raw = min(best_raw, wall)
        same = [o.token_ids for o in outs] == raw
    steps = max(len(o.token_ids) for o in outs)
    return {"sizes": cfg["sizes"], "n": n, "max_tokens": max_tokens, "steps": steps,
            "engine_ms_per_step": 1e3 * best_engine / steps, "raw_ms_per_step": 1e3 * best_raw / steps,
            "host_ms_per_step": 1e3 * (best_engine - best_raw) / steps, "ratio_raw_over_engine": best_raw / best_engine,
            "outputs_identical": same}


def plot(results: dict, plt):
    """Throughput against concurrency, the three ways side by side (needs matplotlib)."""
    runs = results["runs"]
    ns = [r["n"] for r in runs]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(ns, [r["one_at_a_time_tps"] for r in runs], "o-", label="(a) one at a time")
    ax.plot(ns, [r["engine_concurrent_tps"] for r in runs], "o-", label="(b) engine, N concurrent")
    ax.plot(ns, [r["raw_batch_generator_tps"] for r in runs], "o--", label="(c) raw mlx-lm BatchGenerator")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("concurrent requests N")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("Continuous batching")
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    ap = report.arguments(__doc__, "smaller model, N up to 16 (under a minute)")
    args = report.parse(ap, argv)
    results = asyncio.run(bench(args))
    results["machine"] = report.machine()
    print(f"\n{'N':>4} {'tokens':>7} {'(a) 1-by-1 tok/s':>17} {'(b) engine tok/s':>17} "
          f"{'(c) raw BG tok/s':>17} {'(b)/(a)':>8} {'(b)/(c)':>8}  same")
    for r in results["runs"]:
        print(f"{r['n']:>4} {r['tokens']:>7} {r['one_at_a_time_tps']:>17.1f} {r['engine_concurrent_tps']:>17.1f} "
              f"{r['raw_batch_generator_tps']:>17.1f} {r['ratio_b_over_a']:>8.2f} {r['ratio_b_over_c']:>8.2f}  "
              f"{r['outputs_identical']}")
    h = results["host_overhead"]
    print(f"\n(d) host time per step, {h['n']} requests on a near-free forward: engine {h['engine_ms_per_step']:.2f} ms, "
          f"raw mlx-lm {h['raw_ms_per_step']:.2f} ms: the engine adds {h['host_ms_per_step']:.2f} ms a step "
          f"(raw/engine {h['ratio_raw_over_engine']:.2f}), same tokens: {h['outputs_identical']}")
    report.write(results, args.output, plot)
    if not all(r["outputs_identical"] for r in results["runs"] + [h]):
        print("FAILED: batched greedy outputs differ from one-at-a-time greedy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
