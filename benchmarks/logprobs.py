"""What asking for logprobs costs, with and without MTP speculative decoding.

Side by side in one run (the machines are noisy), on the embedded demo model (hybrid
qwen3_5 with its trained MTP head), greedy chats about Python's standard library, at
batch 1 and batch 8. Four settings per batch, interleaved, best of ``--rounds``:

  plain        MTP off, no logprobs
  plain+lp     MTP off, logprobs with top_logprobs=5
  mtp          MTP on, no logprobs
  mtp+lp       MTP on, logprobs with top_logprobs=5

The ratios that matter: plain+lp / plain (the gather's cost) and mtp+lp / mtp (does a row
that asks for logprobs keep MTP's speed-up: it reads the verify's distributions). All
four must answer alike (greedy, the same tokens); the run fails otherwise.

    python benchmarks/logprobs.py results/logprobs.json            # full (~3 min)
    python benchmarks/logprobs.py results/logprobs.json --quick    # under a minute
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx_tandem  # noqa: E402,F401  - OpenBLAS before mlx
import report  # noqa: E402  - benchmarks/report.py
from mlx_tandem import Engine  # noqa: E402

SETTINGS = {"plain": ("off", False), "plain+lp": ("off", True), "mtp": ("on", False), "mtp+lp": ("on", True)}
QUESTIONS = ["What does math.sqrt do?", "What does os.path.join do?", "What does json.dumps do?",
             "What does str.split do?", "What does itertools.chain do?", "What does random.choice do?",
             "What does time.sleep do?", "What does re.match do?"]


async def run_batch(engines: dict, batch: int, tokens: int, rounds: int) -> dict:
    prompts = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(batch)]
    best = {name: 0.0 for name in SETTINGS}
    answers = {}
    for _ in range(rounds):
        for name, (mode, logprobs) in SETTINGS.items():
            params = {"max_tokens": tokens, "logprobs": logprobs, "top_logprobs": 5 if logprobs else 0}
            tic = time.perf_counter()
            outs = await asyncio.gather(*(engines[mode].chat(p, params) for p in prompts))
            elapsed = time.perf_counter() - tic
            best[name] = max(best[name], sum(len(o.token_ids) for o in outs) / elapsed)
            answers[name] = [o.token_ids for o in outs]
    return {"batch": batch, "tokens_per_s": best,
            "logprobs_cost_plain": best["plain+lp"] / best["plain"],
            "logprobs_cost_mtp": best["mtp+lp"] / best["mtp"],
            "mtp_speedup": best["mtp"] / best["plain"], "mtp_speedup_with_logprobs": best["mtp+lp"] / best["plain+lp"],
            "identical_outputs": all(a == answers["plain"] for a in answers.values())}


async def bench(args) -> dict:
    tokens, rounds, batches = (32, 2, (1, 4)) if args.quick else (64, 3, (1, 8))
    engines = {mode: Engine(show_progress=False, mtp=mode) for mode in ("off", "on")}
    try:
        for engine in engines.values():
            await engine.start()
            await engine.chat([{"role": "user", "content": "hi"}], {"max_tokens": 4})  # warm-up
        rows = [await run_batch(engines, b, tokens, rounds) for b in batches]
        acceptance = engines["on"].stats()["mtp"].get("acceptance_rate")
    finally:
        for engine in engines.values():
            await engine.close()
    return {"model": "embedded demo model", "new_tokens": tokens, "rounds": rounds, "top_logprobs": 5,
            "mtp_acceptance": acceptance, "batches": rows}


def plot(results: dict, plt):
    fig, ax = plt.subplots(figsize=(7, 3.8))
    rows = results["batches"]
    width = 0.2
    for k, name in enumerate(SETTINGS):
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))], [r["tokens_per_s"][name] for r in rows], width,
               label=name)
    ax.set_xticks(range(len(rows)), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("tokens/s (best of rounds)")
    ax.set_title("logprobs (top 5) with and without MTP, demo model")
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    args, results = report.measure(__doc__, "fewer tokens, rounds and a smaller batch",
                                   lambda a: asyncio.run(bench(a)), argv)
    print(f"\n{'batch':>5} " + " ".join(f"{n:>9}" for n in SETTINGS) + "   lp/plain  lp/mtp  mtp speed-up (with lp)")
    for r in results["batches"]:
        print(f"{r['batch']:>5} " + " ".join(f"{r['tokens_per_s'][n]:>9.1f}" for n in SETTINGS)
              + f"   {r['logprobs_cost_plain']:>8.2f}x {r['logprobs_cost_mtp']:>6.2f}x "
              f"{r['mtp_speedup']:.2f}x ({r['mtp_speedup_with_logprobs']:.2f}x)")
    print(f"MTP acceptance {results['mtp_acceptance']}")
    return report.finish(results, args.output, plot, all(r["identical_outputs"] for r in results["batches"]),
                         "logprobs or MTP changed the answers (greedy: they must not)")


if __name__ == "__main__":
    sys.exit(main())
