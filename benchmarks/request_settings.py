"""Do per-request settings keep MTP's speed-up? Logprobs, penalties and a logit bias.

Side by side in one run (the machines are noisy), on the embedded demo model (hybrid
qwen3_5 with its trained MTP head), the same eight greedy chats about Python's standard
library, at most 1 and at most 8 at a time (``--quick``: 4). Each setting runs with MTP
off and on, interleaved, best of five rounds (``--quick``: two):

  none        no per-request setting
  logprobs    logprobs with top_logprobs=5 (drafts report the verify's distributions)
  penalties   presence_penalty 0.5, frequency_penalty 0.2, repetition_penalty 1.05
              (applied at each drafted and verified position: spec/batch.PenaltyWalk)
  bias        a logit bias on a few tokens (added at every position)

The ratios that matter: each setting's MTP speed-up (on / off) against the plain one's,
and what the setting costs without MTP (setting / none). MTP off and on must answer alike
for each setting (greedy, the same tokens); the run fails otherwise.

    python benchmarks/request_settings.py results/request_settings.json            # full (~7 min)
    python benchmarks/request_settings.py results/request_settings.json --quick    # ~2 minutes
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

SETTINGS = {"none": {}, "logprobs": {"logprobs": True, "top_logprobs": 5},
            "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.2, "repetition_penalty": 1.05},
            "bias": {"logit_bias": {11: 1.5, 12: -1.5, 13: 1.0}}}
MODES = ("off", "on")
QUESTIONS = ["What does math.sqrt do?", "What does os.path.join do?", "What does json.dumps do?",
             "What does str.split do?", "What does itertools.chain do?", "What does random.choice do?",
             "What does time.sleep do?", "What does re.match do?"]


async def run_batch(engines: dict, batch: int, tokens: int, rounds: int) -> dict:
    """Every question, at most ``batch`` at a time: each batch size answers the same eight
    (at batch 1 one after another; a batch-1 run of the first question alone timed one
    12-token answer, mostly its prefill)."""
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    best = {name: {mode: 0.0 for mode in MODES} for name in SETTINGS}
    answers: dict = {}

    async def answer_all(engine, params):
        slots = asyncio.Semaphore(batch)

        async def one(p):
            async with slots:
                return await engine.chat(p, params)
        return await asyncio.gather(*(one(p) for p in prompts))

    for _ in range(rounds):
        for name, extra in SETTINGS.items():
            for mode in MODES:
                params = {"max_tokens": tokens, **extra}
                tic = time.perf_counter()
                outs = await answer_all(engines[mode], params)
                elapsed = time.perf_counter() - tic
                best[name][mode] = max(best[name][mode], sum(len(o.token_ids) for o in outs) / elapsed)
                answers[name, mode] = [o.token_ids for o in outs]
    return {"batch": batch, "tokens_per_s": best,
            "mtp_speedup": {name: best[name]["on"] / best[name]["off"] for name in SETTINGS},
            "cost_without_mtp": {name: best[name]["off"] / best["none"]["off"] for name in SETTINGS},
            "identical_outputs": all(answers[name, "on"] == answers[name, "off"] for name in SETTINGS)}


async def bench(args) -> dict:
    tokens, rounds, batches = (32, 2, (1, 4)) if args.quick else (64, 5, (1, 8))
    engines = {mode: Engine(show_progress=False, mtp=mode) for mode in MODES}
    try:
        for engine in engines.values():
            await engine.start()
            await engine.chat([{"role": "user", "content": "hi"}], {"max_tokens": 4})  # warm-up
        rows = [await run_batch(engines, b, tokens, rounds) for b in batches]
        acceptance = engines["on"].stats()["mtp"].get("acceptance_rate")
    finally:
        for engine in engines.values():
            await engine.close()
    return {"model": "embedded demo model", "new_tokens": tokens, "rounds": rounds,
            "settings": {k: {kk: str(vv) for kk, vv in v.items()} for k, v in SETTINGS.items()},
            "mtp_acceptance": acceptance, "batches": rows}


def plot(results: dict, plt):
    rows = results["batches"]
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 3.8))
    for ax, r in zip(axes, rows):
        names = list(SETTINGS)
        for k, mode in enumerate(MODES):
            ax.bar([i + (k - 0.5) * 0.4 for i in range(len(names))], [r["tokens_per_s"][n][mode] for n in names], 0.4,
                   label=f"MTP {mode}")
        ax.set_xticks(range(len(names)), [f"{n}\n{r['mtp_speedup'][n]:.2f}x" for n in names])
        ax.set_ylabel("tokens/s (best of rounds)")
        ax.set_title(f"batch {r['batch']}: MTP speed-up per request setting")
        ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    args, results = report.measure(__doc__, "fewer tokens, rounds and a smaller batch",
                                   lambda a: asyncio.run(bench(a)), argv)
    print(f"\n{'batch':>5} {'setting':>10} {'MTP off':>9} {'MTP on':>9} {'speed-up':>9} {'cost w/o MTP':>13}")
    for r in results["batches"]:
        for n in SETTINGS:
            t = r["tokens_per_s"][n]
            print(f"{r['batch']:>5} {n:>10} {t['off']:>9.1f} {t['on']:>9.1f} {r['mtp_speedup'][n]:>8.2f}x "
                  f"{r['cost_without_mtp'][n]:>12.2f}x")
    print(f"MTP acceptance {results['mtp_acceptance']}")
    return report.finish(results, args.output, plot, all(r["identical_outputs"] for r in results["batches"]),
                         "a setting answered differently with MTP (greedy: it must not)")


if __name__ == "__main__":
    sys.exit(main())
