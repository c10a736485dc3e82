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

``prefixed`` (run 33): a share of the drills where every listed tool's name starts with a word
of its own that tells nothing (a generic verb or made-up syllables, "zuvo_sqrt", "fetchSqrt"),
none of them in the request. Without it the models choose a tool by the first token of its
name alone: that token must match the request or be recalled, and with such prefixes on
every listed name they pick at chance, on training tools too. Held-out names are like that
("Which prime comes right after 87?" for ``next_prime``): the request matches a later part of
the entry, and the name's first token has to be read from the entry that matches.

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
class DrillTool:
    """A listed tool of a drill, its parameters all strings: a stdlib callable or a lexical tool."""
    name: str         # "sqrt" or "math_sqrt" for a stdlib callable
    description: str  # the docstring's first sentence for a stdlib callable
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
def stdlib_tools() -> tuple[tuple[DrillTool, DrillTool], ...]:
    """Each usable stdlib callable as (short-named tool, module-named tool)."""
    out = []
    for entry in demo_data.stdlib_entries():
        if not _clean(entry):
            continue
        module, attr = entry.name.rsplit(".", 1)
        params = _params(entry.signature)
        out.append((DrillTool(attr, entry.summary, params),
                    DrillTool(f"{module.replace('.', '_')}_{attr}", entry.summary, params)))
    return tuple(out)


def _task(summary: str) -> str:
    """"Return the square root of x." -> "return the square root of x"."""
    return summary[0].lower() + summary[1:].rstrip(".!?")


def _stdlib_ask(target: DrillTool, others: list[dict], rng: random.Random) -> str:
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


def _stdlib_set(rng: random.Random, k: int) -> list[DrillTool]:
    pairs = rng.sample(stdlib_tools(), k)
    tools = [pair[rng.random() < 0.3] for pair in pairs]
    names = {t.name for t in tools}
    return tools if len(names) == k else _stdlib_set(rng, k)


def _camel(name: str) -> bool:
    return "_" not in name and name != name.lower()


def prefix_names(tools: list[dict], asks: list[str], rng: random.Random) -> tuple[list[dict], list[str], dict]:
    """``tools`` with a distinct prefix on every name that no request says (a request that
    quotes a name quotes the new one), so only the entry that matches a request tells the
    name's first token: (tools, asks, old name -> new name)."""
    said, taken, renamed = set().union(*map(set, map(_words, asks))), set(), {}
    for t in tools:
        old = t["function"]["name"]
        while True:
            if rng.random() < 0.5:
                prefix = rng.choice(demo_data.RENAME_VERBS)
            else:
                prefix = "".join(rng.choice(synthetic_tools.SYLLABLES) for _ in range(rng.randint(1, 2)))
            if prefix not in said and prefix not in taken:
                break
        taken.add(prefix)
        renamed[old] = prefix + old[:1].upper() + old[1:] if _camel(old) else f"{prefix}_{old}"
    tools = [{**t, "function": {**t["function"], "name": renamed[t["function"]["name"]]}} for t in tools]
    quoting = {template.format(name=old): template.format(name=new)
               for old, new in renamed.items() for template in NAME_ASKS}
    return tools, [quoting.get(ask, ask) for ask in asks], renamed


# Lexical drills (``lexical``, run 35): tools built around words drawn at random, from a pool of
# about 900 real words and from made-up ones (``synthetic_tools.nonce_noun``), so no tool
# concept repeats often enough to be learned. Each listed tool carries a key word of its own, in
# its name after a first word that tells nothing ("fetch_kazori", "lanternDolphin"), in its
# description, or in both; the request says the key word and nothing else of the list. The
# only way to the name's first token is to find the request's word in the list and read the
# name of the entry it is in: the hop that held-out tools need ("Which prime comes right after
# 87?" for ``next_prime``), with nothing to recall. The frames are this module's own, none of
# the held-out phrasings or descriptions.
LEXICAL_DESCRIPTIONS = ["{W} of a {x}.", "Look up the {w} for a {x}.", "Return the {w} of the given {x}.",
                        "Find a {w} by {x}.", "{X} {w} lookup.", "Create a {w}.", "The {w} of one {x}.",
                        "Compute the {w} from a {x} and a {y}.", "List every {w}.", "{W} for the {x} and {y}."]
LEXICAL_BLAND = ["Run the tool.", "A helper function.", "Handle a {x}.", "Utility for {x} and {y}.", "Does one job."]
LEXICAL_ASKS = ["What is the {w} for {v}?", "Give me the {w} of {v}.", "I want a {w} with {v}.",
                "How many {w} are there in {v}?", "Find the {w} of {v}, please.", "{V} needs a {w}.",
                "Any {w} for {v}?", "Show me the {w}: {v}.", "Could you get a {w} for {v}?",
                "Tell me the {w} near {v}.", "Which {w} fits {v}?", "Let me know the {w} of {v}."]


@functools.cache
def lexical_pool() -> tuple[str, ...]:
    """The real words a lexical drill draws from: the stdlib summaries' key words, the made-up
    tools' words and the common words, none of them a word of the held-out tools."""
    words = {w for pair in stdlib_tools() for w in _key_words(pair[0].description)}
    words |= synthetic_tools.vocabulary() | set(synthetic_tools.COMMON_WORDS)
    # Not the frames' own words, which every drill says, nor the verbs that lead names and tell nothing.
    frames = set(_words(" ".join(LEXICAL_DESCRIPTIONS + LEXICAL_BLAND + LEXICAL_ASKS)))
    return tuple(sorted(w for w in words - frames - set(demo_data.RENAME_VERBS) - synthetic_tools.EVAL_CONCEPT_WORDS
                        if w.isalpha() and len(w) > 2 and w not in STOPWORDS))


