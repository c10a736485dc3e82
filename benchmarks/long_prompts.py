"""Long prompts: SpecPrefill, the system-prompt cache and the multi-turn prefix cache.

Side by side in one run (the machines are noisy), time to first token (TTFT), greedy:

  P3 SpecPrefill: prompts of 2K and 8K tokens (``--long`` adds 16K) on an attention-only
     llama target much larger than its draft; full prefill vs SpecPrefill keeping 20% of the
     chunks, interleaved on the same engine (prefix cache off). Also the greedy agreement of
     the first 32 generated tokens with the full-prefill output. Both models are random-weight
     factory models: the TTFT ratio is meaningful, the agreement only says how much a random
     target's output depends on the dropped tokens.
  P4 system-prompt cache: a 4K-token system prompt + a short user message, on the llama
     target and on a hybrid qwen3_5 (GatedDeltaNet + attention) model: miss (cache off) vs hit.
     Multi-turn: an agent conversation with tool results, TTFT of turn 5 with and without the
     prefix cache.
     A burst: several requests with one new system prompt submitted at once, on the hybrid
     model: each prefilling its own copy (``prefix_cache_wait_for_prefill=False``) vs the
     others waiting for the first one's snapshot; mean and last TTFT, tokens prefilled.
     Few-shot examples written as messages (a short system prompt, then example turns), a
     new question each request, on the hybrid model: without the "history" snapshot
     (``prefix_cache_history=False`` and ``prefix_cache_shared=False``: only the short
     system prompt is reused, the model's cache cannot be cut back to the examples) vs
     with it (stored once a second request shares the examples); mean TTFT of the
     requests after those two.
     Questions about one document written in one user message (a RAG template), on the
     hybrid model: without "shared" snapshots (``prefix_cache_shared=False``: only the
     system prompt is reused) vs with them (the document is stored where the second
     prompt parts from the first); mean TTFT of the requests after those two. And a burst
     of such questions about a new document, submitted at once: each prefilling the
     document (``prefix_cache_shared=False``) vs the first storing it where the prompts
     queued behind it part from its own, the others waiting for it.

Prompts are natural text (Python standard-library docstrings) in the factory tokenizer.

    python benchmarks/long_prompts.py results/long_prompts.json            # full (~10 min)
    python benchmarks/long_prompts.py results/long_prompts.json --quick    # about a minute
"""

from __future__ import annotations

import asyncio
import inspect
import json
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

FULL = dict(
    target=dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816, num_attention_heads=16,
                num_key_value_heads=4),
    hybrid=dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
                linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=4),
    draft=dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=2),
    lengths=(2048, 8192), reps=2, system_tokens=4096, cache_reps=3, turns=5, burst=8, burst_reps=2, few_shot=6)
QUICK = dict(
    target=dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1408, num_attention_heads=8,
                num_key_value_heads=2),
    hybrid=dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=2),
    draft=dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
               num_key_value_heads=1),
    lengths=(2048,), reps=1, system_tokens=2048, cache_reps=2, turns=5, burst=4, burst_reps=2, few_shot=4)
KEEP = 0.2
AGREEMENT_TOKENS = 32
CONTEXT = 20_000


def corpus() -> list[str]:
    """Docstrings of standard-library functions, in a fixed order."""
    import collections
    import functools
    import itertools
    import json as json_mod
    import os.path
    import re
    import shutil
    import string
    import textwrap

    docs = []
    for mod in (os.path, re, json_mod, collections, functools, itertools, shutil, string, textwrap):
        for name, obj in sorted(vars(mod).items()):
            doc = inspect.getdoc(obj) if callable(obj) and not name.startswith("_") else None
            if doc and len(doc) > 80:
                docs.append(f"{mod.__name__}.{name}: {doc}")
    return docs


def natural_tokens(n_tokens: int, encode, offset: int = 0) -> list[int]:
    """``n_tokens`` token ids of natural text, starting at document ``offset``."""
    docs = corpus()
    parts, total, i = [], 0, offset
    while total < n_tokens:
        doc = docs[i % len(docs)]
        parts.append(doc)
        total += len(encode(doc + "\n\n"))
        i += 1
    ids = encode("\n\n".join(parts))[:n_tokens]
    return ids


