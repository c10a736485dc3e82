"""Train the embedded demo model offline: a small Qwen3.5 hybrid (GatedDeltaNet + attention)
with an MTP head, on the dialogues of ``scripts/demo_data.py``.

    python scripts/train_demo_model.py --out build/demo_model            # train (resumes if interrupted)
    python scripts/train_demo_model.py --out build/demo_model --steps 5  # smoke run

The defaults reproduce v2 (run 7), the hour recipe. The shipped v6 took nine runs of this
script, each from the one before, on 2 CPU cores and on GPUs lent to three sessions (runs
30-37a in docs/demo_model.md). ``scripts/reproduce_demo_model.py`` runs that lineage with the
options each run used, in one resumable command (about 20 hours on 2 CPU cores, about 25
minutes on a GPU); ``--list`` prints its commands. Run 13, an earlier experiment, was::

    python scripts/train_demo_model.py --out build/run13 --mix made_up --word-consistent-tokenizer \
        --init hf --lr 1e-3 --rope-theta 10000 --copy-warmup-steps 400 --lookup-steps 600 \
        --drill-every 6 --steps 3400

(run 12 was the same without the last three options and with ``--steps 3000``).

Why PyTorch: this is the one place the project trains, and training on CPU is bound by
elementwise transcendental functions (exp, sigmoid) that MLX's CPU backend runs scalar and
single-threaded (about 40 M/s, against 200 GFLOP/s for its matmuls). PyTorch's CPU kernels
are vectorized and threaded: ``benchmarks/training_step.py`` measures the same step at 4.2x
the tokens/s of mlx-lm's model (batch 8 x 400 tokens, 2 cores), and ``--bf16`` at 1.47x
that again on a CPU with AVX512-BF16 (no shipped model used it; run 38 did). The model is
transformers' own ``Qwen3_5ForCausalLM`` (with its chunked gated delta rule), so there is
no second implementation of the architecture to keep in step; the engine still serves the
result with mlx-lm. ``tests/training`` checks
that MLX reproduces the trained model's logits.

The initial weights come from the project's model factory (the same files the engine
would load), so tokenizer, chat template and config are the factory's. Seeded and
resumable: a checkpoint (weights, optimizer state, step, RNG state) is written every
``--save-every`` steps and picked up on the next run. The result is a Hugging Face-layout
checkpoint in ``<out>/final`` (fp16 on disk; the engine loads float32 on CPU) with ``mtp.*``
weights for the drafter.

Loss: next-token cross-entropy on assistant tokens only (what the chat template renders
for assistant turns, found by rendering each conversation prefix), plus the MTP head's
cross-entropy for token t+2 from (hidden_t, embedding of t+1). The MTP head sees the
backbone's hidden state detached: it is a drafter and must not change what the backbone says.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import selection_drills  # noqa: E402  - sibling script modules
import structured_answers  # noqa: E402

try:
    import torch  # noqa: E402
    import torch.nn as nn  # noqa: E402
    import torch.nn.functional as F  # noqa: E402
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("training needs PyTorch: pip install -e '.[train]' "
             "(on Linux add --extra-index-url https://download.pytorch.org/whl/cpu for the CPU build)")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5  # noqa: E402
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402

logger = logging.getLogger("train_demo_model")

#: ~7M parameters: 14 MB in fp16 (the package budget is 25 MB).
#: v3 and v4 are 8 layers at intermediate 1280: 12.4M, 24 MB.
DEMO_SIZES = dict(hidden_size=256, num_hidden_layers=6, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
                  linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                  full_attention_interval=2)
MAX_POSITIONS = 4096
#: Key prefixes of the HF checkpoint (what the factory writes and the engine loads).
BACKBONE, MTP = "model.language_model.", "mtp."


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
        if record.get("kind") == selection_drills.KIND:  # the loss on the called tool's name only
            name = tokenizer.encode(m["tool_calls"][0]["function"]["name"], add_special_tokens=False)
            at = next((t for t in range(len(start), len(end) - len(name) + 1) if ids[t: t + len(name)] == name), None)
            if at is None:
                return None
            mask[len(start): len(end)] = [0] * (len(end) - len(start))
            mask[at: at + len(name)] = [1] * len(name)
        if (record.get("kind") == structured_answers.KIND and structured_answers.LOSS_FREE_FIRST_TOKEN
                and not record.get("asks_json")):
            mask[len(start)] = 0  # the engine's grammar opens a JSON answer; the model never should unasked
    return ids, mask


def first_tokens_only(examples: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[int]]]:
    """``examples`` with each scored span cut to its first token (``--selection-first-token``).

    On a selection drill the first token of the called name is the whole decision: the rest is
    copied from the entry it starts (log-probability about 0, docs/demo_model.md). Scored over
    the whole name, the mean loss divides that decision's gradient by the name's length."""
    return [(ids, [int(m and not (i and mask[i - 1])) for i, m in enumerate(mask)]) for ids, mask in examples]


class StaleRecords(ValueError):
    """A run directory's records were generated with other options than this run's."""


def load_records(data_path: Path, make, options: dict | None = None) -> list[dict]:
    """Records kept in ``data_path``, written there by ``make()`` on the first run.

    ``options`` (what ``make`` generates from) are kept beside the records, and a later run
    with other options stops with ``StaleRecords`` instead of silently training on the old
    records: a resume with another ``--selection-lexical`` once reused the first run's drills.
    Records written by another tool (``demo_data.py --json-top-up``, run 32b) have no options
    file and are taken as they are, on purpose."""
    kept = data_path.with_name(data_path.name + ".options.json")
    if not data_path.exists():
        from demo_data import write_jsonl

        data_path.parent.mkdir(parents=True, exist_ok=True)
        if options is not None:  # first: a run killed between the two writes regenerates, never skips the check
            kept.write_text(json.dumps(options, sort_keys=True))
        write_jsonl(make(), data_path)
    elif options is not None and kept.exists() and json.loads(kept.read_text()) != options:
        raise StaleRecords(f"{data_path} was generated with {kept.read_text()}, not {json.dumps(options, sort_keys=True)}: "
                           f"train into a new --out, or delete {data_path.name} and its caches to regenerate it")
    return [json.loads(line) for line in data_path.read_text().splitlines()]


def rendered_texts(records: list[dict]) -> list[str]:
    """The dialogues as the factory's chat template renders them: the tokenizer's corpus."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from mlx_tandem.testing.chat_template import CHAT_TEMPLATE

    return [render_jinja_template(conversations=[r["messages"]], tools=r.get("tools"),
                                  chat_template=CHAT_TEMPLATE)[0][0] for r in records]


