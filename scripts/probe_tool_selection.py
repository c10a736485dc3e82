"""Tool selection and argument copying of a demo model, teacher-forced in PyTorch.

    python scripts/probe_tool_selection.py build/demo_model                  # a run's latest checkpoint
    python scripts/probe_tool_selection.py src/mlx_tandem/models/<name> --split train

Fast enough (about 30 s) to run on a checkpoint while training goes on, which the engine-based
``eval_demo_model.py`` is not. ``--split train`` draws fresh dialogues from the *training*
distribution (its tools and phrasings, new values: a seed the run did not use); the default
draws the held-out ones. The two side by side tell a skill from memorized tools.
``--split made_up`` draws fresh dialogues over made-up tools (``synthetic_tools``, the
``--mix made_up`` training dialogues): tools no run has seen, in the training distribution, so
selection there is matching the request against the list, in-distribution. ``--split lexical``
draws fresh lexical selection drills (``selection_drills.lexical_record``: tools around random
words, the request saying one tool's key word), selection with nothing to recall.

- selection: on requests that list two or more tools, the name that greedy decoding takes when
  held to the listed names, as the engine's lazy tool-call grammar holds it (at each token,
  the likeliest among the names still possible), with the rate of a random pick beside it;
  split into requests that spell the function's name out ("generic") and the rest ("domain");
  and, where the listed names part (their first differing token), the probability on the
  tokens they go on with and the right one's share of it: naming a listed tool, and which
  (beside the share of a model that spreads its mass evenly over those tokens);
- arguments: every token of the right call's arguments is the model's argmax, given the
  dialogue up to it (teacher-forced, so a stricter measure than the engine's free decoding);
- with ``--prefixed``, every listed name of the selection requests gets a prefix that tells
  nothing (``selection_drills.prefix_names``: "zuvo_next_prime", "fetch_count_vowels"), so the
  name's first token must be read from the entry the request matches, not matched or
  recalled (run 33: v4 picks at chance so, on training tools too);
- with ``--ablate PART``, each selection is decided again with that part of every listed tool
  emptied (descriptions, parameters or names), or with each entry given the next one's
  description ("rotated"), and the share of picks that stay the same is reported: what the
  choice reads. A model that matches a request against the descriptions picks differently
  without them (v4 on held-out tools: the same pick every time; docs/demo_model.md);
- copying: 20 random words, " | ", the same 20 words again; the share of the repeat's tokens
  (after its first two) that are the model's argmax. It needs an induction head, and tells
  whether one formed and survived (docs/demo_model.md, runs 10-12). The two tokenizers split
  the words differently, so compare models of the same tokenizer first;
- lookup: the trainer's lookup drill (``copy_drills.lookup_batch``: pick the listed entry of
  random ids that a query quotes part of), the share of rows whose answer's first token is the
  model's argmax, with a random pick among the listed entries beside it. Selection without
  any word the model could know (run 13).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402  - before mlx_tandem (see train_demo_model.py)
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import train_demo_model as T  # noqa: E402
from demo_data import generate, held_out_examples, made_up_dialogue  # noqa: E402
from selection_drills import lexical_record, prefix_names  # noqa: E402

FRESH_TRAIN_SEED = 12345  # not a seed a training run uses


def load(path: Path):
    """(tokenizer, Trainee, label) from a training run's directory or an exported checkpoint."""
    ckpt = path / "checkpoint" / "state.pt"
    model_dir = path / "init" if ckpt.exists() else path
    config = json.loads((model_dir / "config.json").read_text())
    trainee = T.Trainee(T.Qwen3_5TextConfig(**config["text_config"])).float().eval()
    if ckpt.exists():
        trainee.load_state_dict(torch.load(ckpt, weights_only=False)["model"])
        label = f"step {json.loads((path / 'checkpoint' / 'state.json').read_text())['step']}"
    else:
        trainee.load_hf({k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()})
        label = path.name
    return AutoTokenizer.from_pretrained(model_dir), trainee, label


#: What ``--ablate`` takes out of every listed tool (the text a model would have to read), or
#: moves: "rotated" gives each entry the next one's description.
ABLATIONS = ("descriptions", "parameters", "names", "rotated")


