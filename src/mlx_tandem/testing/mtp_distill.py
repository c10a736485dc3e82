"""Self-distil a checkpoint's MTP head on the backbone's own greedy continuations.

A factory model's MTP head is random, so it never predicts what the backbone says and
speculation accepts nothing. Training the head alone (backbone frozen) to predict token t+2
from (h_t, token t+1) on the backbone's greedy outputs gives a head whose acceptance is
high on exactly the traffic the tests and benchmarks run: seconds to a minute on CPU.

    python scripts/distill_mtp_head.py PATH [--steps 300]
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

_WORDS = ("apple river stone cloud seven table window garden music paper orange bridge "
          "winter summer planet engine yellow silver forest letter number circle castle").split()


def default_prompts(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8))) for _ in range(n)]


def greedy_continuations(model, tokenizer, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """prompt + greedy continuation token ids, one list per prompt (mlx-lm BatchGenerator)."""
    from mlx_lm.generate import BatchGenerator

    ids = [tokenizer.encode(p) for p in prompts]
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids], completion_batch_size=32)
    uids = gen.insert(ids, max_tokens=[max_tokens] * len(ids))
    out = {u: list(p) for u, p in zip(uids, ids)}
    done = set()
    while len(done) < len(uids):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                done.add(r.uid)
    gen.close()
    return [out[u] for u in uids]


def distill_mtp_head(path: str | Path, *, prompts: Optional[Sequence[str]] = None, n_prompts: int = 96,
                     max_tokens: int = 48, steps: int = 300, lr: float = 3e-3, batch_size: int = 16,
                     seed: int = 0, show_progress: bool = False) -> dict:
    """Train the MTP head of the checkpoint at ``path`` in place; returns loss numbers."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, load_tokenizer
    from tqdm.auto import tqdm

    from ..spec.mtp_head import MTPHead, is_zero_centred_norm, load_mtp_head
    from .vlm_factory import fused_experts

    path = Path(path)
    model, config = load_model(path)
    model.set_dtype(mx.float32)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    lm = model.language_model
    head = load_mtp_head(path, lm, config, dtype=mx.float32)
    if head is None:
        head = MTPHead(lm.args, 1)
    head.train()
    seqs = greedy_continuations(model, tokenizer, prompts or default_prompts(n_prompts, seed), max_tokens)

    width = max(len(s) for s in seqs)
    pad = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else 0
    tokens = np.full((len(seqs), width), pad, dtype=np.int32)
    mask = np.zeros((len(seqs), width), dtype=np.float32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
        mask[i, : len(s)] = 1
    tokens, mask = mx.array(tokens), mx.array(mask)
    hidden = mx.stop_gradient(lm.model(tokens))  # frozen backbone: (N, T, H), post-norm
    embeds = mx.stop_gradient(lm.model.embed_tokens(tokens))
    mx.eval(hidden, embeds)

    def to_logits(h):
        return lm.lm_head(h) if not lm.args.tie_word_embeddings else lm.model.embed_tokens.as_linear(h)

    def head_logits(rows):
        return to_logits(head(embeds[rows, 1:-1], hidden[rows, :-2]))

    def masked_ce(logits, rows, shift):
        m = mask[rows, shift:]
        ce = nn.losses.cross_entropy(logits, tokens[rows, shift:], reduction="none")
        return (ce * m).sum() / mx.maximum(m.sum(), 1)

    def loss_fn(rows):
        m1 = head(embeds[rows, 1:-1], hidden[rows, :-2])  # (h_t, x_t+1) -> x_t+2
        loss = masked_ce(to_logits(m1), rows, 2)
        # Deeper drafts chain the head on its own output: (m_t, x_t+2) -> x_t+3.
        m2 = head(embeds[rows, 2:-1], mx.stop_gradient(m1[:, :-1]))
        return loss + 0.5 * masked_ce(to_logits(m2), rows, 3)

    def accuracy(rows):
        pred = mx.argmax(head_logits(rows), axis=-1)
        m = mask[rows, 2:]
        return float(((pred == tokens[rows, 2:]) * m).sum() / m.sum())

    opt = optim.Adam(learning_rate=lr)
    grad_fn = nn.value_and_grad(head, loss_fn)
    rng = np.random.default_rng(seed)
    all_rows = mx.arange(len(seqs))
    first = float(loss_fn(all_rows))
    for _ in tqdm(range(steps), desc="distilling MTP head", **({} if show_progress else {"disable": True})):
        rows = mx.array(rng.choice(len(seqs), size=min(batch_size, len(seqs)), replace=False))
        loss, grads = grad_fn(rows)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state)
    head.eval()
    last, acc = float(loss_fn(all_rows)), accuracy(all_rows)

    # Write the head back in HF layout (zero-centred norms), replacing any mtp.* tensors.
    files = sorted(path.glob("*.safetensors"))
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    dtype = next(v.dtype for k, v in weights.items() if not k.startswith("mtp."))
    weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    for k, v in fused_experts(dict(tree_flatten(head.parameters()))).items():  # HF's MoE layout
        weights["mtp." + k] = (v - 1.0 if is_zero_centred_norm(k, v) else v).astype(dtype)
    mx.eval(weights)
    for f in files:
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    # "pt": HF's layout, as written (mtp_head reads a file marked "mlx" as already converted).
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    logger.info("MTP head distilled: loss %.3f -> %.3f, top-1 agreement %.1f%%", first, last, 100 * acc)
    return {"loss_before": first, "loss_after": last, "top1_agreement": acc, "sequences": len(seqs)}
