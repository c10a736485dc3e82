"""Compare this machine's MLX device with MLX's CPU backend on what the engine relies on.

The engine is the same code on every backend (docs/design.md, "Backends and numerics"), so
where a GPU run of the suite parts from the CPU one, the question is which operation moved
and by how much. Each check computes the same thing on the default device and on the CPU
stream, from the same arrays, and reports the largest difference relative to the largest
value:

- ``matmul``: a float32 product, the noise floor of the device's GEMMs;
- ``gather_mm``: the mixture-of-experts products (mlx-lm's ``SwitchGLU``), sorted and
  unsorted, at the sizes its prefill, decode and verify steps give them, with the
  activations as mlx-lm shapes them (``expand_dims``) and contiguous;
- ``gather_mm_grad``: their gradients (against numpy's too), which the MTP head's
  self-distillation trains with;
- ``moe_model``: the factory MoE model's last-position logits for prompts alone and in a
  batch, how many greedy picks differ, and how many router top-k choices flip between the
  two backends, with the smallest router margin among the flips (a flip at a router
  near-tie is kernel noise that the routing amplifies; a flip at a clear margin is a bug);
- ``mtp_head``: the model's MTP head on the same inputs.

On the CPU itself every difference is zero. Written for the third CUDA run (2026-11-30),
where the MoE factory model's batched-against-alone test parted at a clear winner and its
self-distilled head accepted 0.3% of drafts; one call of this script tells those causes
apart.

    python scripts/check_backend.py --out backend.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx_tandem  # noqa: E402,F401  - platform set-up before mlx
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402


def _both(fn):
    """fn() on the default device and on the CPU stream, evaluated, as numpy float64."""
    dev = fn()
    mx.eval(dev)
    with mx.stream(mx.cpu):
        ref = fn()
        mx.eval(ref)
    as_np = lambda t: [np.array(a.astype(mx.float32), dtype=np.float64) for a in (t if isinstance(t, (list, tuple)) else [t])]
    return as_np(dev), as_np(ref)


def _rel(dev, ref) -> float:
    return max(float(np.abs(d - r).max() / max(np.abs(r).max(), 1e-30)) for d, r in zip(dev, ref))


def check_matmul() -> dict:
    key = mx.random.key(0)
    a, b = mx.random.normal((256, 512), key=key), mx.random.normal((512, 384), key=mx.random.split(key)[0])
    return {"rel": _rel(*_both(lambda: a @ b))}


def _routed_inputs(tokens: int, experts: int, top_k: int, hidden: int, seed: int):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((tokens, hidden)).astype(np.float32))
    idx = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.uint32)
    return x, mx.array(idx)


def _switch_up(xe, w, idx):
    """One expert projection as mlx-lm 0.32's ``SwitchGLU`` runs it: sorted by expert (the
    grouped path) once 64 or more token-expert pairs are routed, unsorted below."""
    from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

    if idx.size < 64:
        return mx.gather_mm(xe, w.swapaxes(-1, -2), rhs_indices=idx)
    xs, ids, inv = _gather_sort(xe, idx)
    y = mx.gather_mm(xs, w.swapaxes(-1, -2), rhs_indices=ids, sorted_indices=True)
    return _scatter_unsort(y, inv, idx.shape)


def check_gather_mm(experts=4, top_k=2, hidden=128, inter=32, token_counts=(8, 24, 31, 32, 40, 200, 800)) -> list[dict]:
    """SwitchGLU's up projection as mlx-lm 0.32 calls it, at the token counts of a decode
    step (8 rows), a verify step (8 rows x 3), a prompt alone and twenty prompts in a batch."""
    w = mx.random.normal((experts, inter, hidden), key=mx.random.key(1)) * 0.1
    out = []
    for tokens in token_counts:
        x, idx = _routed_inputs(tokens, experts, top_k, hidden, tokens)
        for view in ("expand_dims", "contiguous"):
            def run():
                xe = mx.expand_dims(x, (-2, -3))
                return _switch_up(mx.contiguous(xe) if view == "contiguous" else xe, w, idx)
            dev, ref = _both(run)
            dense = np.stack([np.stack([np.array(x[t]) @ np.array(w[int(e)]).T for e in np.array(idx[t])])
                              for t in range(tokens)])
            out.append({"tokens": tokens, "top_k": top_k, "view": view, "sorted": bool(idx.size >= 64),
                        "rel_vs_cpu": _rel(dev, ref),
                        "rel_vs_dense": float(np.abs(dev[0].reshape(dense.shape) - dense).max() / np.abs(dense).max())})
    return out


def check_gather_mm_grad(experts=4, top_k=2, hidden=128, inter=32) -> list[dict]:
    out = []
    w0 = mx.random.normal((experts, inter, hidden), key=mx.random.key(2)) * 0.1
    for tokens in (8, 40, 200):
        x0, idx = _routed_inputs(tokens, experts, top_k, hidden, 100 + tokens)
        g = mx.random.normal((tokens, top_k, 1, inter), key=mx.random.key(3))

        def run():
            def loss(x, w):
                return (_switch_up(mx.expand_dims(x, (-2, -3)), w, idx) * g).sum()
            return list(mx.grad(loss, argnums=(0, 1))(x0, w0))
        dev, ref = _both(run)
        # y[t, k] = x[t] @ w[e].T, so dL/dx[t] = sum_k g[t, k] @ w[e] and dL/dw[e] = sum g[t, k].T x[t].
        xs, ws, gs, ids = np.array(x0), np.array(w0), np.array(g)[:, :, 0], np.array(idx)
        dx = np.stack([sum(gs[t, k] @ ws[ids[t, k]] for k in range(top_k)) for t in range(tokens)])
        dw = np.zeros_like(ws)
        for t in range(tokens):
            for k in range(top_k):
                dw[ids[t, k]] += np.outer(gs[t, k], xs[t])
        out.append({"tokens": tokens, "sorted": bool(idx.size >= 64), "rel_vs_cpu": _rel(dev, ref),
                    "rel_vs_dense": _rel(dev, [dx, dw])})
    return out


class _Recorder(nn.Module):
    """Wraps a router (``gate``) and keeps what it returned, for the top-k comparison."""

    def __init__(self, gate):
        super().__init__()
        self.inner = gate
        self.seen: list = []

    def __call__(self, x):
        y = self.inner(x)
        self.seen.append(y)
        return y


def _routers(model) -> list[_Recorder]:
    recs = []
    for _, module in model.named_modules():
        if hasattr(module, "gate") and hasattr(module, "switch_mlp") and not isinstance(module.gate, _Recorder):
            module.gate = _Recorder(module.gate)
            recs.append(module.gate)
    return recs


def router_flips(dev_gates, ref_gates, top_k: int) -> dict:
    """How many routed tokens chose another set of ``top_k`` experts on the device than on
    the CPU, and the CPU router's margin (k-th score minus the next) at those tokens."""
    n, margins, routed = 0, [], 0
    for d, r in zip(dev_gates, ref_gates):
        d, r = d.reshape(-1, d.shape[-1]), r.reshape(-1, r.shape[-1])
        routed += len(r)
        top_d = np.sort(np.argsort(-d, axis=-1)[:, :top_k], axis=-1)
        top_r = np.sort(np.argsort(-r, axis=-1)[:, :top_k], axis=-1)
        bad = np.any(top_d != top_r, axis=-1)
        n += int(bad.sum())
        s = -np.sort(-r[bad], axis=-1)
        margins += list(s[:, top_k - 1] - s[:, top_k])
    return {"routed_tokens": routed, "flips": n,
            "min_margin_at_flip": float(min(margins)) if margins else None,
            "max_margin_at_flip": float(max(margins)) if margins else None}