def ablated_tools(tools: list[dict], part: str) -> list[dict]:
    """``tools`` with one part of each entry emptied, in the same order: descriptions blank,
    no parameters, or names that tell nothing ("tool_a", "tool_b", ...); or, "rotated", each
    entry with the next one's description (the last with the first's)."""
    out = json.loads(json.dumps(tools))
    for i, t in enumerate(out):
        fn = t["function"]
        if part == "rotated":
            fn["description"] = tools[(i + 1) % len(tools)]["function"].get("description", "")
        elif part == "descriptions":
            fn["description"] = ""
        elif part == "parameters":
            fn["parameters"] = {"type": "object", "properties": {}, "required": []}
        elif part == "names":
            fn["name"] = f"tool_{chr(ord('a') + i)}"
        else:
            raise ValueError(f"unknown part {part!r}; one of {ABLATIONS}")
    return out


def probe(tok, trainee, records: list[dict], ablate: str | None = None) -> dict:
    """Selection and arguments over ``records``; with ``ablate``, each selection is decided a
    second time with that part of every listed tool emptied (``ablated_tools``), to tell what
    the choice reads: a model that matches the request against the descriptions picks
    differently without them."""
    def encode(msgs, tools, gen=False):
        text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
        return tok.encode(text, add_special_tokens=False)

    def logits(ids):
        return trainee.lm(input_ids=torch.tensor([ids])).logits[0]

    def with_name(msgs, k, name, listed):
        """The dialogue up to its first call (``msgs[k]``), the call renamed to ``name``."""
        call = json.loads(json.dumps(msgs[k]))
        call["tool_calls"][0]["function"]["name"] = name
        return encode(msgs[:k] + [call], listed)

    def constrained_pick(msgs, k, listed, right=None,
                         prompt=None) -> tuple[int, tuple[float, float, float] | None]:
        """The index of the listed tool that greedy decoding names when held to the listed
        names, as the engine's lazy tool-call grammar holds it (at each token, the likeliest
        among the names still possible); and, given the ``right`` index, at the first token
        where the names part: the model's probability on the tokens they go on with, and the
        right one's share of it (a model that knows to name a listed tool but not which one
        puts its mass there and shares it at chance), and that chance: one over the number of
        tokens they go on with, the share of a model that spreads its mass evenly over them.
        ``prompt``: ``msgs[:k]`` already encoded with ``listed``."""
        prompt = encode(msgs[:k], listed, gen=True) if prompt is None else prompt
        names = {}
        for i, t in enumerate(listed):
            name = t["function"]["name"]
            full = with_name(msgs, k, name, listed)
            end = next(j for j in range(len(prompt), len(full)) if name in tok.decode(full[len(prompt): j + 1]))
            names[i] = full[len(prompt): end + 1]
        alive, prefix, pos, parting = names, list(prompt), 0, None
        while len(alive) > 1:
            last = logits(prefix)[-1]
            options = {v[pos] for v in alive.values() if len(v) > pos}
            if parting is None and right is not None and len(options) > 1 and len(names[right]) > pos:
                p = last.softmax(-1)
                mass = sum(p[t].item() for t in options)
                parting = (mass, p[names[right][pos]].item() / mass, 1 / len(options))
            best = max(options, key=lambda t: last[t].item())
            alive = {i: v for i, v in alive.items() if len(v) > pos and v[pos] == best}
            prefix.append(best)
            pos += 1
        return next(iter(alive)), parting

    picks, chance, args_ok, parted = defaultdict(list), defaultdict(list), [], defaultdict(list)
    blind_picks, kept, followed = defaultdict(list), defaultdict(list), defaultdict(list)
    for r in records:
        msgs, tools = r["messages"], r["tools"]
        k = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        calls = msgs[k].get("tool_calls")
        if not calls:
            continue
        want = calls[0]["function"]["name"]
        prompt = encode(msgs[:k], tools, gen=True)
        ids = with_name(msgs, k, want, tools)
        text = tok.decode(ids)
        a0 = text.index('"arguments"', len(tok.decode(prompt)))
        a1 = text.index("</tool_call>", a0)
        span = [i for i in range(len(prompt), len(ids)) if a0 <= len(tok.decode(ids[:i])) < a1]
        pred = logits(ids).argmax(-1)
        args_ok.append(all(pred[i - 1].item() == ids[i] for i in span))
        if len(tools) < 2:
            continue
        right = [t["function"]["name"] for t in tools].index(want)
        picked, parting = constrained_pick(msgs, k, tools, right, prompt)
        kind = "generic" if want.casefold() in msgs[k - 1]["content"].casefold() else "domain"
        picks[kind].append(picked == right)
        if parting is not None:
            parted[kind].append(parting)
        chance[kind].append(1 / len(tools))
        if ablate:
            blind, _ = constrained_pick(msgs, k, ablated_tools(tools, ablate))
            blind_picks[kind].append(blind == right)
            kept[kind].append(blind == picked)
            if ablate == "rotated":  # the entry that now holds the right description
                followed[kind].append(blind == (right - 1) % len(tools))
    every = picks["generic"] + picks["domain"]
    rate = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    res = {"selection": rate(every), "selection_chance": rate(chance["generic"] + chance["domain"]),
           "n_selection": len(every), "selection_generic": rate(picks["generic"]),
           "selection_domain": rate(picks["domain"]), "selection_domain_chance": rate(chance["domain"]),
           "n_domain": len(picks["domain"]),
           "parting_mass_domain": rate([m for m, _, _ in parted["domain"]]),
           "parting_share_domain": rate([r for _, r, _ in parted["domain"]]),
           "parting_share_domain_chance": rate([c for _, _, c in parted["domain"]]),
           "args_exact": rate(args_ok), "n_args": len(args_ok)}
    if ablate:
        res.update(ablated=ablate, selection_ablated=rate(blind_picks["generic"] + blind_picks["domain"]),
                   selection_domain_ablated=rate(blind_picks["domain"]),
                   same_pick=rate(kept["generic"] + kept["domain"]), same_pick_domain=rate(kept["domain"]))
        if ablate == "rotated":
            res.update(followed_description=rate(followed["generic"] + followed["domain"]),
                       followed_description_domain=rate(followed["domain"]))
    return res