def _tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's serialization with null read as "": tokenizers 0.23.2 writes null where
    0.23.3 writes "" (two BPE fields), and a key on the raw ``to_str()`` made a machine with
    the other version re-encode 80,000 identical dialogues (run 30)."""
    def same(x):
        if isinstance(x, dict):
            return {k: same(v) for k, v in x.items()}
        if isinstance(x, list):
            return [same(v) for v in x]
        return "" if x is None else x

    return json.dumps(same(json.loads(tokenizer.backend_tokenizer.to_str())), sort_keys=True)


def load_examples(tokenizer, records: list[dict], max_len: int, cache: Path | None = None):
    """The encoded dialogues that fit ``max_len``. Encoding renders every conversation prefix
    (minutes for 40,000 dialogues), so the result is kept in ``cache``, valid for the same
    records, tokenizer, chat template and length."""
    from tqdm.auto import tqdm

    # The template is part of the key: the same records render to other tokens under another one.
    key = hashlib.sha256(json.dumps([records, _tokenizer_fingerprint(tokenizer), tokenizer.chat_template,
                                     max_len]).encode()).hexdigest()
    if cache is not None and cache.exists():
        saved = json.loads(cache.read_text())
        if saved["key"] == key:
            return [tuple(e) for e in saved["examples"]]
    examples, skipped = [], 0
    for record in tqdm(records, desc="encoding dialogues", unit="dialogue", mininterval=2):
        enc = encode_dialogue(tokenizer, record)
        if enc is None or len(enc[0]) > max_len or sum(enc[1]) == 0:
            skipped += 1
            continue
        examples.append(enc)
    logger.info("%d training dialogues (%d skipped: template mismatch or longer than %d)",
                len(examples), skipped, max_len)
    if cache is not None:
        cache.write_text(json.dumps({"key": key, "examples": examples}))
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
                tok = np.full((len(group), width), pad_id, dtype=np.int64)
                msk = np.zeros((len(group), width), dtype=np.float32)
                for r, i in enumerate(group):
                    ids, mask = examples[i]
                    tok[r, : len(ids)] = ids
                    msk[r, : len(mask)] = mask
                yield torch.from_numpy(tok), torch.from_numpy(msk)


LOOKUP_LENGTH = 48  # the longest lookup row is 44 tokens (copy_drills.lookup_batch)


def lookup_marks(vocab: int) -> tuple[int, int, int, int]:
    """The ids of the lookup drill's marks (E, Q, A, END): the last four plain tokens, so the
    drill's random ids are drawn below ``vocab - 4``."""
    return vocab - 4, vocab - 3, vocab - 2, vocab - 1


class DrillPhase:
    """When a drill phase (the copy warm-up, then the lookup drills) ends: after ``min_steps``
    of its steps; with a ``target``, not before its loss, averaged over its last ``window``
    steps, is at or under it (the skill has formed), and at ``max_steps`` at the latest
    (``failed`` if still above).

    Why: each skill forms after a plateau of unpredictable length, and a run without it spends
    the rest of its hour on a model that ignores what it is asked (docs/demo_model.md). With an
    MLP of 1280, run 18's induction head formed at about copy step 650 and run 21's not by 800
    (repeat loss flat at 7.62, the entropy of a random token); run 24's lookup loss stayed at
    6.0 through its 400 lookup steps (runs 22-23, the same recipe: 1.7). With a target, such a
    run goes on drilling until the skill is there, or stops at ``max_steps`` with a clear error
    instead of exporting a broken model.

    The lookup drills can be judged by their answer's first id instead of their loss
    (``--lookup-until-first-id``): the phase then records the share of rows that miss it, so
    that lower is better as for a loss (``measure`` names it in the log). Why: their loss
    falls as a model copies the rest of an entry once it has one, and no run that met its loss
    target had learned to pick the entry (v3: 24.6% of first ids right, a random pick 30.8%;
    run 33c).

    The decision depends only on the run's own losses, which a resumed run replays exactly;
    ``state()`` goes into the checkpoint so that a resumed run ends the phase where an
    uninterrupted one would.
    """

    def __init__(self, min_steps: int, target: float | None = None, max_steps: int | None = None,
                 window: int = 20, measure: str = "loss"):
        self.min_steps, self.target, self.window, self.measure = min_steps, target, window, measure
        self.max_steps = max(min_steps, max_steps or 0) if target is not None else min_steps
        self.end: int | None = None if target is not None else min_steps  # the phase's steps in all, once decided
        self.losses: list[float] = []  # the last ``window`` losses, while undecided
        self.resumed_at = 0

    def restore(self, state: dict | None, taken: int) -> None:
        """Pick up a checkpoint's state, saved after ``taken`` steps of this phase (a run
        without a target keeps none)."""
        if self.target is None or state is None:
            return
        self.end, self.losses, self.resumed_at = state["end"], list(state["losses"]), taken

    def state(self) -> dict | None:
        if self.target is None:
            return None
        return {"end": None if self.failed else self.end, "losses": self.losses}

    def record(self, loss: float) -> None:
        """The loss of one of the phase's steps."""
        if self.end is None:
            self.losses = (self.losses + [loss])[-self.window:]

    @property
    def recent_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else math.inf

    @property
    def failed(self) -> bool:
        """The phase was cut at ``max_steps`` with its skill not formed."""
        return self.target is not None and self.end is not None and self.recent_loss > self.target

    def done(self, taken: int) -> bool:
        """Whether the phase ends after ``taken`` of its steps (asked before each next one)."""
        if self.end is not None:
            return taken >= self.end
        if taken < max(self.min_steps, self.resumed_at):  # replaying steps a checkpoint already took
            return False
        if taken >= self.max_steps or self.recent_loss <= self.target:
            self.end = taken
            return True
        return False


