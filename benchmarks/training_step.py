"""Why the demo model trains with PyTorch: one training step of the demo architecture in MLX
and in PyTorch, side by side in one run.

The model is the demo model's (a Qwen3.5 hybrid: GatedDeltaNet + attention, from the
factory, as ``scripts/train_demo_model.py`` builds it). Each step is a next-token
cross-entropy forward, backward and AdamW update on the same random batch: MLX through
mlx-lm's ``qwen3_5`` model, PyTorch through transformers' ``Qwen3_5ForCausalLM``. Steps
alternate between them so machine noise hits all; the report is the median tokens/s of
each and their ratios. PyTorch runs twice: float32, and autocast to bfloat16 as the
trainer's ``--bf16`` does (float32 weights and optimizer).

    python benchmarks/training_step.py benchmarks/results/training_step.json [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

# torch before mlx_tandem: mlx_tandem loads OpenBLAS with RTLD_GLOBAL, and a torch imported
# after it runs its training step about 3x slower (measured: 520 vs 1600 tokens/s).
import torch  # noqa: E402
import mlx_tandem  # noqa: E402,F401  - OpenBLAS before mlx
import mlx.core as mx  # noqa: E402
import mlx.nn as mlx_nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
import report  # noqa: E402  - benchmarks/report.py

import train_demo_model as trainer  # noqa: E402  - exits with an install hint without torch


def mlx_step_fn(init_dir: Path):
    from mlx_lm.utils import load_model

    model, _ = load_model(init_dir)
    model.set_dtype(mx.float32)
    lm = getattr(model, "language_model", model)
    opt = optim.AdamW(learning_rate=1e-4, weight_decay=0.01)

    def loss_fn(m, tokens):
        logits = m(tokens[:, :-1])
        return mlx_nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()

    grad_fn = mlx_nn.value_and_grad(lm, loss_fn)

    def step(tokens: np.ndarray) -> None:
        loss, grads = grad_fn(lm, mx.array(tokens))
        opt.update(lm, grads)
        mx.eval(loss, lm.parameters(), opt.state)

    return step


def torch_step_fn(init_dir: Path, bf16: bool = False):
    """``bf16``: the trainer's ``--bf16``, autocast to bfloat16 with float32 weights."""
    import torch
    import torch.nn.functional as F

    lm = trainer.build(init_dir, seed=0, records=[]).lm.train()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-4, weight_decay=0.01)

    def step(tokens: np.ndarray) -> None:
        x = torch.from_numpy(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = lm(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("output", nargs="?", default="benchmarks/results/training_step.json")
    p.add_argument("--steps", type=report.positive_int, default=6, help="timed steps per framework (after one warm-up)")
    p.add_argument("--batch", type=report.positive_int, default=8)
    p.add_argument("--length", type=report.positive_int, default=400)
    args = report.parse(p, argv)
    from tqdm.auto import tqdm

    with tempfile.TemporaryDirectory() as tmp:
        init_dir = Path(tmp) / "init"
        steps = {"torch": torch_step_fn(init_dir), "torch_bf16": torch_step_fn(init_dir, bf16=True),
                 "mlx": mlx_step_fn(init_dir)}
        tokens = np.random.default_rng(0).integers(0, 2000, size=(args.batch, args.length)).astype(np.int64)
        for step in steps.values():  # warm-up: allocation, first-call setup
            step(tokens)
        seconds = {name: [] for name in steps}
        for _ in tqdm(range(args.steps), desc="training steps (both frameworks)", unit="round"):
            for name, step in steps.items():
                t0 = time.perf_counter()
                step(tokens)
                seconds[name].append(time.perf_counter() - t0)

    n = args.batch * args.length
    tok_s = {name: n / statistics.median(s) for name, s in seconds.items()}
    results = {"machine": report.machine(), "batch": args.batch, "length": args.length, "steps": args.steps,
               "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
               "seconds_per_step": seconds, "tokens_per_s": tok_s, "torch_over_mlx": tok_s["torch"] / tok_s["mlx"],
               "torch_bf16_over_torch": tok_s["torch_bf16"] / tok_s["torch"]}
    print(f"\ntraining step, batch {args.batch} x {args.length} tokens, median of {args.steps}:")
    for name, v in tok_s.items():
        print(f"  {name:10s} {v:8.0f} tokens/s")
    print(f"  PyTorch / MLX: {results['torch_over_mlx']:.2f}x")
    print(f"  PyTorch bf16 autocast / float32: {results['torch_bf16_over_torch']:.2f}x")

    def draw(r, plt):
        fig, ax = plt.subplots(figsize=(4, 3))
        ax.bar(list(r["tokens_per_s"]), list(r["tokens_per_s"].values()))
        ax.set_ylabel("training tokens/s")
        ax.set_title(f"demo model training step ({r['torch_over_mlx']:.2f}x)")
        return fig

    report.write(results, args.output, draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
