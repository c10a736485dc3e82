"""Selection drills for the demo model: the real chat template, 2-4 tools listed, one request,
and the loss on the called tool's name only (``train_demo_model.py --selection-every``).

Why: every run so far picks among held-out tools that a request *describes* at about chance
(docs/demo_model.md, runs 26-27), while a named request is read from the list in some runs.
The dialogues teach selection on a few tokens each, inside 400-token tool dialogues with
~30 hand-written tool concepts and made-up ones built from ~140 words; their loss is mostly
the call's arguments and the answer. These drills put a batch's whole loss on the name, over
many more concepts: the documented callables of the stdlib (``demo_data.stdlib_entries``, 200
of them) listed as tools with their docstring summary as the description, beside made-up
tools (``synthetic_tools``). The request shares words with the right tool's description or
name and with no other listed tool's, as the held-out requests do ("Which prime comes right
after 87?" for ``next_prime``, "Smallest prime greater than n."), so matching what it asks
against the list is the way to the name, never recall of a known tool.

Held out as everywhere in the training data: no evaluation concept word and no held-out tool
name or prompt occurs (``demo_data.held_out_violations``, ``synthetic_tools.EVAL_CONCEPT_WORDS``; tested).
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

import demo_data
import synthetic_tools

KIND = "tool_selection"
#: Words too common to tell one tool from another.
STOPWORDS = frozenset("""a an the of to in on for and or by with from into is are be as at it its this that
these those if not no any all one two each every given which whose what when where than then
return returns returned object objects function value values new true false none use used using
""".split())

# A request for a stdlib tool: its summary as a task, a few of its words, or its name.
TASK_ASKS = ["Can you {task}?", "Please {task}.", "I need to {task}.", "Use a tool to {task}.",
             "{Task}, please.", "Could you {task} for me?"]
WORD_ASKS = ["I need something for {words}.", "Which tool handles {words}? Call it.", "Help with {words}, please.",
             "Something about {words}: use the right tool.", "Let's do {words}."]
NAME_ASKS = ["Call {name}.", "Use {name} for this.", "Run {name}, please.", "Try {name}.",
             "I want the {name} tool."]  # not "Invoke {name} ...": a held-out phrasing (demo_data.GENERIC_ASKS)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def _key_words(text: str) -> set[str]:
    return {w for w in _words(text) if len(w) > 2 and w not in STOPWORDS}


def tool_key_words(name: str, description: str) -> set[str]:
    """The words that can tell a tool apart: of its description and of its name's parts."""
    return _key_words(description) | _key_words(name.replace("_", " "))


@dataclass(frozen=True)
class StdlibTool:
    name: str         # "sqrt" or "math_sqrt"
    description: str  # the docstring's first sentence
    params: tuple[str, ...]

    def schema(self) -> dict:
        props = {p: {"type": "string"} for p in self.params}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": {"type": "object", "properties": props,
                                                                "required": list(self.params)}}}

    @property
    def key_words(self) -> set[str]:
        return tool_key_words(self.name, self.description)


def _params(signature: str | None) -> tuple[str, ...]:
    if not signature:
        return ()
    inside = signature[signature.index("(") + 1: signature.rindex(")")]
    names = [p.split("=")[0].strip().lstrip("*") for p in inside.split(",")]
    return tuple(n for n in names if n.isidentifier())


def _clean(entry: demo_data.StdlibEntry) -> bool:
    text = f"{entry.name} {entry.summary}".lower()
    return not (set(_words(text)) & synthetic_tools.EVAL_CONCEPT_WORDS)


@functools.cache
def stdlib_tools() -> tuple[tuple[StdlibTool, StdlibTool], ...]:
    """Each usable stdlib callable as (short-named tool, module-named tool)."""
    out = []
    for entry in demo_data.stdlib_entries():
        if not _clean(entry):
            continue
        module, attr = entry.name.rsplit(".", 1)
        params = _params(entry.signature)
        out.append((StdlibTool(attr, entry.summary, params),
                    StdlibTool(f"{module.replace('.', '_')}_{attr}", entry.summary, params)))
    return tuple(out)


def _task(summary: str) -> str:
    """"Return the square root of x." -> "return the square root of x"."""
    return summary[0].lower() + summary[1:].rstrip(".!?")


def _stdlib_ask(target: StdlibTool, others: list[dict], rng: random.Random) -> str:
    """A request for ``target`` carrying at least one of its words that no other listed tool has."""
    taken = set().union(*(tool_key_words(t["function"]["name"], t["function"]["description"]) for t in others))
    unique = target.key_words - taken
    words = _words(target.description)
    in_description = sorted(unique & set(words))
    roll = rng.random()
    if roll < 0.2 or not unique:
        return rng.choice(NAME_ASKS).format(name=target.name)
    if not in_description:  # only a word of the name tells it apart
        return rng.choice(WORD_ASKS).format(words=rng.choice(sorted(unique)))
    if roll < 0.6 or len(words) < 3:
        task = _task(target.description)
        return rng.choice(TASK_ASKS).format(task=task, Task=task[0].upper() + task[1:])
    # A window of 2-4 of the description's words around one that only this tool has.
    at = words.index(rng.choice(in_description))
    width = rng.randint(2, 4)
    start = max(0, min(at - rng.randint(0, width - 1), len(words) - width))
    return rng.choice(WORD_ASKS).format(words=" ".join(words[start: start + width]))


def _stdlib_set(rng: random.Random, k: int) -> list[StdlibTool]:
    pairs = rng.sample(stdlib_tools(), k)
    tools = [pair[rng.random() < 0.3] for pair in pairs]
    names = {t.name for t in tools}
    return tools if len(names) == k else _stdlib_set(rng, k)


def selection_record(rng: random.Random, nonce: float = 0.5) -> dict:
    """One drill: 2-4 tools (stdlib, made-up, or both), a request for one, the call's name."""
    k = rng.randint(2, 4)
    roll = rng.random()
    if roll < 0.35:  # made-up tools only: the request as the dialogues phrase it
        made_up = synthetic_tools.tool_set(rng, k, nonce)
        target = rng.choice(made_up)
        ask = synthetic_tools.unambiguous_request(target, made_up, rng).ask
        tools, name = [t.schema() for t in made_up], target.name
    else:
        n_made_up = rng.randint(1, k - 1) if roll < 0.6 else 0
        stdlib = _stdlib_set(rng, k - n_made_up)
        tools = [t.schema() for t in stdlib]
        tools += [t.schema() for t in synthetic_tools.tool_set(rng, n_made_up, nonce)]
        rng.shuffle(tools)
        target = rng.choice(stdlib)
        ask = _stdlib_ask(target, [t for t in tools if t["function"]["name"] != target.name], rng)
        name = target.name
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": {}}}
    return {"kind": KIND, "tools": tools,
            "messages": [{"role": "user", "content": ask},
                         {"role": "assistant", "content": "", "tool_calls": [call]}]}


def generate(n: int, seed: int, nonce: float = 0.5) -> list[dict]:
    """``n`` drills, deterministic in ``seed``, none touching held-out material."""
    rng = random.Random(f"selection-{seed}")
    out = []
    while len(out) < n:
        record = selection_record(rng, nonce)
        if not demo_data.held_out_violations(record):
            out.append(record)
    return out
