"""The offline demo: stream a chat answer from the default model, then a concurrent batch.

Run with ``make demo`` or ``python -m mlx_tandem.demo``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from . import Engine, SamplingParams
from .default_model import IS_RANDOM


async def run(model: str | None, concurrency: int, max_tokens: int) -> None:
    engine = Engine(model)
    print("Loading the model (built offline on first use)...", flush=True)
    await engine.start()
    if model is None and IS_RANDOM:
        print("\nNote: the embedded default model has random weights until a trained one ships, "
              "so its words are noise.\nWhat you see working is the engine: streaming, continuous "
              "batching, hybrid (GatedDeltaNet + attention) caches, stats.\n")
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me about Python's json module."},
    ]
    print("User: Tell me about Python's json module.\nAssistant: ", end="", flush=True)
    async for delta in engine.stream_chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=0)):
        print(delta.text, end="", flush=True)
        if delta.finish_reason:
            print(f"\n[finish_reason={delta.finish_reason}, usage={delta.usage}]")

    print(f"\nNow {concurrency} concurrent requests share each forward step...", flush=True)
    questions = [f"Question {i}: what does functools.lru_cache do?" for i in range(concurrency)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[
        engine.chat([{"role": "user", "content": q}], SamplingParams(max_tokens=max_tokens))
        for q in questions
    ])
    wall = time.perf_counter() - t0
    tokens = sum(o.usage.completion_tokens for o in outs)
    stats = engine.stats()
    print(f"{concurrency} answers, {tokens} tokens in {wall:.2f}s -> {tokens / wall:.1f} tokens/s overall")
    print("Engine stats:")
    for key in ("requests", "finished", "max_batch_size", "mean_batch_size", "prompt_tokens",
                "generation_tokens", "prompt_tokens_per_s", "generation_tokens_per_s", "mean_ttft_s", "blas"):
        value = stats[key]
        print(f"  {key:24s} {value:.2f}" if isinstance(value, float) else f"  {key:24s} {value}")
    await engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(run(args.model, args.concurrency, args.max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