def made_up_records(n: int, seed: int) -> list[dict]:
    """``n`` fresh tool dialogues over made-up tools, the right tool anywhere in the list."""
    rng, records = random.Random(seed), []
    for _ in range(n):
        tools, msgs = made_up_dialogue(rng)
        rng.shuffle(tools)
        records.append({"kind": "tool", "messages": msgs, "tools": tools})
    return records


def prefixed_records(records: list[dict], seed: int) -> list[dict]:
    """``records`` with a prefix that tells nothing on every listed name, the calls renamed to
    match (records of one tool are left out: there is nothing to select)."""
    rng, out = random.Random(f"prefixed-{seed}"), []
    for r in records:
        msgs = r["messages"]
        k = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if len(r["tools"]) < 2 or k is None or not msgs[k].get("tool_calls") or msgs[k - 1]["role"] != "user":
            continue
        tools, _, renamed = prefix_names(r["tools"], [msgs[k - 1]["content"]], rng)
        msgs = json.loads(json.dumps(msgs))
        want = msgs[k]["tool_calls"][0]["function"]["name"]  # a request that quotes it quotes the new name
        msgs[k - 1]["content"] = re.sub(rf"(?<!\w){re.escape(want)}(?!\w)", renamed[want], msgs[k - 1]["content"])
        for m in msgs:
            for call in m.get("tool_calls") or []:
                call["function"]["name"] = renamed.get(call["function"]["name"], call["function"]["name"])
        out.append({**r, "messages": msgs, "tools": tools})
    return out


