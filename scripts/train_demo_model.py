"""Train the embedded demo model offline: a small Qwen3.5 hybrid (GatedDeltaNet + attention)
with an MTP head, on the dialogues of ``scripts/demo_data.py``.

    python scripts/train_demo_model.py --out build/demo_model            # train (resumes if interrupted)
    python scripts/train_demo_model.py --out build/demo_model --steps 5  # smoke run

Seeded and resumable: a checkpoint (weights, optimizer state, step) is written every
``--save-every`` steps and picked up on the next run. The result is a Hugging Face-layout
checkpoint in ``<out>/final`` (fp16 on disk; the engine loads float32 on CPU): the factory
tokenizer and chat template, ``mtp.*`` weights for the drafter.

Loss: next-token cross-entropy on assistant tokens only (what the chat template renders
for assistant turns, found by rendering each conversation prefix), plus the MTP head's
cross-entropy for token t+2 from (hidden_t, embedding of t+1). The MTP head sees the
backbone's hidden state through ``stop_gradient``: it is a drafter and must not change
what the backbone says.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_tandem  # noqa: E402,F401  - loads OpenBLAS before mlx
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from chunked_gdn import patched_gated_delta  # noqa: E402

logger = logging.getLogger("train_demo_model")

#: ~8M parameters: 16 MB in fp16 (the package budget is 25 MB).
DEMO_SIZES = dict(hidden_size=256, num_hidden_layers=6, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
                  linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                  full_attention_interval=2)
MAX_POSITIONS = 4096


# ---------------------------------------------------------------------- data
def encode_dialogue(tokenizer, record: dict) -> tuple[list[int], list[int]] | None:
    """Token ids and a 0/1 loss mask over the assistant turns (None if the template renders
    a prefix differently from the whole, which would make the mask wrong)."""
    msgs, tools = record["messages"], record.get("tools")
    def render(m, gen):
        text = tokenizer.apply_chat_template(m, tools=tools, tokenize=False, add_generation_prompt=gen)
        return tokenizer.encode(text, add_special_tokens=False)

    ids = list(render(msgs, False))
    mask = [0] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = list(render(msgs[:i], True))
        end = list(render(msgs[: i + 1], False))
        if ids[: len(start)] != start or ids[: len(end)] != end:
            return None
        for t in range(len(start), len(end)):
            mask[t] = 1
    return ids, mask


def load_examples(tokenizer, data_path: Path, n: int, seed: int, max_len: int):
    if not data_path.exists():
        from demo_data import generate

        data_path.parent.mkdir(parents=True, exist_ok=True)
        with data_path.open("w") as f:
            for r in generate(n, seed=seed):
                f.write(json.dumps(r) + "\n")
    examples, skipped = [], 0
    for line in data_path.read_text().splitlines():
        enc = encode_dialogue(tokenizer, json.loads(line))
        if enc is None or len(enc[0]) > max_len or sum(enc[1]) == 0:
            skipped += 1
            continue
        examples.append(enc)
    logger.info("%d training dialogues (%d skipped: template mismatch or longer than %d)",
                len(examples), skipped, max_len)
    return examples


def batches(examples, batch_size: int, seed: int, pad_id: int):
    """Endless length-bucketed batches, right-padded (causal: padding never reaches real tokens)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(examples))
        # Sort within windows of 50 batches: similar lengths together, still shuffled overall.
        window = batch_size * 50
        for w in range(0, len(order), window):
            idx = sorted(order[w:w + window], key=lambda i: len(examples[i][0]))
            groups = [idx[j:j + batch_size] for j in range(0, len(idx), batch_size)]
            for gi in rng.permutation(len(groups)):
                group = groups[gi]
                width = max(len(examples[i][0]) for i in group)
                tok = np.full((len(group), width), pad_id, dtype=np.int32)
                msk = np.zeros((len(group), width), dtype=np.float32)
                for r, i in enumerate(group):
                    ids, mask = examples[i]
                    tok[r, : len(ids)] = ids
                    msk[r, : len(mask)] = mask
                yield mx.array(tok), mx.array(msk)


# ---------------------------------------------------------------------- model
def build(init_dir: Path, seed: int):
    from mlx_lm.utils import load_model
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Model as MTPModel
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig as MTPConfig

    from mlx_tandem.testing.factory import make_tiny_model

    if not (init_dir / "config.json").exists():
        make_tiny_model("qwen3_5", init_dir, seed=seed, mtp_layers=1, max_position_embeddings=MAX_POSITIONS,
                        **DEMO_SIZES)
    model, config = load_model(init_dir)
    mx.random.seed(seed + 1)
    mtp = MTPModel(MTPConfig.from_dict({"model_type": "qwen3_5_mtp", "text_config": config["text_config"]}))
    model.set_dtype(mx.float32)
    mtp.set_dtype(mx.float32)
    return model, mtp, config