def check_moe_model(root: Path, batch: int = 20, length: int = 40) -> dict:
    from mlx_lm.utils import load

    from mlx_tandem.spec.mtp_head import load_mtp_head
    from mlx_tandem.testing import make_tiny_model

    path = root / "qwen3_5_moe_vl"
    make_tiny_model("qwen3_5_moe_vl", path, seed=0, mtp_layers=1)
    model, _, config = load(str(path), return_config=True)
    model.set_dtype(mx.float32)
    recs = _routers(model)
    top_k = int((config.get("text_config") or config)["num_experts_per_tok"])
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(3, 1000, (batch, length)).astype(np.int32))

    def routed(fn):
        """fn()'s logits on each backend, and every router's scores on each, as numpy."""
        for r in recs:
            r.seen.clear()
        dev = fn()
        mx.eval(dev, [r.seen for r in recs])
        dev_gates = [np.array(s) for r in recs for s in r.seen]
        for r in recs:
            r.seen.clear()
        with mx.stream(mx.cpu):
            ref = fn()
            mx.eval(ref, [r.seen for r in recs])
        ref_gates = [np.array(s) for r in recs for s in r.seen]
        return np.array(dev), np.array(ref), dev_gates, ref_gates

    result = {"routers": len(recs)}
    lg_b, ref_b, gd, gr = routed(lambda: model(ids)[:, -1])
    result["batched"] = {"rel_vs_cpu": _rel([lg_b], [ref_b]),
                         "argmax_differs": int((lg_b.argmax(-1) != ref_b.argmax(-1)).sum()), **router_flips(gd, gr, top_k)}
    alone, alone_ref, ga, gra = [], [], [], []
    for i in range(batch):
        a, r, g1, g2 = routed(lambda: model(ids[i:i + 1])[:, -1])
        alone.append(a[0]); alone_ref.append(r[0]); ga += g1; gra += g2
    alone, alone_ref = np.stack(alone), np.stack(alone_ref)
    result["alone"] = {"rel_vs_cpu": _rel([alone], [alone_ref]),
                       "argmax_differs": int((alone.argmax(-1) != alone_ref.argmax(-1)).sum()), **router_flips(ga, gra, top_k)}
    result["batched_vs_alone_on_device"] = {"rel": _rel([lg_b], [alone]),
                                            "argmax_differs": int((lg_b.argmax(-1) != alone.argmax(-1)).sum())}

    lm = model.language_model if hasattr(model, "language_model") else model
    head = load_mtp_head(path, lm, config, dtype=mx.float32)
    emb = mx.random.normal((8, 1, lm.args.hidden_size), key=mx.random.key(4))
    hid = mx.random.normal((8, 1, lm.args.hidden_size), key=mx.random.key(5))
    result["mtp_head"] = {"rel_vs_cpu": _rel(*_both(lambda: head(emb, hid)))}
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    report = {"device": str(mx.default_device()), "mlx": mx.__version__,
              "matmul": check_matmul(), "gather_mm": check_gather_mm(),
              "gather_mm_grad": check_gather_mm_grad()}
    with tempfile.TemporaryDirectory() as tmp:
        report["moe_model"] = check_moe_model(Path(tmp))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