async def ttft(engine: Engine, *, prompt=None, messages=None, params=None, tools=None):
    """(seconds to the first token, all token ids) of one request alone on the engine."""
    t0 = time.perf_counter()
    if messages is not None:
        stream = await engine.open_chat_stream(messages, params, **({"tools": tools} if tools else {}))
    else:
        stream = await engine.open_complete_stream(prompt, params)
    first = None
    ids = []
    async for delta in stream:
        if first is None and (delta.token_ids or delta.finish_reason):
            first = time.perf_counter() - t0
        ids.extend(delta.token_ids)
    return first, ids


def agreement(a: list[int], b: list[int]) -> dict:
    n = min(len(a), len(b), AGREEMENT_TOKENS)
    same = sum(x == y for x, y in zip(a[:n], b[:n]))
    prefix = next((i for i, (x, y) in enumerate(zip(a[:n], b[:n])) if x != y), n)
    return {"positions_equal": same / n if n else 1.0, "common_prefix": prefix, "compared": n}


# --------------------------------------------------------------------------- P3
async def bench_specprefill(cfg, target: Path, draft: Path, bar) -> list[dict]:
    engine = Engine(target, show_progress=False, prefix_cache_bytes=0, max_model_len=CONTEXT,
                    specprefill_draft=str(draft), specprefill_threshold=1, specprefill_keep_pct=KEEP)
    await engine.start()
    encode = engine.encode
    await ttft(engine, prompt=natural_tokens(300, encode), params={"max_tokens": 2})  # warm-up
    rows = []
    for n in cfg["lengths"]:
        full_t, sparse_t, agree, draft_t = [], [], [], []
        kept = sparse = 0
        for rep in range(cfg["reps"]):
            prompt = natural_tokens(n, encode, offset=37 * rep)
            params = {"max_tokens": AGREEMENT_TOKENS}
            tf, full_ids = await ttft(engine, prompt=prompt, params={**params, "specprefill": False})
            bar.update()
            before = engine.stats()["specprefill"]
            ts, sparse_ids = await ttft(engine, prompt=prompt, params={**params, "specprefill": True})
            after = engine.stats()["specprefill"]
            bar.update()
            full_t.append(tf)
            sparse_t.append(ts)
            agree.append(agreement(full_ids, sparse_ids))
            draft_t.append(after["draft_time_s"] - before["draft_time_s"])
            kept += after["kept_tokens"] - before["kept_tokens"]
            sparse += after["sparse_tokens"] - before["sparse_tokens"]
        # The draft's share is read from the repeat whose TTFT is reported (the best), and
        # the kept share over every repeat; both came from the last repeat only.
        best = sparse_t.index(min(sparse_t))
        rows.append({
            "prompt_tokens": n, "keep_pct": KEEP, "keep_ratio": kept / sparse if sparse else 0.0,
            "ttft_full_s": min(full_t), "ttft_specprefill_s": min(sparse_t),
            "speedup": min(full_t) / min(sparse_t),
            "draft_time_s": draft_t[best],
            "agreement": agree,
            "positions_equal_mean": sum(a["positions_equal"] for a in agree) / len(agree),
        })
    await engine.close()
    return rows


# --------------------------------------------------------------------------- P4
async def bench_system_cache(cfg, path: Path, name: str, bar) -> dict:
    """Miss (cache off) vs hit, interleaved, each with a new user message."""
    off = Engine(path, show_progress=False, prefix_cache_bytes=0, max_model_len=CONTEXT, mtp="off")
    on = Engine(path, show_progress=False, max_model_len=CONTEXT, mtp="off")
    await off.start()
    await on.start()
    encode = on.encode
    system = on.tokenizer.decode(natural_tokens(cfg["system_tokens"], encode, offset=3))
    params = {"max_tokens": 4}

    def chat(i):
        return [{"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: which function splits a path?"}]

    await ttft(on, messages=chat(-1), params=params)  # fills the cache: the first user pays it
    await ttft(off, messages=chat(-1), params=params)
    miss, hit, same = [], [], True
    for i in range(cfg["cache_reps"]):
        tm, ids_m = await ttft(off, messages=chat(i), params=params)
        th, ids_h = await ttft(on, messages=chat(i), params=params)
        miss.append(tm)
        hit.append(th)
        same &= ids_m == ids_h
        bar.update()
    prompt_tokens = len(on.apply_chat_template(chat(0)))
    stats = on.stats()["prefix_cache"]
    await off.close()
    await on.close()
    return {"model": name, "prompt_tokens": prompt_tokens, "ttft_miss_s": min(miss), "ttft_hit_s": min(hit),
            "speedup": min(miss) / min(hit), "identical_outputs": same, "cache": stats}


