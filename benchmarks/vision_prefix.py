"""Conversations about images: the vision lane's prefix cache (lanes/vision_cache.py).

Side by side in one run (the machines are noisy), on a hybrid qwen3_5_vl factory model
(GatedDeltaNet + attention, a vision tower), greedy:

  V1 a conversation about one image: time to first token (TTFT) of each turn, the vision
     prefix cache off (``vision_prefix_cache_bytes=0``) vs on, turn by turn on two engines.
     From turn 2 on, the cached engine restores the conversation through the previous turn.
  V2 a burst of new image conversations submitted at once, cache off vs on: what the cache
     costs where it cannot help (snapshots stored, a prefill chunk ending at each one); mean
     and last TTFT and the burst's wall time. New images still prefill together: only a
     prompt that may be restored prefills alone (lanes/vision_cache.py).
  V3 questions about one image in separate requests (a new conversation each): TTFT of
     each, cache off vs on, alternating. From the second request the cache keeps the
     image's features and snapshots where the image ends, which the later ones restore.

Both engines must answer alike (the cache is exact); the run fails otherwise. mlx-vlm
embeds the whole prompt before it restores, so the cached engine keeps the images' features
too: an image it has seen skips the vision encoder (``encoder_skips`` in the JSON).

    python benchmarks/vision_prefix.py results/vision_prefix.json            # full (~5 min)
    python benchmarks/vision_prefix.py results/vision_prefix.json --quick    # under a minute
"""

from __future__ import annotations

import asyncio
import base64
import io
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

FULL = dict(model=dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
                       linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=4,
                       vision_depth=4, vision_hidden_size=128, vision_intermediate_size=256, vision_num_heads=4),
            image=448, turns=5, burst=4, answer=24, questions=6)
QUICK = dict(model=dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
                        linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=2),
             image=224, turns=3, burst=3, answer=12, questions=4)
CONTEXT = 8192


def image_uri(seed: int, size: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def conversation(seed: int, size: int) -> list[dict]:
    return [{"role": "system", "content": "You describe pictures in detail for people who cannot see them."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_uri(seed, size)}},
                                         {"type": "text", "text": "What is in this picture? Describe it."}]}]


async def ttft(engine: Engine, messages, params) -> tuple[float, list[int], int]:
    """(seconds to the first token, token ids, cached prompt tokens) of one request."""
    t0 = time.perf_counter()
    stream = await engine.open_chat_stream(messages, params)
    first, ids, cached = None, [], 0
    async for delta in stream:
        if first is None and (delta.token_ids or delta.finish_reason):
            first = time.perf_counter() - t0
        ids.extend(delta.token_ids)
        if delta.usage is not None:
            cached = delta.usage.cached_tokens
    return first, ids, cached


async def bench_turns(cfg, engines: dict, bar) -> dict:
    params = {"max_tokens": cfg["answer"]}
    chats = {label: conversation(1, cfg["image"]) for label in engines}
    times = {label: [] for label in engines}
    cached, prompt_tokens, same = [], [], True
    for turn in range(cfg["turns"]):
        out = {}
        for label, engine in engines.items():
            t, ids, c = await ttft(engine, chats[label], params)
            times[label].append(t)
            out[label] = ids
            if label == "on":
                cached.append(c)
        same &= out["off"] == out["on"]
        prompt_tokens.append(engines["on"].stats()["prompt_tokens"])
        text = engines["on"].tokenizer.decode(out["on"], skip_special_tokens=True)
        for chat in chats.values():
            chat += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Tell me more ({turn})."}]
        bar.update()
    last = cfg["turns"] - 1
    return {"ttft_per_turn_s": times, "cached_tokens_per_turn": cached, "identical_outputs": same,
            "last_turn_speedup": times["off"][last] / times["on"][last],
            "mean_later_turn_speedup": sum(times["off"][1:]) / sum(times["on"][1:])}


async def bench_burst(cfg, engines: dict, bar) -> dict:
    params = {"max_tokens": cfg["answer"]}
    out = {}
    for label, engine in engines.items():
        chats = [conversation(100 + i, cfg["image"]) for i in range(cfg["burst"])]
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(ttft(engine, c, params) for c in chats))
        wall = time.perf_counter() - t0
        ttfts = [r[0] for r in runs]
        out[label] = {"mean_ttft_s": sum(ttfts) / len(ttfts), "last_ttft_s": max(ttfts), "wall_s": wall,
                      "ids": [r[1] for r in runs]}
        bar.update()
    same = out["off"].pop("ids") == out["on"].pop("ids")
    return {"requests": cfg["burst"], **out, "identical_outputs": same,
            "wall_ratio_on_over_off": out["on"]["wall_s"] / out["off"]["wall_s"],
            "mean_ttft_ratio_on_over_off": out["on"]["mean_ttft_s"] / out["off"]["mean_ttft_s"]}


QUESTIONS = ["What colour is the sky in it?", "Is there a person in it?", "Describe the background.",
             "Is there any text in it?", "What is the main object?", "Is it day or night?", "Count the animals.",
             "What is in the bottom left corner?"]