def drill_phase_of(step: int, copy: DrillPhase, lookup: DrillPhase) -> str:
    """Which phase ``step``'s batch belongs to, once it has been drawn: "copy", "lookup" or
    "dialogue" (a phase still undecided after the draw is still going on)."""
    if copy.end is None or step < copy.end:
        return "copy"
    if lookup.end is None or step < copy.end + lookup.end:
        return "lookup"
    return "dialogue"


def constant_lr_steps(step: int, copy: DrillPhase, lookup: DrillPhase) -> int:
    """Steps at the peak learning rate: through both drill phases, as far as they are decided
    when ``step``'s batch has been drawn."""
    if copy.end is None:
        return step + 1 + lookup.min_steps
    if lookup.end is None:
        return max(copy.end + lookup.min_steps, step + 1)
    return copy.end + lookup.end


def total_steps(copy: DrillPhase, lookup: DrillPhase, steps: int, dialogue_steps: int | None) -> int | None:
    """The run's steps in all: ``steps``; or, with ``dialogue_steps``, that many after both drill
    phases, once they are decided (None before). A drill phase that goes on past its minimum
    then takes no steps from the dialogues (run 25's late lookup left 1,482 of run 18's 2,400)."""
    if dialogue_steps is None:
        return steps
    if copy.end is None or lookup.end is None:
        return None
    return copy.end + lookup.end + dialogue_steps


FIT_PROBE_STEPS = 20
REFIT_EVERY = 50  # dialogue steps between refits
REFIT_WINDOW = 200  # the latest steps a refit averages: the run's pace now, not at its start


class TimeFit:
    """``--time-budget``: how many dialogue steps fit in what is left of a wall-clock budget.
    The budget runs from ``started`` (the run's start: loading, encoding and the drill phases
    take their share). Each dialogue step is timed whole (batching, the step, checkpoints);
    the first fit comes after ``FIT_PROBE_STEPS`` of them, then a refit every ``REFIT_EVERY``
    from the latest ``REFIT_WINDOW``. Fitting once from 20 steps of varying length, and
    timing only the step, ran run 39 7 minutes over its 58. For a lent accelerator held for a
    fixed time, or a CPU hour, where a step's cost is not known in advance."""

    def __init__(self, budget_s: float, started: float | None = None, clock=time.perf_counter):
        self.budget_s, self.clock, self.times, self.step_time = budget_s, clock, [], None
        self.started = clock() if started is None else started

    def record(self, seconds: float, done: int) -> int | None:
        """One timed dialogue step, ``done`` of them so far (this one included); the dialogue
        steps in all when this step fits or refits, else None (keep the last fit)."""
        self.times.append(seconds)
        n = len(self.times)
        if n < FIT_PROBE_STEPS or (n - FIT_PROBE_STEPS) % REFIT_EVERY:
            return None
        recent = self.times[-REFIT_WINDOW:]
        self.step_time = sum(recent) / len(recent)
        left = self.budget_s - (self.clock() - self.started)
        return done + max(0, int(left / self.step_time))


