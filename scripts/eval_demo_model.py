"""Measure the demo model on held-out prompts (phrasings and tool names training never saw).

    python scripts/eval_demo_model.py [MODEL] [--n 300] [--out results/demo_eval.json]

MODEL defaults to the package's embedded model. Greedy decoding through the engine, all
prompts concurrently (the engine batches them). Reports:
- tool dialogues: the first call names the right tool (choice) and has exactly the right
  arguments (args), with the engine's default lazy tool-call grammar and with the raw model
  (``constrain_tool_calls=False``, the ``_raw`` rows); the choice where two or more tools
  are listed (``tool_choice_multi``, with the rate of a uniform random pick beside it,
  ``_chance``: with one tool the grammar leaves nothing to choose), and of those the requests
  that quote the tool's name (``tool_choice_multi_named``: selection by lookup alone, no
  meaning to know); calls made where the dialogue has
  none (``tool_call_unwanted``); after the tool result, the answer quotes the result's value;
- stdlib Q&A: the answer starts with the function's docstring summary;
- arithmetic and unit conversion: the answer contains the right number;
- structured output (``response_format`` with a JSON schema, 120 tokens, as the adapters'
  tests ask): the answer is complete, valid JSON, on held-out JSON-answer requests
  (``structured_valid``; ``structured_values``: every value the request determines is
  right) and on common schemas over everyday requests (``structured_valid_common``);
- MTP: acceptance of the head's drafts on the model's own greedy outputs, depth 1 and 2.

``--selection-probe N`` adds a larger measure of selection alone (the standard set has about
30 first calls among two or more tools, 12 of them named): N first calls among two or more
held-out tools and N drawn like the training dialogues (``--probe-mix``, a seed no run uses),
each split by whether the request quotes the tool's name (``probe_<split>_named``) or
describes it (``probe_<split>_described``), with a random pick's rate beside each
(``_chance``). Engine default, as users call it.

``--pairwise`` asks whether a pick follows the request at all: each held-out tool's
described one-turn requests (three per tool), each beside one other held-out tool, in both
orders (``pairwise_right``; a pick that ignores the request, always the same tool of a pair,
scores exactly 50%), how often the first listed tool is picked (``pairwise_first``), and
each tool's share of picks where it is listed (``pairwise_picks``). Run 32 found picks
below 50%: the models prefer some tools whatever is asked (docs/demo_model.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_tandem  # noqa: E402,F401  - OpenBLAS before mlx
from mlx_tandem import Engine  # noqa: E402

from demo_data import EVAL_MIX, TRAIN_MIXES, held_out_examples, held_out_structured, tool_record  # noqa: E402

PROBE_SEED = 12345  # not a seed a training run uses: the training-like requests are fresh

# Structured output as users ask for it: schemas like the adapters' tests' (LlamaIndex's
# Person, langchain-tests' Joke) and a few common ones, over everyday requests.
_NULLABLE = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
COMMON_SCHEMAS = {
    "Person": {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "description": "the person's name"}, "age": {"type": "integer"},
        "nickname": _NULLABLE}},
    "Joke": {"type": "object", "required": ["setup", "punchline"], "properties": {
        "setup": {"type": "string"}, "punchline": {"type": "string"}}},
    "City": {"type": "object", "required": ["city", "country", "population"], "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}}},
    "Answer": {"type": "object", "required": ["answer", "confidence"], "properties": {
        "answer": {"type": "string"}, "confidence": {"type": "number"}}},
    "Item": {"type": "object", "required": ["name", "price"], "properties": {
        "name": {"type": "string"}, "price": {"type": "number"}}},
}
COMMON_PROMPTS = ["Describe a pirate.", "Tell me a joke about cats.", "Tell me about Paris.", "What is 2 + 2?",
                  "Describe Ada Lovelace, aged 36.", "Describe a cheap pencil.", "Give me an example.",
                  "Who are you?"]


def first_answer(record: dict) -> int:
    """The index of a dialogue's first assistant turn: what the model is asked to write."""
    return next(i for i, m in enumerate(record["messages"]) if m["role"] == "assistant")


def _args(call) -> dict:
    a = call["function"]["arguments"]
    return json.loads(a) if isinstance(a, str) else a


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def _numbers(text: str) -> list[str]:
    return re.findall(r"-?\d+(?:\.\d+)?", text)


def _score_call(score: dict, suffix: str, want: dict, out, n_tools: int, request: str = "") -> None:
    """Score one first turn: ``want`` is the dialogue's assistant message, ``out`` the engine's
    answer, ``request`` the user message it answers."""
    calls = want.get("tool_calls") or []
    if not calls:  # the dialogue answers without a tool here
        score["tool_call_unwanted" + suffix].append(bool(out.tool_calls))
        return
    expect = calls[0]["function"]
    got = out.tool_calls[0] if out.tool_calls else None
    right = got is not None and got.name == expect["name"]
    score["tool_choice" + suffix].append(right)
    if n_tools > 1 and not suffix:
        # Selection proper: with one listed tool the grammar leaves no choice to make.
        score["tool_choice_multi"].append(right)
        score["tool_choice_multi_chance"].append(1 / n_tools)
        if expect["name"] in request:
            score["tool_choice_multi_named"].append(right)
            score["tool_choice_multi_named_chance"].append(1 / n_tools)
    score["tool_args" + suffix].append(right and got.arguments == _args(calls[0]))