async def bench_questions(cfg, engines: dict, bar) -> dict:
    params = {"max_tokens": cfg["answer"]}
    image = image_uri(7, cfg["image"])
    times = {label: [] for label in engines}
    cached, same = [], True

    def ask(question):
        return [{"role": "system", "content": "You describe pictures in detail for people who cannot see them."},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": question}]}]

    for question in QUESTIONS[:cfg["questions"]]:
        out = {}
        for label, engine in engines.items():
            t, out[label], c = await ttft(engine, ask(question), params)
            times[label].append(t)
            if label == "on":
                cached.append(c)
        same &= out["off"] == out["on"]
    bar.update()
    later = {label: sum(t[2:]) / len(t[2:]) for label, t in times.items()}
    return {"ttft_per_question_s": times, "cached_tokens_per_question": cached, "identical_outputs": same,
            "later_question_speedup": later["off"] / later["on"]}


async def bench(args) -> dict:
    from tqdm.auto import tqdm

    cfg = QUICK if args.quick else FULL
    root = Path(args.model_dir or tempfile.mkdtemp(prefix="tandem-bench-"))
    path = root / ("bench-vl" + ("-quick" if args.quick else ""))
    if not (path / "config.json").exists():
        print(f"building the vision model (qwen3_5_vl) at {path} ...", flush=True)
        make_tiny_model("qwen3_5_vl", path, seed=0, max_position_embeddings=CONTEXT, **cfg["model"])
        # The factory caps images at a few tokens for tests; here an image is as many tokens
        # as its pixels make (448 px: 196 tokens), as a real checkpoint's processor allows.
        config = json.loads((path / "preprocessor_config.json").read_text())
        config["size"]["longest_edge"] = 1024 * 1024
        (path / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    engines = {"off": Engine(path, show_progress=False, vision_prefix_cache_bytes=0, max_model_len=CONTEXT),
               "on": Engine(path, show_progress=False, max_model_len=CONTEXT)}
    for engine in engines.values():
        await engine.start()
    bar = tqdm(total=cfg["turns"] + 3, desc="vision prefix-cache benchmark", unit="run")
    try:
        # Warm both engines (first-call compilation and allocation) on an unrelated image.
        for engine in engines.values():
            await ttft(engine, conversation(999, cfg["image"]), {"max_tokens": 2})
        results = {"model": {"kind": "qwen3_5_vl", **cfg["model"]}, "image_pixels": cfg["image"],
                   "turns": await bench_turns(cfg, engines, bar), "burst": await bench_burst(cfg, engines, bar),
                   "questions": await bench_questions(cfg, engines, bar),
                   "cache": engines["on"].stats()["prefix_cache"]["vision"]}
    finally:
        bar.close()
        for engine in engines.values():
            await engine.close()
    return results


def _ttft_lines(ax, times: dict, xlabel: str, title: str) -> None:
    x = range(1, len(times["off"]) + 1)
    ax.plot(x, times["off"], "o-", label="vision prefix cache off")
    ax.plot(x, times["on"], "o-", label="on")
    ax.set_xticks(list(x))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title)
    ax.legend(fontsize=8)


def plot(results: dict, plt):
    fig, (a, b, q) = plt.subplots(1, 3, figsize=(16, 3.8))
    _ttft_lines(a, results["turns"]["ttft_per_turn_s"], "turn",
                f"a conversation about one {results['image_pixels']}px image")
    burst = results["burst"]
    labels = ("mean TTFT", "last TTFT", "burst wall")
    keys = ("mean_ttft_s", "last_ttft_s", "wall_s")
    b.bar([i - 0.2 for i in range(3)], [burst["off"][k] for k in keys], 0.4, label="vision prefix cache off")
    b.bar([i + 0.2 for i in range(3)], [burst["on"][k] for k in keys], 0.4, label="on")
    b.set_xticks(range(3), labels)
    b.set_ylabel("seconds")
    b.set_title(f"{burst['requests']} new image conversations at once")
    b.legend(fontsize=8)
    _ttft_lines(q, results["questions"]["ttft_per_question_s"], "question (a new request each)",
                "questions about one image")
    return fig


def main(argv=None) -> int:
    args, results = report.measure(__doc__, "a smaller model and image", lambda a: asyncio.run(bench(a)), argv)
    turns, burst, questions = results["turns"], results["burst"], results["questions"]
    print("\nV1 a conversation about one image: TTFT per turn")
    print(f"{'turn':>5} {'cache off':>10} {'cache on':>9} {'cached tokens':>14}")
    for i, (off, on, c) in enumerate(zip(turns["ttft_per_turn_s"]["off"], turns["ttft_per_turn_s"]["on"],
                                         turns["cached_tokens_per_turn"])):
        print(f"{i + 1:>5} {off:>9.3f}s {on:>8.3f}s {c:>14}")
    print(f"last turn {turns['last_turn_speedup']:.2f}x, later turns {turns['mean_later_turn_speedup']:.2f}x; "
          f"identical {turns['identical_outputs']}")
    print(f"\nV2 {burst['requests']} new image conversations at once (on / off): mean TTFT "
          f"{burst['mean_ttft_ratio_on_over_off']:.2f}x, wall {burst['wall_ratio_on_over_off']:.2f}x; "
          f"identical {burst['identical_outputs']}")
    print(f"\nV3 questions about one image, a new request each: TTFT per question (off / on) "
          + ", ".join(f"{a:.3f}/{b:.3f}s" for a, b in zip(questions["ttft_per_question_s"]["off"],
                                                         questions["ttft_per_question_s"]["on"]))
          + f"; cached {questions['cached_tokens_per_question']}; from the third on "
          f"{questions['later_question_speedup']:.2f}x; identical {questions['identical_outputs']}")
    return report.finish(results, args.output, plot, turns["identical_outputs"] and burst["identical_outputs"]
                         and questions["identical_outputs"], "the vision prefix cache answered differently (it must be exact)")


if __name__ == "__main__":
    sys.exit(main())