def training_batches(examples, *, batch_size: int, seed: int, vocab: int, pad_id: int,
                     copy_steps: int | DrillPhase = 0, copy_length: int = 64,
                     lookup_steps: int | DrillPhase = 0, drill_every: int = 0,
                     selections=(), selection_every: int = 0):
    """Every step's (tokens, mask, answer starts), in order: ``copy_steps`` of copy drills,
    ``lookup_steps`` of lookup drills, then the dialogues, every ``drill_every``-th of them replaced by a drill
    (copy and lookup in turn). All drawn from ``seed``, so a resumed run replays the same.
    ``copy_steps`` and ``lookup_steps`` are counts, or ``DrillPhase``s that decide as the losses
    come in (the generator is lazy: it asks before each step, after the previous one's loss is
    recorded). The answer starts are each row's first answer token on lookup drills (what
    ``--lookup-until-first-id`` judges), None on every other batch.

    Copy drills (``copy_drills.repeat_batch``): a random span, then itself. Dense copying
    first, so an induction head forms before the dialogues, which carry little copying. Half a
    sequence, then its repeat: the setting in which one was measured to form (run 12); with
    shorter spans of 16-32 tokens none had formed by step 300 (run 11).

    Lookup drills (``copy_drills.lookup_batch``): pick the listed entry that a query quotes
    part of, and write it out; tool selection on random ids, so it can only be learned as
    matching, never as recall of known tools (runs 3-12 learned recall). The drills in the
    dialogue phase keep both skills trained while the dialogues teach the format.

    Selection drills (``selection_drills``, encoded like the dialogues, in ``selections``): in
    the dialogue phase, every ``selection_every``-th step is a batch of them (unless a copy or
    lookup drill falls on it), the loss on the tool names only; every step at 1.
    """
    from copy_drills import lookup_batch, repeat_batch

    generator = torch.Generator().manual_seed(seed)
    marks = lookup_marks(vocab)

    def copy():
        return *repeat_batch(generator, 2 * batch_size, copy_length, 0, vocab, span=(copy_length // 2,) * 2), None

    def lookup():
        return lookup_batch(generator, 4 * batch_size, LOOKUP_LENGTH, 0, vocab - 4, marks)

    for phase, drill in ((copy_steps, copy), (lookup_steps, lookup)):
        phase = DrillPhase(phase) if isinstance(phase, int) else phase
        taken = 0
        while not phase.done(taken):
            yield drill()
            taken += 1
    dialogues = batches(examples, batch_size, seed, pad_id)
    picks = batches(selections, batch_size, seed + 1, pad_id) if selection_every else None
    for i in itertools.count():
        if drill_every and i % drill_every == drill_every - 1:
            yield copy() if (i // drill_every) % 2 == 0 else lookup()
        elif picks is not None and i % selection_every == selection_every - 1:
            yield *next(picks), None
        else:
            yield *next(dialogues), None


# ---------------------------------------------------------------------- model
class MTPHead(nn.Module):
    """fc([norm(embed(t+1)); norm(h_t)]) -> one full-attention decoder layer -> norm.

    The layout and parameter names of Qwen3.5's ``mtp.*`` weights (what
    ``mlx_tandem.spec.mtp_head`` loads); the norms are transformers' zero-centred ones,
    which is how HF checkpoints store them.
    """

    def __init__(self, text_config: Qwen3_5TextConfig):
        super().__init__()
        h, eps = text_config.hidden_size, text_config.rms_norm_eps
        layer_config = Qwen3_5TextConfig(**{**text_config.to_dict(), "layer_types": ["full_attention"],
                                            "num_hidden_layers": 1})
        layer_config._attn_implementation = "sdpa"  # causal when no mask is given
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = qwen3_5.Qwen3_5RMSNorm(h, eps)
        self.pre_fc_norm_hidden = qwen3_5.Qwen3_5RMSNorm(h, eps)
        self.layers = nn.ModuleList([qwen3_5.Qwen3_5DecoderLayer(layer_config, layer_idx=0)])
        self.norm = qwen3_5.Qwen3_5RMSNorm(h, eps)

    def forward(self, embeddings, hidden, position_embeddings):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], -1))
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


class Trainee(nn.Module):
    """Backbone + MTP head as one module, so one optimizer and one checkpoint hold both."""

    def __init__(self, text_config: Qwen3_5TextConfig):
        super().__init__()
        self.lm = qwen3_5.Qwen3_5ForCausalLM(text_config)
        self.mtp = MTPHead(text_config)

    def losses(self, tokens, mask, answer_starts=None):
        """(main loss, MTP loss, first id): the backbone's and the MTP head's masked cross
        entropy, and, given each row's ``answer_starts`` (lookup drills), the share of rows
        whose answer's first token is the backbone's argmax (else None)."""
        inner = self.lm.model
        h = inner(input_ids=tokens[:, :-1]).last_hidden_state  # post-norm, as the drafter receives it
        m1 = mask[:, 1:]
        logits = self.lm.lm_head(h)
        ce = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view_as(m1)
        main = (ce * m1).sum() / m1.sum().clamp(min=1)
        first_id = None
        if answer_starts is not None:  # logits[:, t] predicts tokens[:, t + 1]
            rows = torch.arange(tokens.shape[0], device=tokens.device)
            picked = logits[rows, answer_starts - 1].argmax(-1)
            first_id = (picked == tokens[rows, answer_starts]).float().mean().item()
        # MTP: from h_t and embed(token t+1), predict token t+2.
        hs = h[:, :-1].detach()
        emb = inner.embed_tokens(tokens[:, 1:-1])
        pos = torch.arange(hs.shape[1], device=hs.device)[None].expand(hs.shape[0], -1)
        rope = inner.rotary_emb(hs, pos[None].expand(3, -1, -1))  # text: the same position on every m-RoPE axis
        m2 = mask[:, 2:]
        ce2 = F.cross_entropy(self.lm.lm_head(self.mtp(emb, hs, rope)).float().flatten(0, 1), tokens[:, 2:].flatten(),
                              reduction="none").view_as(m2)
        mtp = (ce2 * m2).sum() / m2.sum().clamp(min=1)
        return main, mtp, first_id

    def load_hf(self, weights: dict) -> None:
        """Load an HF-layout state dict (the factory's initial weights)."""
        backbone = {(k if k == "lm_head.weight" else "model." + k[len(BACKBONE):]): v
                    for k, v in weights.items() if k.startswith(BACKBONE) or k == "lm_head.weight"}
        self.lm.load_state_dict(backbone, strict=True)
        self.mtp.load_state_dict({k[len(MTP):]: v for k, v in weights.items() if k.startswith(MTP)}, strict=True)

    def hf_state(self) -> dict:
        out = {(k if k == "lm_head.weight" else BACKBONE + k[len("model."):]): v
               for k, v in self.lm.state_dict().items()}
        out.update({MTP + k: v for k, v in self.mtp.state_dict().items()})
        return out