async def bench_turns(cfg, path: Path, name: str, bar) -> dict:
    """An agent loop: each turn adds a tool call and its result; TTFT of the last turn."""
    tools = [{"type": "function", "function": {
        "name": "read_doc", "description": "Read the documentation of a standard-library function.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]
    out = {"model": name}
    for label, cache_bytes in (("without_cache", 0), ("with_cache", 1 << 30)):
        engine = Engine(path, show_progress=False, prefix_cache_bytes=cache_bytes, max_model_len=CONTEXT, mtp="off")
        await engine.start()
        encode = engine.encode
        docs = corpus()
        chat = [{"role": "system", "content": engine.tokenizer.decode(natural_tokens(cfg["system_tokens"] // 2, encode))},
                {"role": "user", "content": "Explain how to walk a directory tree and copy files."}]
        times = []
        for turn in range(cfg["turns"]):
            t, _ = await ttft(engine, messages=chat, params={"max_tokens": 4}, tools=tools)
            times.append(t)
            call = {"id": f"call_{turn}", "type": "function",
                    "function": {"name": "read_doc", "arguments": json.dumps({"name": f"doc{turn}"})}}
            chat = chat + [{"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": call["id"], "content": docs[turn * 7][:1500]}]
            bar.update()
        out[label] = {"ttft_per_turn_s": times, "prompt_tokens_last_turn": len(
            engine.apply_chat_template(chat[:-2], tools=tools))}
        await engine.close()
    out["turn5_speedup"] = out["without_cache"]["ttft_per_turn_s"][-1] / out["with_cache"]["ttft_per_turn_s"][-1]
    return out


async def bench_burst(cfg, path: Path, name: str, bar) -> dict:
    """One new system prompt, ``burst`` requests at once: each prefills its own copy, or the
    others wait for the first one's snapshot. Alternated, a new system prompt each repeat."""
    engines = {label: Engine(path, show_progress=False, max_model_len=CONTEXT, mtp="off",
                             prefix_cache_wait_for_prefill=wait)
               for label, wait in (("separate", False), ("shared", True))}
    for engine in engines.values():
        await engine.start()
    encode = engines["shared"].encode
    waves = []
    for rep in range(cfg["burst_reps"]):
        system = engines["shared"].tokenizer.decode(natural_tokens(cfg["system_tokens"], encode, offset=11 + 5 * rep))
        waves.append([[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what does "
                       f"{corpus()[i].split(':')[0]} return?"}] for i in range(cfg["burst"])])
    return {"model": name, **await _bursts(engines, waves, bar)}


async def bench_document_burst(cfg, path: Path, name: str, bar) -> dict:
    """Questions about one new document in one user message, ``burst`` requests at once:
    without "shared" snapshots each prefills the document; with them the first request
    stores it where the prompts queued behind it part from its own, and they wait for it.
    Alternated, a new document each repeat."""
    engines = {label: Engine(path, show_progress=False, max_model_len=CONTEXT, mtp="off", prefix_cache_shared=on)
               for label, on in (("separate", False), ("shared", True))}
    for engine in engines.values():
        await engine.start()
    waves = []
    for rep in range(cfg["burst_reps"]):
        document, names = _document(engines["shared"].encode, cfg["system_tokens"], offset=3 + rep)
        waves.append([[{"role": "system", "content": "Answer from the context."},
                       {"role": "user", "content": f"Context:\n{document}\n\nWhat does {names[i]} return?"}]
                      for i in range(cfg["burst"])])
    return {"model": name, **await _bursts(engines, waves, bar)}


async def _bursts(engines: dict, waves: list, bar) -> dict:
    """Each wave of chats submitted at once to the engine prefilling "separate" copies, then
    to the one where they are "shared"; the best wave of each (by wall time), their ratios,
    whether both answered alike. Closes the engines."""
    params = {"max_tokens": 4}
    runs = {label: [] for label in engines}
    same = True
    for chats in waves:
        outputs = {}
        for label, engine in engines.items():
            before = engine.stats()["prefill_tokens"]
            t0 = time.perf_counter()
            done = await asyncio.gather(*[ttft(engine, messages=c, params=params) for c in chats])
            wall = time.perf_counter() - t0
            firsts = [t for t, _ in done]
            outputs[label] = [ids for _, ids in done]
            runs[label].append({"mean_ttft_s": sum(firsts) / len(firsts), "last_ttft_s": max(firsts),
                                "wall_s": wall, "prefill_tokens": engine.stats()["prefill_tokens"] - before})
            bar.update()
        same &= outputs["separate"] == outputs["shared"]
    prompt_tokens = len(engines["shared"].apply_chat_template(chats[0]))
    waits = engines["shared"].stats()["prefix_cache"]["prefill_waits"]
    for engine in engines.values():
        await engine.close()
    best = {label: min(r, key=lambda x: x["wall_s"]) for label, r in runs.items()}
    return {"requests": len(chats), "prompt_tokens": prompt_tokens, **best,
            "speedup_mean_ttft": best["separate"]["mean_ttft_s"] / best["shared"]["mean_ttft_s"],
            "speedup_wall": best["separate"]["wall_s"] / best["shared"]["wall_s"],
            "prefill_waits": waits, "identical_outputs": same}


async def bench_few_shot(cfg, path: Path, name: str, bar) -> dict:
    """Few-shot examples as messages, a new question each request, alternating between an
    engine without the "history" snapshot and one with it. The first two requests of each
    store what the engine keeps (the examples on the second); the rest are measured."""
    # Without: nor the "shared" point, which would keep the examples where the prompts part.
    engines = {label: Engine(path, show_progress=False, max_model_len=CONTEXT, mtp="off", prefix_cache_history=on,
                             prefix_cache_shared=on)
               for label, on in (("without", False), ("with", True))}
    for engine in engines.values():
        await engine.start()
    encode = engines["with"].encode
    docs, examples, tokens = corpus(), [], 0
    while tokens < cfg["system_tokens"]:  # example turns up to about the burst's system prompt
        doc = docs[(len(examples) * 5 + 3) % len(docs)]
        pair = (f"What does {doc.split(':')[0]} do?", doc[:1200])
        examples.append(pair)
        tokens += len(encode(pair[0] + pair[1])) + 10

    def chat(i):
        msgs = [{"role": "system", "content": "Answer like the examples."}]
        for q, a in examples:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return msgs + [{"role": "user", "content": f"Question {i}: what does {docs[i].split(':')[0]} return?"}]

    run = await _alternate(engines, chat, cfg["few_shot"] + 2, bar)
    return {"model": name, "examples": len(examples), **run, "history_hits": run["hits_by_kind"]["history"]}


async def bench_document(cfg, path: Path, name: str, bar) -> dict:
    """Questions about one document written in one user message (a RAG template), alternating
    between an engine without "shared" snapshots and one with them. The template marks no
    point inside the message and the hybrid model's cache cannot be cut back, so without
    them only the short system prompt is reused; with them the second request stores the
    document where it parts from the first, and the rest start there."""
    engines = {label: Engine(path, show_progress=False, max_model_len=CONTEXT, mtp="off", prefix_cache_shared=on)
               for label, on in (("without", False), ("with", True))}
    for engine in engines.values():
        await engine.start()
    document, names = _document(engines["with"].encode, cfg["system_tokens"], offset=2)

    def chat(i):
        return [{"role": "system", "content": "Answer from the context."},
                {"role": "user", "content": f"Context:\n{document}\n\nQuestion {i}: what does {names[i]} return?"}]

    run = await _alternate(engines, chat, cfg["few_shot"] + 2, bar)
    return {"model": name, **run, "shared_hits": run["hits_by_kind"]["shared"]}


def _document(encode, tokens: int, *, offset: int) -> tuple[str, list[str]]:
    """A document of about ``tokens`` tokens (docstrings, picked from ``offset`` on), and
    the names of the functions the corpus documents."""
    docs, parts = corpus(), []
    while len(encode("\n\n".join(parts))) < tokens:
        parts.append(docs[(len(parts) * 7 + offset) % len(docs)][:1500])
    return "\n\n".join(parts), [d.split(":")[0] for d in docs]


async def _alternate(engines: dict, chat, n: int, bar) -> dict:
    """Request ``chat(i)`` for i < n on the engine "without" a snapshot, then on the one
    "with" it; TTFT of each, their mean from the third request on (the first two store what
    the engine keeps), whether both answered alike. Closes the engines."""
    times = {label: [] for label in engines}
    same = True
    for i in range(n):
        outputs = {}
        for label, engine in engines.items():
            t, outputs[label] = await ttft(engine, messages=chat(i), params={"max_tokens": 4})
            times[label].append(t)
        same &= outputs["without"] == outputs["with"]
        bar.update()
    prompt_tokens = len(engines["with"].apply_chat_template(chat(0)))
    hits = engines["with"].stats()["prefix_cache"]["hits_by_kind"]
    for engine in engines.values():
        await engine.close()
    mean = {label: sum(t[2:]) / len(t[2:]) for label, t in times.items()}
    return {"prompt_tokens": prompt_tokens, "requests": n, "ttft_per_request_s": times,
            "mean_ttft_without_s": mean["without"], "mean_ttft_with_s": mean["with"],
            "speedup": mean["without"] / mean["with"], "hits_by_kind": hits, "identical_outputs": same}


async def bench(args) -> dict:
    from tqdm.auto import tqdm

    cfg = QUICK if args.quick else FULL
    if args.long and not args.quick:
        cfg = {**cfg, "lengths": cfg["lengths"] + (16384,)}
    root = Path(args.model_dir or tempfile.mkdtemp(prefix="tandem-bench-"))
    tag = "-quick" if args.quick else ""
    models = {"target": ("llama", cfg["target"]), "draft": ("draft", cfg["draft"]),
              "hybrid": ("qwen3_5", cfg["hybrid"])}
    paths = {}
    for role, (kind, sizes) in models.items():
        paths[role] = root / f"bench-{role}{tag}"
        if not (paths[role] / "config.json").exists():
            print(f"building the {role} model ({kind}) at {paths[role]} ...", flush=True)
            make_tiny_model(kind, paths[role], seed=0, max_position_embeddings=CONTEXT, **sizes)
    total = (2 * len(cfg["lengths"]) * cfg["reps"] + 2 * cfg["cache_reps"] + 4 * cfg["turns"]
             + 4 * cfg["burst_reps"] + 2 * (cfg["few_shot"] + 2))
    bar = tqdm(total=total, desc="long-prompt benchmark", unit="run")
    results = {
        "models": {role: {"kind": models[role][0], **models[role][1]} for role in models},
        "specprefill": await bench_specprefill(cfg, paths["target"], paths["draft"], bar),
        "system_cache": [await bench_system_cache(cfg, paths["target"], "llama", bar),
                         await bench_system_cache(cfg, paths["hybrid"], "qwen3_5", bar)],
        "multi_turn": [await bench_turns(cfg, paths["target"], "llama", bar),
                       await bench_turns(cfg, paths["hybrid"], "qwen3_5", bar)],
        "burst": await bench_burst(cfg, paths["hybrid"], "qwen3_5", bar),
        "few_shot": await bench_few_shot(cfg, paths["hybrid"], "qwen3_5", bar),
        "document": await bench_document(cfg, paths["hybrid"], "qwen3_5", bar),
        "document_burst": await bench_document_burst(cfg, paths["hybrid"], "qwen3_5", bar),
    }
    bar.close()
    return results


def plot(results: dict, plt):
    fig, axes = plt.subplots(1, 7, figsize=(26, 3.6))
    bars = [
        (axes[0], "SpecPrefill (keep 20%)",
         [(f"{r['prompt_tokens'] // 1024}K", r["ttft_full_s"], r["ttft_specprefill_s"]) for r in results["specprefill"]],
         ("full prefill", "SpecPrefill")),
        (axes[1], "system-prompt cache",
         [(r["model"], r["ttft_miss_s"], r["ttft_hit_s"]) for r in results["system_cache"]], ("miss", "hit")),
        (axes[2], "agent turn 5",
         [(r["model"], r["without_cache"]["ttft_per_turn_s"][-1], r["with_cache"]["ttft_per_turn_s"][-1])
          for r in results["multi_turn"]], ("no prefix cache", "prefix cache")),
        (axes[3], f"{results['burst']['requests']} at once, one system prompt",
         [(what, results["burst"]["separate"][key], results["burst"]["shared"][key])
          for what, key in (("mean", "mean_ttft_s"), ("last", "last_ttft_s"))], ("each prefills it", "prefilled once")),
        (axes[4], f"few-shot examples, {results['few_shot']['prompt_tokens']} tokens",
         [(results["few_shot"]["model"], results["few_shot"]["mean_ttft_without_s"],
           results["few_shot"]["mean_ttft_with_s"])], ("system prompt reused", "examples reused")),
        (axes[5], f"one document, new questions, {results['document']['prompt_tokens']} tokens",
         [(results["document"]["model"], results["document"]["mean_ttft_without_s"],
           results["document"]["mean_ttft_with_s"])], ("system prompt reused", "document reused")),
        (axes[6], f"{results['document_burst']['requests']} at once, one document",
         [(what, results["document_burst"]["separate"][key], results["document_burst"]["shared"][key])
          for what, key in (("mean", "mean_ttft_s"), ("last", "last_ttft_s"))],
         ("each prefills it", "prefilled once")),
    ]
    for ax, title, rows, names in bars:
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label=names[0])
        ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label=names[1])
        for i, r in enumerate(rows):
            ax.text(i + 0.2, r[2], f"{r[1] / r[2]:.1f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), [r[0] for r in rows])
        ax.set_title(title)
        ax.set_ylabel("time to first token (s)")
        ax.legend(fontsize=7)
    return fig


def _print_burst(b: dict, what: str) -> None:
    print(f"\nA burst of {b['requests']} requests, {what} ({b['model']}, {b['prompt_tokens']} prompt tokens each)")
    for label, how in (("separate", "each prefills it"), ("shared", "prefilled once")):
        r = b[label]
        print(f"{how:>17}: mean TTFT {r['mean_ttft_s']:.3f}s, last {r['last_ttft_s']:.3f}s, "
              f"{r['prefill_tokens']} tokens prefilled")
    print(f"{'':>17}  mean TTFT {b['speedup_mean_ttft']:.2f}x, burst {b['speedup_wall']:.2f}x, identical "
          f"{b['identical_outputs']}")


def main(argv=None) -> int:
    ap = report.arguments(__doc__, "smaller models and prompts")
    ap.add_argument("--long", action="store_true", help="also a 16K-token SpecPrefill prompt (full mode)")
    args = report.parse(ap, argv)
    results = asyncio.run(bench(args))
    results["machine"] = report.machine()
    print("\nP3 SpecPrefill, attention-only target, keep 20% of chunks")
    print(f"{'prompt':>7} {'full TTFT':>10} {'SpecPrefill':>12} {'speedup':>8} {'kept':>6} {'agree@32':>9}")
    for r in results["specprefill"]:
        print(f"{r['prompt_tokens']:>7} {r['ttft_full_s']:>9.2f}s {r['ttft_specprefill_s']:>11.2f}s "
              f"{r['speedup']:>7.2f}x {r['keep_ratio']:>6.0%} {r['positions_equal_mean']:>9.0%}")
    print("\nP4 system-prompt cache: hit vs miss")
    print(f"{'model':>8} {'prompt':>7} {'miss TTFT':>10} {'hit TTFT':>9} {'speedup':>8}  identical")
    for r in results["system_cache"]:
        print(f"{r['model']:>8} {r['prompt_tokens']:>7} {r['ttft_miss_s']:>9.3f}s {r['ttft_hit_s']:>8.3f}s "
              f"{r['speedup']:>7.1f}x  {r['identical_outputs']}")
    print("\nMulti-turn agent: TTFT of turn 5")
    for r in results["multi_turn"]:
        print(f"{r['model']:>8}: {r['without_cache']['ttft_per_turn_s'][-1]:.3f}s without the prefix cache, "
              f"{r['with_cache']['ttft_per_turn_s'][-1]:.3f}s with it: {r['turn5_speedup']:.1f}x "
              f"({r['with_cache']['prompt_tokens_last_turn']} prompt tokens)")
    b, db = results["burst"], results["document_burst"]
    _print_burst(b, "one new system prompt")
    f = results["few_shot"]
    print(f"\nFew-shot examples as messages ({f['model']}, {f['examples']} examples, {f['prompt_tokens']} prompt "
          f"tokens): mean TTFT {f['mean_ttft_without_s']:.3f}s without the history snapshot, "
          f"{f['mean_ttft_with_s']:.3f}s with it: {f['speedup']:.1f}x, identical {f['identical_outputs']}")
    d = results["document"]
    print(f"\nQuestions about one document in one message ({d['model']}, {d['prompt_tokens']} prompt tokens): "
          f"mean TTFT {d['mean_ttft_without_s']:.3f}s without shared snapshots, {d['mean_ttft_with_s']:.3f}s "
          f"with them: {d['speedup']:.1f}x, identical {d['identical_outputs']}")
    _print_burst(db, "questions about one new document in one message")
    report.write(results, args.output, plot)
    if not all(r["identical_outputs"] for r in results["system_cache"]) or not b["identical_outputs"] \
            or not f["identical_outputs"] or not d["identical_outputs"] or not db["identical_outputs"]:
        print("FAILED: a prefix-cache hit answered differently from a miss (the cache must be exact)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