def repeat_accuracy(tok, trainee, sequences: int = 8, words: int = 20, seed: int = 5) -> float:
    from synthetic_tools import vocabulary

    rng, pool = random.Random(seed), sorted(vocabulary())
    hits = []
    for _ in range(sequences):
        text = " ".join(rng.choice(pool) for _ in range(words))
        ids = tok.encode(text + " | " + text, add_special_tokens=False)
        start = len(tok.encode(text + " |", add_special_tokens=False)) + 2
        pred = trainee.lm(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        hits += [pred[i - 1].item() == ids[i] for i in range(start, len(ids))]
    return sum(hits) / len(hits)


def lookup_accuracy(tok, trainee, rows: int = 256, seed: int = 5) -> tuple[float, float]:
    """(first token of the answer right, a random pick among the listed entries) on lookup drills."""
    from copy_drills import lookup_batch

    vocab = len(tok) - len(tok.added_tokens_decoder)
    marks = T.lookup_marks(vocab)
    tokens, _, starts = lookup_batch(torch.Generator().manual_seed(seed), rows, T.LOOKUP_LENGTH, 0, vocab - 4, marks)
    pred = trainee.lm(input_ids=tokens).logits.argmax(-1)
    hits = [pred[r, starts[r] - 1].item() == tokens[r, starts[r]].item() for r in range(rows)]
    listed = [(tokens[r, : starts[r] - 2] == marks[0]).sum().item() for r in range(rows)]
    return sum(hits) / rows, sum(1 / k for k in listed) / rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="a training run's --out directory, or a checkpoint directory")
    ap.add_argument("--split", choices=("held_out", "train", "made_up", "lexical"), default="held_out")
    ap.add_argument("--n", type=int, default=300, help="dialogues drawn (tool dialogues are about a third)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefixed", action="store_true",
                    help="prefix every listed name with a word that tells nothing (selection by reading the entry)")
    ap.add_argument("--ablate", choices=ABLATIONS,
                    help="decide each selection again with this part of every listed tool emptied, and report "
                         "how often the pick stays the same (what the choice reads)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # leave the other core to a training run
    tok, trainee, label = load(args.path)
    if args.split == "train":
        records = generate(args.n, seed=FRESH_TRAIN_SEED + args.seed, kinds=["tool"])
    elif args.split == "made_up":
        records = made_up_records(args.n // 3, FRESH_TRAIN_SEED + args.seed)
    elif args.split == "lexical":
        rng = random.Random(f"lexical-probe-{FRESH_TRAIN_SEED + args.seed}")
        records = [lexical_record(rng) for _ in range(args.n // 3)]
    else:
        records = [r for r in held_out_examples(args.n, seed=args.seed) if r["kind"] == "tool"]
    if args.prefixed:
        records = prefixed_records(records, args.seed)
    with torch.no_grad():
        res = probe(tok, trainee, records, args.ablate)
        res["copying"] = repeat_accuracy(tok, trainee)
        res["lookup"], res["lookup_chance"] = lookup_accuracy(tok, trainee)
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    split = f"{args.split}, prefixed" if args.prefixed else args.split
    print(f"{label} ({split}): selection {pct(res['selection'])} of {res['n_selection']} "
          f"(random pick {pct(res['selection_chance'])}; generic {pct(res['selection_generic'])}, "
          f"domain {pct(res['selection_domain'])} of {res['n_domain']}, random {pct(res['selection_domain_chance'])}); "
          f"arguments exact {pct(res['args_exact'])} of {res['n_args']}; "
          f"copying {pct(res['copying'])}; lookup {pct(res['lookup'])} (random pick {pct(res['lookup_chance'])})")
    print(f"  domain, where the listed names part: {pct(res['parting_mass_domain'])} of the probability on "
          f"their tokens, the right one's share of it {pct(res['parting_share_domain'])} "
          f"(spread evenly: {pct(res['parting_share_domain_chance'])})")
    if args.ablate:
        rotated = args.ablate == "rotated"
        what = "with each description moved to the previous entry" if rotated else f"without {args.ablate}"
        print(f"  {what}: selection {pct(res['selection_ablated'])} "
              f"(domain {pct(res['selection_domain_ablated'])}); the same pick as with them "
              f"{pct(res['same_pick'])} (domain {pct(res['same_pick_domain'])})")
        if args.ablate == "rotated":
            print(f"  picked the entry that holds the right description {pct(res['followed_description'])} "
                  f"(domain {pct(res['followed_description_domain'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