# The factory template writes each tool as the OpenAI format orders it, name before description.
# A causal model reads a name's first token before it has read what the tool does, so matching
# a request against a description and then writing the name before it takes two hops; with the
# description first, one (runs 34 and 34b in docs/demo_model.md). The same JSON object either way.
TOOL_AS_IS = "{{- tool | tojson -}}"
TOOL_DESCRIPTION_FIRST = (
    "{%- set fn = tool.function if tool.function is defined else none -%}"
    "{%- if fn is mapping and fn.description is defined -%}"
    "{{- '{\"type\": ' + (tool.type | default('function') | tojson) + ', \"function\": {\"description\": '"
    " + (fn.description | tojson) -}}"
    "{%- for key, value in fn.items() if key != 'description' -%}"
    "{{- ', ' + (key | tojson) + ': ' + (value | tojson) -}}{%- endfor -%}{{- '}}' -}}"
    "{%- else -%}" + TOOL_AS_IS + "{%- endif -%}")


def write_description_first(model_dir: Path) -> None:
    """Rewrite ``model_dir``'s chat template (its .jinja file and tokenizer config) so that each
    listed tool's description comes before its name (``--tools-description-first``)."""
    def rewrite(template: str) -> str:
        if TOOL_DESCRIPTION_FIRST in template:
            return template
        if template.count(TOOL_AS_IS) != 1:
            raise ValueError("the chat template does not render tools as the factory's does")
        return template.replace(TOOL_AS_IS, TOOL_DESCRIPTION_FIRST)

    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(rewrite(jinja.read_text()))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if isinstance(config.get("chat_template"), str):
        config["chat_template"] = rewrite(config["chat_template"])
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def build(init_dir: Path, seed: int, records: list[dict], word_consistent: bool = False,
          init: str = "factory", rope_theta: float | None = None, **sizes: int) -> Trainee:
    """A float32 Trainee of the factory's model (config, tokenizer and template written once
    into ``init_dir``), starting from the factory's random weights (``init="factory"``) or from
    transformers' own initialization of the architecture (``init="hf"``).

    Why "hf": the factory's weights are mlx's default init, made for engine tests (uniform
    matrices of scale 1/sqrt(fan_in), embeddings of std 1/sqrt(d), jittered norms). From
    them the demo architecture did not learn to copy a repeated random sequence in 300 steps
    at a peak lr of 1e-3; from transformers' init (std 0.02, norms at 1) it did in about 250
    (the table in docs/demo_model.md, run 12's entry).

    ``rope_theta`` replaces the factory's (Qwen3.5's 1e7): with 16 rotary dimensions per head
    a base of 1e7 leaves attention almost blind to position, and a head that looks at the
    previous token (half of an induction head) forms later (the same table).

    ``word_consistent`` trains the factory's tokenizer with word-consistent merges on the
    stdlib corpus plus the training dialogues (``mlx_tandem.testing.tokenizer``): a word or
    number copied from a request into a call is then the same tokens in both places. Run 9
    (docs/demo_model.md) measured it; the shipped model keeps the plain factory tokenizer.

    ``sizes`` override ``DEMO_SIZES`` (e.g. ``intermediate_size``).
    """
    if not (init_dir / "config.json").exists():
        # After torch: the OpenBLAS that mlx_tandem loads globally slows a torch imported later.
        import mlx_tandem  # noqa: F401  - OpenBLAS before mlx
        from mlx_tandem.testing.factory import make_tiny_model

        make_tiny_model("qwen3_5", init_dir, seed=seed, mtp_layers=1, max_position_embeddings=MAX_POSITIONS,
                        tokenizer_texts=rendered_texts(records) if word_consistent else (),
                        word_consistent_tokenizer=word_consistent, **{**DEMO_SIZES, **sizes})
        if rope_theta:
            full = json.loads((init_dir / "config.json").read_text())
            full["text_config"]["rope_parameters"]["rope_theta"] = rope_theta
            (init_dir / "config.json").write_text(json.dumps(full, indent=2))
    config = json.loads((init_dir / "config.json").read_text())
    trainee = Trainee(Qwen3_5TextConfig(**config["text_config"])).float()
    if init == "factory":
        trainee.load_hf(load_file(str(init_dir / "model.safetensors")))
    else:  # the backbone is initialized by transformers already; the MTP head the same way
        trainee.mtp.apply(trainee.lm._init_weights)
    return trainee


# ---------------------------------------------------------------------- checkpoints
def save_checkpoint(ckpt: Path, trainee: Trainee, opt, step: int, phases: dict | None = None) -> None:
    """``phases``: the drill phases' states by name (``DrillPhase.state()``; those without one are left out)."""
    tmp = ckpt.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({"model": trainee.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()},
               tmp / "state.pt")
    kept = {name: phase for name, phase in (phases or {}).items() if phase is not None}
    (tmp / "state.json").write_text(json.dumps({"step": step, **kept}))
    shutil.rmtree(ckpt, ignore_errors=True)
    tmp.rename(ckpt)  # atomic: a crash leaves the previous checkpoint intact


def load_checkpoint(ckpt: Path, trainee: Trainee, opt) -> dict:
    """The checkpoint's state.json (``{"step": 0}`` when there is none), weights and optimizer loaded."""
    if not (ckpt / "state.json").exists():
        return {"step": 0}
    state = torch.load(ckpt / "state.pt", weights_only=False, map_location=next(trainee.parameters()).device)
    trainee.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"].cpu())
    return json.loads((ckpt / "state.json").read_text())