class Trainee(nn.Module):
    """Backbone + MTP head as one module, so one optimizer and one checkpoint hold both."""

    def __init__(self, model, mtp):
        super().__init__()
        self.model = model
        self.mtp = mtp

    def losses(self, tokens: mx.array, mask: mx.array):
        lm = self.model.language_model
        h = lm.model(tokens[:, :-1])  # post-norm hidden states, as the drafter receives them
        logits = lm.lm_head(h)
        m1 = mask[:, 1:]
        ce = nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="none")
        main = (ce * m1).sum() / mx.maximum(m1.sum(), 1)
        # MTP: from h_t and embed(token t+1), predict token t+2.
        hs = mx.stop_gradient(h[:, :-1])
        emb = lm.model.embed_tokens(tokens[:, 1:-1])
        pos = mx.arange(hs.shape[1])[None]
        mh = self.mtp._forward_hidden(emb, hs, None, pos)
        m2 = mask[:, 2:]
        ce2 = nn.losses.cross_entropy(lm.lm_head(mh), tokens[:, 2:], reduction="none")
        mtp = (ce2 * m2).sum() / mx.maximum(m2.sum(), 1)
        return main, mtp


# ---------------------------------------------------------------------- checkpoints
def save_checkpoint(ckpt: Path, trainee: Trainee, opt, step: int) -> None:
    tmp = ckpt.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(trainee.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    shutil.rmtree(ckpt, ignore_errors=True)
    tmp.rename(ckpt)  # atomic: a crash leaves the previous checkpoint intact


def load_checkpoint(ckpt: Path, trainee: Trainee, opt) -> int:
    if not (ckpt / "state.json").exists():
        return 0
    trainee.load_weights(list(mx.load(str(ckpt / "weights.safetensors")).items()))
    opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
    return json.loads((ckpt / "state.json").read_text())["step"]


def export(final: Path, init_dir: Path, trainee: Trainee) -> None:
    """HF layout, fp16: the factory's own inverse of mlx-lm's sanitize, plus ``mtp.*``."""
    from mlx_tandem.testing.factory import qwen3_5_to_hf

    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(init_dir, final, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    hf = qwen3_5_to_hf(dict(tree_flatten(trainee.model.parameters())))
    from mlx_tandem.spec.mtp_head import is_zero_centred_norm

    for k, v in tree_flatten(trainee.mtp.parameters()):
        hf["mtp." + k] = v - 1.0 if is_zero_centred_norm(k, v) else v
    mx.save_safetensors(str(final / "model.safetensors"), {k: v.astype(mx.float16) for k, v in hf.items()},
                        metadata={"format": "mlx"})


# ---------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/demo_model"))
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=832)  # tool dialogues: ~130 tokens of template instructions + ~100 per tool
    p.add_argument("--n-dialogues", type=int, default=40000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--mtp-weight", type=float, default=0.5)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    mx.random.seed(args.seed)
    init_dir, ckpt, final = args.out / "init", args.out / "checkpoint", args.out / "final"
    model, mtp, _ = build(init_dir, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    examples = load_examples(tokenizer, args.out / "data.jsonl", args.n_dialogues, args.seed, args.max_len)
    trainee = Trainee(model, mtp)
    n_params = sum(v.size for _, v in tree_flatten(trainee.parameters()))
    logger.info("%.2fM parameters (%.1f MB in fp16)", n_params / 1e6, n_params * 2 / 2**20)

    warmup = min(100, args.steps // 10 + 1)
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-5, args.lr, warmup),
         optim.cosine_decay(args.lr, max(1, args.steps - warmup), end=args.lr * 0.1)], [warmup])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    opt.init(trainee.trainable_parameters())
    step = load_checkpoint(ckpt, trainee, opt)
    if step:
        logger.info("resumed at step %d", step)

    def loss_fn(tokens, mask):
        main_loss, mtp_loss = trainee.losses(tokens, mask)
        return main_loss + args.mtp_weight * mtp_loss, (main_loss, mtp_loss)

    grad_fn = nn.value_and_grad(trainee, loss_fn)
    data = batches(examples, args.batch, args.seed, tokenizer.pad_token_id or 0)
    for _ in range(step):  # the same batch sequence as an uninterrupted run
        next(data)
    bar = tqdm(total=args.steps, initial=step, desc="training", unit="step")
    loss = None  # stays None when resuming a finished run: export only
    with patched_gated_delta():
        while step < args.steps:
            tokens, mask = next(data)
            t0 = time.perf_counter()
            (loss, (main_loss, mtp_loss)), grads = grad_fn(tokens, mask)
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            opt.update(trainee, grads)
            mx.eval(trainee.parameters(), opt.state, loss)
            step += 1
            dt = time.perf_counter() - t0
            bar.set_postfix(loss=f"{main_loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}",
                            tok_s=f"{tokens.size / dt:.0f}")
            bar.update()
            if step % args.save_every == 0 or step == args.steps:
                save_checkpoint(ckpt, trainee, opt, step)
    bar.close()
    if loss is not None and not math.isfinite(loss.item()):
        logger.error("loss is not finite; not exporting")
        return 1
    export(final, init_dir, trainee)
    logger.info("exported %s", final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