def _lexical_word(rng: random.Random, taken: set[str]) -> str:
    while True:
        word = synthetic_tools.nonce_noun(rng) if rng.random() < 0.5 else rng.choice(lexical_pool())
        if word not in taken:
            taken.add(word)
            return word


def _join(parts: list[str], rng: random.Random) -> str:
    if rng.random() < 0.2:  # camelCase
        return parts[0] + "".join(p[:1].upper() + p[1:] for p in parts[1:])
    return "_".join(parts)


def lexical_record(rng: random.Random, every_tool: bool = False) -> dict:
    """One lexical drill: 2-4 tools around random key words, a request that says the target's.
    With ``every_tool`` as many requests as tools, each followed by its call, each target
    drawn afresh (with repeats: asking for each tool once would let the last be found by
    elimination)."""
    k = rng.randint(2, 4)
    taken: set[str] = set()
    keys = [_lexical_word(rng, taken) for _ in range(k)]
    fillers = [_lexical_word(rng, taken) for _ in range(2)]  # shared by the descriptions: they tell nothing
    tools = []
    for key in keys:
        where = rng.choices(("both", "name", "description"), (0.5, 0.25, 0.25))[0]
        lead = rng.choice(demo_data.RENAME_VERBS) if rng.random() < 0.5 else _lexical_word(rng, taken)
        tail = [_lexical_word(rng, taken)] if rng.random() < 0.3 else []
        name = _join([lead] + ([key] if where != "description" else [_lexical_word(rng, taken)]) + tail, rng)
        x, y = rng.sample(fillers, 2)
        template = rng.choice(LEXICAL_BLAND if where == "name" else LEXICAL_DESCRIPTIONS)
        text = template.format(w=key, W=key.capitalize(), x=x, X=x.capitalize(), y=y)
        params = rng.sample(demo_data.GENERIC_PARAMS, rng.randint(0, 2))
        tools.append(DrillTool(name, text, tuple(params)).schema())
    messages = []
    for i in range(1, (k if every_tool else 1) + 1):
        target = rng.randrange(k)
        made_up = synthetic_tools.nonce_noun(rng)
        while made_up in taken:  # the value says no listed word
            made_up = synthetic_tools.nonce_noun(rng)
        value = rng.choice([made_up.capitalize(), str(rng.randint(2, 999)), rng.choice(synthetic_tools.CITY_NAMES)])
        ask = rng.choice(LEXICAL_ASKS).format(w=keys[target], v=value, V=value)
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": tools[target]["function"]["name"], "arguments": {}}}
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    return {"kind": KIND, "tools": tools, "messages": messages}


def selection_record(rng: random.Random, nonce: float = 0.5, prefixed: float = 0.0, every_tool: bool = False,
                     lexical: float = 0.0) -> dict:
    """One drill: 2-4 tools (stdlib, made-up, or both), a request for one, the call's name.
    With probability ``prefixed`` every name gets a prefix that tells nothing (``prefix_names``);
    with ``every_tool`` the drill goes on with a request for each other tool it can ask for
    (made-up tools among made-up ones, stdlib tools otherwise), each followed by its call:
    several scored names for one tool list. With probability ``lexical`` the drill is a
    ``lexical_record`` instead."""
    if lexical and rng.random() < lexical:  # no draw when off: the other drills stay as they were
        return lexical_record(rng, every_tool)
    k = rng.randint(2, 4)
    roll = rng.random()
    if roll < 0.35:  # made-up tools only: the request as the dialogues phrase it
        made_up = synthetic_tools.tool_set(rng, k, nonce)
        target = rng.choice(made_up)
        tools, askable = [t.schema() for t in made_up], made_up

        def ask_for(t):
            return synthetic_tools.unambiguous_request(t, made_up, rng).ask
    else:
        n_made_up = rng.randint(1, k - 1) if roll < 0.6 else 0
        stdlib = _stdlib_set(rng, k - n_made_up)
        tools = [t.schema() for t in stdlib]
        tools += [t.schema() for t in synthetic_tools.tool_set(rng, n_made_up, nonce)]
        rng.shuffle(tools)
        target, askable = rng.choice(stdlib), stdlib

        def ask_for(t):
            return _stdlib_ask(t, [s for s in tools if s["function"]["name"] != t.name], rng)
    picks = [(ask_for(target), target.name)]
    if every_tool:
        rest = [t for t in askable if t is not target]
        rng.shuffle(rest)
        picks += [(ask_for(t), t.name) for t in rest]
    asks, names = [a for a, _ in picks], [n for _, n in picks]
    if prefixed and rng.random() < prefixed:  # no draw when off: the unprefixed drills stay as they were
        tools, asks, renamed = prefix_names(tools, asks, rng)
        names = [renamed[n] for n in names]
    messages = []
    for i, (ask, name) in enumerate(zip(asks, names), 1):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": {}}}
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    return {"kind": KIND, "tools": tools, "messages": messages}


def generate(n: int, seed: int, nonce: float = 0.5, prefixed: float = 0.0, every_tool: bool = False,
             lexical: float = 0.0) -> list[dict]:
    """``n`` drills, deterministic in ``seed``, none touching held-out material; a share
    ``prefixed`` of them with uninformative name prefixes, and with ``every_tool`` a request
    for each tool that can be asked for (``selection_record``)."""
    rng = random.Random(f"selection-{seed}")
    out = []
    while len(out) < n:
        record = selection_record(rng, nonce, prefixed, every_tool, lexical)
        if not demo_data.held_out_violations(record):
            out.append(record)
    return out