def export(final: Path, init_dir: Path, trainee: Trainee) -> None:
    """HF layout, fp16, next to the factory's tokenizer, template and config."""
    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(init_dir, final, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in trainee.hf_state().items()},
              str(final / "model.safetensors"), metadata={"format": "pt"})


def learning_rate(step: int, *, peak: float, steps: int, constant: int = 0) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak. With ``constant`` (the drill
    warm-up's steps, copy and lookup) the peak holds from the first step to there instead of
    the warmup: an induction head was measured to form at a constant 1e-3, and later behind a
    ramp."""
    warmup = 0 if constant else min(100, steps // 10 + 1)
    if step < max(warmup, constant):
        return peak if constant else 1e-5 + (peak - 1e-5) * step / warmup
    warmup = max(warmup, constant)
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


# ---------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/demo_model"))
    p.add_argument("--steps", type=int, default=2800)
    p.add_argument("--dialogue-steps", type=int, default=None,
                   help="train this many steps after the drill phases, however long they take (instead of --steps "
                        "in all); the learning rate decays over these steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=640)  # tool dialogues: ~130 tokens of template instructions + ~100 per tool
    p.add_argument("--n-dialogues", type=int, default=40000)
    p.add_argument("--mix", choices=("v2", "made_up", "nonce", "nonce_json", "nonce_json2", "nonce_json3"), default="v2",
                   help="training mix of demo_data.py (made_up: most tool dialogues on made-up tools, run 12; "
                        "nonce: half of those about made-up things, run 15; nonce_json: nonce with 8%% "
                        "JSON answers, run 16; nonce_json2: half of those asked for by name, more units, run 17; "
                        "nonce_json3: 10%% JSON answers, some over requests with nothing for the schema, runs 20-22)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rope-theta", type=float, default=None, help="RoPE base (default: the factory's, 1e7)")
    p.add_argument("--copy-warmup-length", type=int, default=64, help="tokens per copy warm-up sequence")
    p.add_argument("--init", choices=("factory", "hf"), default="factory",
                   help="initial weights: the factory's (mlx default init) or transformers' own")
    p.add_argument("--init-from", type=Path, default=None, metavar="DIR",
                   help="start from an exported model (a run's final/: its weights, tokenizer, template and "
                        "config) instead of --init, e.g. to go on training with new dialogues at a lower lr")
    p.add_argument("--mtp-weight", type=float, default=0.5)
    p.add_argument("--copy-warmup-steps", type=int, default=0,
                   help="first steps on copied random spans (scripts/copy_drills.py) instead of dialogues")
    p.add_argument("--copy-warmup-until", type=float, default=None, metavar="LOSS",
                   help="go on with the copy warm-up past --copy-warmup-steps until the backbone's repeat loss "
                        "(mean of the last 20 copy steps) is at or under LOSS: an induction head has formed "
                        "(a random token costs 7.6, a formed head about 0.01)")
    p.add_argument("--copy-warmup-max-steps", type=int, default=2000,
                   help="with --copy-warmup-until: stop with an error if no head has formed by then")
    p.add_argument("--lookup-steps", type=int, default=0,
                   help="steps of lookup drills (scripts/copy_drills.py) after the copy warm-up, at its constant lr")
    p.add_argument("--lookup-until", type=float, default=None, metavar="LOSS",
                   help="go on with the lookup drills past --lookup-steps until their loss (mean of the last 20 "
                        "lookup steps) is at or under LOSS (unlearned: about 6.0; learned: under 2.5)")
    p.add_argument("--lookup-until-first-id", type=float, default=None, metavar="SHARE",
                   help="instead of --lookup-until: go on until the answer's first id is the model's pick in at "
                        "least SHARE of the rows (mean of the last 20 lookup steps; a random pick among the listed "
                        "entries gets about 0.31), which the loss does not tell (run 33c)")
    p.add_argument("--lookup-max-steps", type=int, default=1000,
                   help="with --lookup-until or --lookup-until-first-id: stop with an error if the lookup is not "
                        "learned by then")
    p.add_argument("--drill-every", type=int, default=0,
                   help="in the dialogue phase, make every Nth step a drill (copy and lookup in turn)")
    p.add_argument("--selection-every", type=int, default=0,
                   help="in the dialogue phase, make every Nth step a batch of selection drills unless a copy or "
                        "lookup drill falls on it (scripts/selection_drills.py: 2-4 tools, one request, the loss "
                        "on the name); 1 trains no dialogues at all, for pilots of the drills alone")
    p.add_argument("--n-selections", type=int, default=8000, help="selection drills to generate")
    p.add_argument("--selection-prefixed", type=float, default=0.0, metavar="SHARE",
                   help="the share of selection drills where every listed name starts with a prefix that tells "
                        "nothing, so the name's first token must be read from the entry the request matches "
                        "(selection_drills.prefix_names, run 33)")
    p.add_argument("--selection-every-tool", action="store_true",
                   help="selection drills go on with a request for each other tool they can ask for, each with "
                        "its call: several scored names per tool list (run 33b)")
    p.add_argument("--selection-lexical", type=float, default=0.0, metavar="SHARE",
                   help="the share of selection drills over tools built around random words, real and made-up, "
                        "where the request says one listed tool's key word (selection_drills.lexical_record, run 35)")
    p.add_argument("--selection-first-token", action="store_true",
                   help="score selection drills on the first token of each called name only, the token that "
                        "decides (first_tokens_only, run 35e)")
    p.add_argument("--tools-description-first", action="store_true",
                   help="write each listed tool's description before its name in the model's chat template, "
                        "so a request is matched where the name starts (write_description_first, runs 34-35)")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--intermediate-size", type=int, default=DEMO_SIZES["intermediate_size"],
                   help="MLP width (run 18: 1280, about 10M parameters, 19 MB in fp16)")
    p.add_argument("--num-layers", type=int, default=DEMO_SIZES["num_hidden_layers"],
                   help="decoder layers, alternating GatedDeltaNet and attention (run 30: 8)")
    p.add_argument("--device", default="cpu", help="torch device to train on (e.g. cuda)")
    p.add_argument("--bf16", action="store_true",
                   help="autocast forward and backward to bfloat16 (weights, gradients and optimizer stay float32): "
                        "about 1.5x the tokens/s on a CPU with AVX512-BF16 or AMX "
                        "(benchmarks/training_step.py); expected to be slower on CPUs without them")
    p.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                   help="instead of --steps/--dialogue-steps: after the drill phases, time %d dialogue steps and "
                        "fit the dialogue phase so that this run ends its training within MINUTES of starting, "
                        "refitting every %d steps from the latest %d (loading and encoding count; the learning rate "
                        "decays over the fitted steps; a resumed run keeps the last fit)"
                        % (FIT_PROBE_STEPS, REFIT_EVERY, REFIT_WINDOW))
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="checkpoint and export after STEP, wherever the schedule is (v3 is run 30 at step 5,000 "
                        "of 8,116)")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the data, tokenizer, config and encoded examples into --out, then stop "
                        "(prepare on one machine, train on another)")
    p.add_argument("--word-consistent-tokenizer", action="store_true",
                   help="train the tokenizer on the dialogues with merges inside words only (run 9)")
    args = p.parse_args(argv)
    started = time.perf_counter()  # --time-budget counts from here
    if args.dialogue_steps is not None and args.dialogue_steps < 1:
        p.error("--dialogue-steps must be at least 1")
    if args.selection_every < 0:
        p.error("--selection-every must be 0 (off) or at least 1 (1: drills only, no dialogues)")
    for share in ("selection_prefixed", "selection_lexical"):
        if not 0.0 <= getattr(args, share) <= 1.0:
            p.error(f"--{share.replace('_', '-')} must be a share between 0 and 1")
    if args.lookup_until_first_id is not None and (args.lookup_until is not None
                                                   or not 0 <= args.lookup_until_first_id <= 1):
        p.error("--lookup-until-first-id must be a share between 0 and 1, and replaces --lookup-until")
    if args.time_budget is not None and (args.time_budget <= 0 or args.dialogue_steps is not None):
        p.error("--time-budget must be positive and replaces --dialogue-steps")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    torch.manual_seed(args.seed)
    init_dir, ckpt, final = args.out / "init", args.out / "checkpoint", args.out / "final"
    from demo_data import generate

    if args.init_from is not None and not (init_dir / "config.json").exists():
        shutil.copytree(args.init_from, init_dir)  # build() then loads its weights as the factory's

    def kept(path: Path, make, options: dict) -> list[dict]:
        try:
            return load_records(path, make, options)
        except StaleRecords as e:
            p.error(str(e))

    records = kept(args.out / "data.jsonl", lambda: generate(args.n_dialogues, seed=args.seed, mix=args.mix),
                   {"n": args.n_dialogues, "seed": args.seed, "mix": args.mix})
    trainee = build(init_dir, args.seed, records, args.word_consistent_tokenizer,
                    "factory" if args.init_from else args.init, args.rope_theta,
                    intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers)
    if args.tools_description_first:  # before the tokenizer loads it; exported with it
        write_description_first(init_dir)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    # --selection-every 1 trains no dialogue step, so encoding them (minutes) would be wasted.
    examples = [] if args.selection_every == 1 else load_examples(tokenizer, records, args.max_len,
                                                                   args.out / "examples.json")
    selections = []
    if args.selection_every:
        drills = {"prefixed": args.selection_prefixed, "every_tool": args.selection_every_tool,
                  "lexical": args.selection_lexical}
        picks = kept(args.out / "selections.jsonl",
                     lambda: selection_drills.generate(args.n_selections, args.seed, **drills),
                     {"n": args.n_selections, "seed": args.seed, **drills})
        selections = load_examples(tokenizer, picks, args.max_len, args.out / "selection_examples.json")
        if args.selection_first_token:
            selections = first_tokens_only(selections)
    n_params = sum(p.numel() for p in trainee.parameters())
    logger.info("%.2fM parameters (%.1f MB in fp16)", n_params / 1e6, n_params * 2 / 2**20)
    if args.prepare_only:
        logger.info("prepared %s", args.out)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 weights, TF32 matmuls
    trainee.to(device)

    opt = torch.optim.AdamW(trainee.parameters(), lr=args.lr, weight_decay=0.01)
    state = load_checkpoint(ckpt, trainee, opt)
    step = state["step"]
    if step:
        logger.info("resumed at step %d", step)
    copy = DrillPhase(args.copy_warmup_steps, args.copy_warmup_until, args.copy_warmup_max_steps)
    copy.restore(state.get("copy_warmup"), step)
    by_first_id = args.lookup_until_first_id is not None  # else the lookup drills are judged by their loss
    if by_first_id:  # a miss rate, so that lower is better as for a loss
        lookup = DrillPhase(args.lookup_steps, 1 - args.lookup_until_first_id, args.lookup_max_steps,
                            measure="first-id miss rate")
    else:
        lookup = DrillPhase(args.lookup_steps, args.lookup_until, args.lookup_max_steps)
    lookup.restore(state.get("lookup"), max(0, step - copy.end) if copy.end is not None else 0)

    fit = TimeFit(args.time_budget * 60, started) if args.time_budget else None
    fitted = fit is not None or "dialogue_steps" in state  # kept in the checkpoint, for every resume
    dialogue_steps = state.get("dialogue_steps", args.dialogue_steps)
    # Only the run that fitted refits: a resumed one keeps the fit (its clock started later).
    fitting = fit is not None and dialogue_steps is None

    def phases() -> dict:
        return {"copy_warmup": copy.state(), "lookup": lookup.state(),
                "dialogue_steps": dialogue_steps if fitted else None}

    vocab = len(tokenizer) - len(tokenizer.added_tokens_decoder)  # plain tokens, no markup
    data = training_batches(examples, batch_size=args.batch, seed=args.seed, vocab=vocab,
                            pad_id=tokenizer.pad_token_id or 0, copy_steps=copy,
                            copy_length=args.copy_warmup_length, lookup_steps=lookup,
                            drill_every=args.drill_every, selections=selections,
                            selection_every=args.selection_every)
    for _ in range(step):  # the same batch sequence as an uninterrupted run
        next(data)

    def total() -> int | None:
        if fit is not None and dialogue_steps is None:
            return None  # the dialogue phase is not fitted yet
        return total_steps(copy, lookup, args.steps, dialogue_steps)

    failures = (
        (copy, "no induction head after %d copy steps (repeat loss %.2f, target %.2f): this run would train a "
               "model that ignores its requests. Try another --seed, or a larger --copy-warmup-max-steps"),
        (lookup, f"lookup not learned after %d lookup steps (lookup {lookup.measure} %.2f, target %.2f): this "
                 "run would train a model that cannot pick what a request names from a list. Try another --seed, "
                 "or a larger --lookup-max-steps"))

    bar = tqdm(total=total(), initial=step, desc="training", unit="step")
    trainee.train()
    loss = None  # stays None when resuming a finished run: export only
    first_ids: list[float] = []  # the last lookup batches' first-id accuracy, for the progress bar
    stop = args.stop_after if args.stop_after is not None else math.inf
    lap = time.perf_counter()  # the last step's end, for --time-budget
    while (total() is None or step < total()) and step < stop:  # undecided: the next draw decides
        tokens, mask, answer_starts = next(data)
        phase = drill_phase_of(step, copy, lookup)
        if bar.total != total():
            bar.total = total()
        for failed, message in ((p, m) for p, m in failures if p.failed):
            logger.error(message + " (the run resumes from its checkpoint)", failed.end, failed.recent_loss,
                         failed.target)
            save_checkpoint(ckpt, trainee, opt, step, phases())
            return 1
        if copy.target is not None and copy.end == step:
            logger.info("copy warm-up done after %d steps: repeat loss %.3f", step, copy.recent_loss)
        if lookup.target is not None and phase == "dialogue" and copy.end + lookup.end == step:
            logger.info("lookup drills done after %d steps: lookup %s %.3f", lookup.end, lookup.measure,
                        lookup.recent_loss)
        for group in opt.param_groups:  # undecided: drills (constant) or the fit's timing steps (the peak)
            group["lr"] = args.lr if total() is None else learning_rate(
                step, peak=args.lr, steps=total(), constant=constant_lr_steps(step, copy, lookup))
        t0 = time.perf_counter()  # the step itself, for tokens/s
        tokens, mask = tokens.to(device), mask.to(device)
        if answer_starts is not None:
            answer_starts = answer_starts.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):  # losses stay float32
            main_loss, mtp_loss, first_id = trainee.losses(tokens, mask, answer_starts)
        loss = main_loss + args.mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainee.parameters(), 1.0)
        opt.step()
        if phase == "copy":  # a phase without a target ignores it
            copy.record(main_loss.item())
        elif phase == "lookup":
            lookup.record(1 - first_id if by_first_id else main_loss.item())
        if first_id is not None:  # lookup drills, in their phase or the dialogues'
            first_ids = (first_ids + [first_id])[-20:]
        step += 1
        bar.set_postfix(loss=f"{main_loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}",
                        **({"first_id": f"{sum(first_ids) / len(first_ids):.2f}"} if first_ids else {}),
                        tok_s=f"{tokens.numel() / (time.perf_counter() - t0):.0f}")
        bar.update()
        now = time.perf_counter()
        if fitting and phase == "dialogue":  # timed whole: batching, the step, the last checkpoint
            refit = fit.record(now - lap, step - copy.end - lookup.end)
            if refit is not None and refit != dialogue_steps:
                logger.log(logging.INFO if dialogue_steps is None else logging.DEBUG,
                           "time budget: %d dialogue steps fitted (%.3f s a step)", refit, fit.step_time)
                dialogue_steps = refit
        lap = now
        if step % args.save_every == 0 or step in (total(), args.stop_after):
            save_checkpoint(ckpt, trainee, opt, step, phases())
    bar.close()
    if fitting and dialogue_steps is not None:
        logger.info("time budget: %d dialogue steps in the last fit, %.1f of %.1f minutes spent at step %d",
                    dialogue_steps, (time.perf_counter() - started) / 60, args.time_budget, step)
    if loss is not None and not math.isfinite(loss.item()):
        logger.error("loss is not finite; not exporting")
        return 1
    export(final, init_dir, trainee)
    logger.info("exported %s", final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