def probe_turns(n: int, split: str, mix: str) -> list[tuple[dict, int]]:
    """``n`` (tool dialogue, index of its first assistant turn) whose first turn calls one of
    two or more listed tools: held out (``split="eval"``) or drawn as training draws them."""
    rng = random.Random(f"{PROBE_SEED}-{split}")
    out = []
    while len(out) < n:
        r = tool_record(rng, split, EVAL_MIX if split == "eval" else TRAIN_MIXES[mix])
        k = first_answer(r)
        if r["messages"][k].get("tool_calls") and len(r["tools"]) > 1:
            out.append((r, k))
    return out


def pairwise_turns(seed: int, per_tool: int = 3) -> list[tuple[str, str, tuple[dict, dict]]]:
    """(request, wanted tool, two listed tools) for ``--pairwise``: up to ``per_tool`` one-turn
    requests per held-out tool that describe it without its name, each beside every other
    such tool, in both orders."""
    schemas, asks = {}, {}
    for r in held_out_examples(400, seed=seed):
        if r["kind"] != "tool":
            continue
        schemas.update((t["function"]["name"], t) for t in r["tools"])
        first = r["messages"][1]
        if first["role"] == "assistant" and first.get("tool_calls"):
            want, ask = first["tool_calls"][0]["function"]["name"], r["messages"][0]["content"]
            if want not in ask:
                asks.setdefault(want, set()).add(ask)
    names = sorted(asks)
    return [(ask, want, (schemas[a], schemas[b]))
            for want in names for ask in sorted(asks[want])[:per_tool]
            for other in names if other != want for a, b in ((want, other), (other, want))]


def _score_pair(score: dict, picks: dict, want: str, tools: tuple[dict, dict], out) -> None:
    got = out.tool_calls[0].name if out.tool_calls else None
    score.setdefault("pairwise_right", []).append(got == want)
    score.setdefault("pairwise_first", []).append(got == tools[0]["function"]["name"])
    for t in tools:
        picks.setdefault(t["function"]["name"], []).append(got == t["function"]["name"])


def _score_pick(score: dict, split: str, record: dict, k: int, out) -> None:
    """Whether ``out`` calls the tool the dialogue's turn ``k`` calls, filed under
    ``probe_<split>_named`` when the request quotes its name, else ``_described``."""
    want = record["messages"][k]["tool_calls"][0]["function"]["name"]
    kind = "named" if want in (record["messages"][k - 1]["content"] or "") else "described"
    score.setdefault(f"probe_{split}_{kind}", []).append(bool(out.tool_calls) and out.tool_calls[0].name == want)
    score.setdefault(f"probe_{split}_{kind}_chance", []).append(1 / len(record["tools"]))


async def evaluate(model, n: int, seed: int, probe: int = 0, probe_mix: str = "nonce_json2",
                   pairwise: bool = False) -> dict:
    records = held_out_examples(n, seed=seed)
    engine = Engine(model, show_progress=False, mtp="off", max_batch_size=32)
    await engine.start()

    async def first_turn(r):
        k = first_answer(r)
        out = await engine.chat(r["messages"][:k], {"max_tokens": 96}, tools=r.get("tools"))
        return r, k, out

    results = await asyncio.gather(*(first_turn(r) for r in records))
    score: dict[str, list] = {"tool_choice": [], "tool_args": [], "tool_choice_multi": [],
                              "tool_choice_multi_chance": [], "tool_choice_multi_named": [],
                              "tool_choice_multi_named_chance": [], "tool_choice_raw": [], "tool_args_raw": [],
                              "tool_call_unwanted": [], "tool_call_unwanted_raw": [], "tool_answer": [],
                              "stdlib_summary": [], "arith": [], "units": [], "structured_valid": [],
                              "structured_values": [], "structured_valid_common": []}
    follow_ups = []
    for r, k, out in results:
        want = r["messages"][k]
        kind = r["kind"]
        if kind == "tool":
            _score_call(score, "", want, out, len(r["tools"]), r["messages"][k - 1]["content"] or "")
            # Second turn: give the tool result (as the dialogue has it) and check the answer.
            if want.get("tool_calls") and len(r["messages"]) > k + 2 and r["messages"][k + 1]["role"] == "tool":
                follow_ups.append((r, k))
        elif kind == "stdlib_qa":
            summary = want["content"].split(" Signature:")[0].split(" Call it as")[0]
            score["stdlib_summary"].append(_norm(out.text).startswith(_norm(summary)))
        elif kind in ("arith", "units"):
            target = _numbers(want["content"])[-1] if _numbers(want["content"]) else None
            score[kind].append(target is not None and target in _numbers(out.text))

    async def second_turn(r, k):
        msgs = r["messages"][: k + 2]
        final = r["messages"][k + 2]["content"] if r["messages"][k + 2]["role"] == "assistant" else ""
        out = await engine.chat(msgs, {"max_tokens": 64}, tools=r.get("tools"))
        nums = [x for x in _numbers(final) if x not in _numbers(r["messages"][0]["content"] or "")]
        key = nums or [w for w in re.findall(r"[A-Z][a-z]+", final)][:1]
        return bool(key) and all(x in out.text for x in key[:1])

    score["tool_answer"] = list(await asyncio.gather(*(second_turn(r, k) for r, k in follow_ups)))

    async def json_answer(messages, schema):
        out = await engine.chat(messages, {"max_tokens": 120}, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        try:  # the grammar makes a complete answer valid; an unfinished one is cut mid-value
            return json.loads(out.text)
        except ValueError:
            return None

    structured = held_out_structured(max(n // 5, 20), seed=seed)
    answers = await asyncio.gather(*(json_answer(r["messages"][:1], r["schema"]) for r in structured))
    for r, got in zip(structured, answers):
        want = json.loads(r["messages"][1]["content"])
        score["structured_valid"].append(got is not None)
        if r["scored"]:
            score["structured_values"].append(got is not None and all(got.get(k) == want[k] for k in r["scored"]))
    common = [([{"role": "user", "content": p}], s) for s in COMMON_SCHEMAS.values() for p in COMMON_PROMPTS]
    score["structured_valid_common"] = [a is not None for a in
                                        await asyncio.gather(*(json_answer(m, s) for m, s in common))]
    for split, name in (("held_out", "eval"), ("training_like", "train")):
        turns = probe_turns(probe, name, probe_mix) if probe else []
        outs = await asyncio.gather(*(engine.chat(r["messages"][:k], {"max_tokens": 48}, tools=r["tools"])
                                      for r, k in turns))
        for (r, k), out in zip(turns, outs):
            _score_pick(score, split, r, k, out)
    picks: dict[str, list] = {}
    pairs = pairwise_turns(seed) if pairwise else []
    outs = await asyncio.gather(*(engine.chat([{"role": "user", "content": ask}], {"max_tokens": 48},
                                              tools=list(tools)) for ask, _, tools in pairs))
    for (_, want, tools), out in zip(pairs, outs):
        _score_pair(score, picks, want, tools, out)
    await engine.close()

    # The same first turns of tool dialogues with the raw model: no grammar on calls.
    engine = Engine(model, show_progress=False, mtp="off", max_batch_size=32, constrain_tool_calls=False)
    await engine.start()
    tool_turns = [(r, k) for r, k, _ in results if r["kind"] == "tool"]
    raw = await asyncio.gather(*(engine.chat(r["messages"][:k], {"max_tokens": 96}, tools=r["tools"])
                                 for r, k in tool_turns))
    for (r, k), out in zip(tool_turns, raw):
        _score_call(score, "_raw", r["messages"][k], out, len(r["tools"]))
    await engine.close()

    # MTP acceptance on the model's own greedy outputs.
    mtp = {}
    prompts = [r["messages"][: first_answer(r)]
               for r in records if r["kind"] != "tool"][:64]
    for depth in (1, 2):
        engine = Engine(model, show_progress=False, mtp="on", mtp_depth=depth, max_batch_size=32)
        await engine.start()
        await asyncio.gather(*(engine.chat(p, {"max_tokens": 64}) for p in prompts))
        st = engine.stats()["mtp"]
        mtp[f"depth_{depth}"] = {"acceptance_rate": st["acceptance_rate"],
                                 "mean_accepted_per_step": st["mean_accepted_per_step"], "drafted": st["drafted"]}
        await engine.close()
    rates = {k: (sum(v) / len(v) if v else None) for k, v in score.items()}
    counts = {k: len(v) for k, v in score.items()}
    res = {"n": n, "seed": seed, "rates": rates, "counts": counts, "mtp": mtp}
    if picks:
        res["pairwise_picks"] = {k: sum(v) / len(v) for k, v in sorted(picks.items())}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--selection-probe", type=int, default=0, metavar="N",
                    help="also pick among 2+ tools on N held-out and N training-like requests")
    ap.add_argument("--probe-mix", default="nonce_json2", choices=sorted(TRAIN_MIXES),
                    help="the training mix the training-like probe requests are drawn from")
    ap.add_argument("--pairwise", action="store_true",
                    help="also pick between two held-out tools, in both orders, for requests describing one")
    args = ap.parse_args(argv)
    res = asyncio.run(evaluate(args.model, args.n, args.seed, args.selection_probe, args.probe_mix, args.pairwise))
    for k, v in res["rates"].items():
        print(f"{k:>30}: {'n/a' if v is None else f'{100 * v:5.1f}%'}  (n={res['counts'][k]})")
    for k, v in res.get("pairwise_picks", {}).items():
        print(f"{'picked where listed: ' + k:>40}: {100 * v:5.1f}%")
    for k, v in res["mtp"].items():
        print(f"MTP {k}: acceptance {100 * v['acceptance_rate']:.1f}%, "
              f"mean accepted per step {v['mean_accepted_per_step']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
