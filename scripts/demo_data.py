"""Deterministic, offline training data for a tiny chat model trained from scratch.

The model has a few million parameters and about an hour of CPU, so the data teaches a few
narrow skills with short dialogues rather than broad knowledge:

* ``stdlib_qa`` - what a Python standard-library callable does, or its signature. Built with
  ``inspect`` from a fixed list of modules, so the facts are true and need no download.
* ``arith`` - small-integer addition, subtraction and multiplication with exact answers.
* ``units`` - exact conversions (km/m/cm, kg/g, hours/minutes, Celsius/Fahrenheit).
* ``tool`` - OpenAI-style tool use: 1-3 tools, the user asks for something one of them
  does, the assistant emits one call with arguments copied from the request, the tool
  answers and the assistant reports the result. About a quarter of these are generic
  "What is the value of frob_value(3)? Use the tool." requests on made-up functions (so
  the model learns to call *any* named tool with the arguments in the prompt), and about a
  fifth ask something unrelated, which the assistant answers without a call.
* ``chat`` - greetings, thanks and goodbyes with short friendly replies, some two-turn.

Every record is ``{"kind", "messages", "tools"}`` with OpenAI-style messages, so it renders
through any ChatML template (the factory one included).

Held out: the tool names and prompts used by langchain-tests and this repo's tests never
appear in training data, so those tests measure generalisation, not recall. A generated
record is rejected (and redrawn) if it defines or calls a held-out tool, if a message equals
a held-out prompt, or if a message contains a held-out prompt of four or more words. Short
generic prompts ("hi", "Hello") are only banned as whole messages: "Hello there!" stays.
``held_out_examples`` draws an evaluation set from separate phrasings and tool names that
training never uses; ``held_out_test_cases`` rebuilds the tests' own tool-call requests.

Everything is driven by one ``random.Random(seed)``: the same seed gives the same records
(for a given Python version - the stdlib docstrings are part of the data).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import math
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass, replace
from datetime import date, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Callable, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import structured_answers  # noqa: E402  - sibling script modules
import synthetic_tools  # noqa: E402

# Shares of each kind in a generated set; tool use gets the most because it is the skill the
# adapters' tests exercise and the one with the most surface (names, schemas, phrasings).
# The evaluation split keeps these shares, so every training run is measured on the same set.
KIND_WEIGHTS = {"stdlib_qa": 0.22, "arith": 0.16, "units": 0.16, "tool": 0.36, "chat": 0.10}
# "structured" (JSON answers, structured_answers.py) is drawn by the "nonce_json" training
# mix only; its evaluation set is separate (held_out_structured), so the split above stays
# byte-identical for every run.
KINDS = (*KIND_WEIGHTS, structured_answers.KIND)

# ----------------------------------------------------------------------------- held out
HELD_OUT_TOOL_NAMES = frozenset({
    # langchain-tests (integration_tests/chat_models.py, unit_tests/chat_models.py)
    "magic_function", "magic_function_no_args", "get_weather", "my_adder_tool",
    "greeting_generator", "unicode_customer", "color_picker", "random_image", "random_pdf",
    "Joke", "JokeDict",
    # this repo's tests (tests/**)
    "add", "multiply", "add_tool", "move", "f", "lookup_capital", "no_such_tool", "nope",
    "Person", "Point", "answer",
})

HELD_OUT_PROMPTS = frozenset({
    # langchain-tests: tool calling
    "What is the value of magic_function(3)? Use the tool.",
    "What is the value of magic_function_no_args()? Use the tool.",
    "Using the tool, generate a Pirate greeting.",
    "Hello. Please respond in the style of",
    "What is the weather in San Francisco, CA?",
    "What is 1 + 2",
    "What is 3 + 4",
    "Create a customer named '你好啊集团' (Hello Group) - a Chinese technology company",
    "Create a customer named 'こんにちは株式会社' (Hello Corporation) - a Japanese company",
    # langchain-tests: tool descriptions
    "Apply a magic function to an input.",
    "Calculate a magic function.",
    "Get weather at a location.",
    "Get the weather at a location.",
    "Tool that adds two integers.",
    "Generate a greeting in a particular style of speaking.",
    "Tool for creating a customer with Unicode name.",
    # langchain-tests: chat and structured output
    "Hello", "Hello!", "hello", "hi", "how are you",
    "Tell me a joke about cats.",
    "Give me a joke about cats, include the punchline.",
    "Give me the setup to a joke about cats, no punchline.",
    "Write me 2 haikus. Only include the haikus.",
    "Give a concise description of this image.",
    # this repo's tests
    "What is 2 + 3?", "What is 2 * 3?", "what is 2 + 3?", "add 2 and 3",
    "Use the add tool to add 2 and 3.", "Add two integers.", "Multiply two integers.",
    "capital of France?", "capital of a country", "What is the capital of France?",
    "weather?", "tell a joke", "a point", "think first", "Answer in JSON please.",
    "Explain recursion in one sentence.", "Write a haiku about CPUs.",
    "Why is the sky blue? Answer briefly please.", "What is 12 * 7?",
    "Which towns have boats?", "Tell me a long story", "go on for a long time",
    "still serving", "Use tools.", "Say hi", "Describe a pirate.",
    # langchain-tests: JSON mode
    "Return the result as a JSON with 'setup' and 'punchline' keys.",
})


def _norm(text: str) -> str:
    return " ".join(text.casefold().split())


def _bare(text: str) -> str:
    # Whole-message comparison ignores case, spacing and closing punctuation.
    return _norm(text).rstrip(" .?!")


_HELD_OUT_EXACT = frozenset(_bare(p) for p in HELD_OUT_PROMPTS)
# Long prompts are distinctive: banned anywhere inside a message, on word boundaries.
_HELD_OUT_INSIDE = re.compile("|".join(
    rf"(?<!\w){re.escape(_bare(p))}(?!\w)" for p in sorted(HELD_OUT_PROMPTS) if len(p.split()) >= 4))
_HELD_OUT_NAMES = frozenset(n.casefold() for n in HELD_OUT_TOOL_NAMES)


def held_out_violations(record: dict) -> list[str]:
    """Why ``record`` touches held-out material (empty when it does not)."""
    found = []
    for tool in record.get("tools") or []:
        fn = tool["function"]
        if fn["name"].casefold() in _HELD_OUT_NAMES:
            found.append(f"tool {fn['name']}")
        if _bare(fn.get("description", "")) in _HELD_OUT_EXACT:
            found.append(f"description {fn['description']!r}")
    for msg in record["messages"]:
        for call in msg.get("tool_calls") or []:
            if call["function"]["name"].casefold() in _HELD_OUT_NAMES:
                found.append(f"call {call['function']['name']}")
        text = msg.get("content") or ""
        if _bare(text) in _HELD_OUT_EXACT or _HELD_OUT_INSIDE.search(_norm(text)):
            found.append(f"prompt {text!r}")
    return found


# ----------------------------------------------------------------------------- helpers
def _num(x) -> str:
    """Exact decimal text without exponent or trailing zeros: 2.50 -> 2.5, 3.0 -> 3."""
    text = format(Decimal(str(x)).normalize(), "f")
    return "0" if text == "-0" else text


def _pick(rng: random.Random, split: str, options: dict) -> str:
    return rng.choice(options[split])


def _system(rng: random.Random, split: str, p: float = 0.2) -> list[dict]:
    if rng.random() >= p:
        return []
    return [{"role": "system", "content": _pick(rng, split, SYSTEM_PROMPTS)}]


SYSTEM_PROMPTS = {
    "train": ["You are a helpful assistant.", "You are a concise assistant.", "Answer briefly.",
              "You are a friendly assistant. Keep answers short.", "Be brief and accurate."],
    "eval": ["You are an expert assistant.", "Reply in one short sentence."],
}


# ----------------------------------------------------------------------------- stdlib_qa
STDLIB_MODULES = ("math", "os.path", "string", "json", "itertools", "functools", "collections",
                  "textwrap", "statistics", "random", "re", "shutil", "datetime")


@dataclass(frozen=True)
class StdlibEntry:
    name: str              # dotted, e.g. "math.sqrt"
    summary: str           # first sentence of the docstring
    signature: str | None  # "math.sqrt(x, /)", or None when unknown or too long


_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)\s*(-+>.*)?$")


def _summary(doc: str | None) -> str | None:
    """First sentence of the first paragraph that is not a signature line."""
    for para in (doc or "").split("\n\n"):
        lines = [ln.strip() for ln in para.strip().splitlines()]
        lines = [ln for ln in lines if ln and not _SIGNATURE_LINE.match(ln)]
        if not lines:
            continue
        # "partial(func, ...) - new function with ..." keeps only the description.
        text = re.sub(r"^[\w.]+\(.*?\)\s+-\s+", "", " ".join(lines))
        text = (text[0].upper() + text[1:]).replace("``", "`")
        end = re.search(r"(?<!e\.g)(?<!i\.e)[.!?](?=\s|$)", text)
        sentence = text[: end.end()] if end else text + "."
        # Very short or long sentences are fragments or essays, not summaries.
        return sentence if 3 <= len(sentence.split()) <= 35 else None
    return None


def _signature(obj, name: str) -> str | None:
    try:
        sig = f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        # Builtins document their signature on the docstring's first line instead.
        first = (inspect.getdoc(obj) or "").splitlines()[:1]
        m = _SIGNATURE_LINE.match(first[0]) if first else None
        sig = f"{name.rsplit('.', 1)[0]}.{first[0].split('-')[0].strip()}" if m else None
    return sig if sig and len(sig) <= 70 and "[...]" not in sig else None


def _defined_in(obj, modname: str) -> bool:
    # Skip what a module merely imports (statistics re-exports math.sqrt, ...).
    owner = (getattr(obj, "__module__", None) or "").lstrip("_")
    if modname == "os.path":
        return owner in ("posixpath", "genericpath")
    return owner == modname or owner.startswith(modname + ".")


@functools.lru_cache(maxsize=None)
def stdlib_entries() -> tuple[StdlibEntry, ...]:
    """Public documented callables of STDLIB_MODULES, sorted so the list is reproducible."""
    entries = []
    for modname in STDLIB_MODULES:
        module = importlib.import_module(modname)
        for attr in sorted(dir(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or not callable(obj) or not _defined_in(obj, modname):
                continue
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue  # exception classes make poor questions
            summary = _summary(inspect.getdoc(obj))
            if summary:
                name = f"{modname}.{attr}"
                entries.append(StdlibEntry(name, summary, _signature(obj, name)))
    return tuple(entries)


STDLIB_ASKS = {
    "train": ["What does {name} do?", "Explain {name}.", "What is {name} used for?",
              "Describe {name} briefly.", "Tell me about {name}.", "What is the purpose of {name}?",
              "{name}: what does it do?", "Explain {name} in one sentence.", "What is {name}?"],
    "eval": ["Can you summarize what {name} does?", "In short, what is {name} for?",
             "Give me a one-line description of {name}."],
}
STDLIB_SIG_ASKS = {
    "train": ["What is the signature of {name}?", "What arguments does {name} take?",
              "How do I call {name}?", "Show the signature of {name}."],
    "eval": ["Which parameters does {name} accept?", "How is {name} invoked?"],
}


def stdlib_qa(rng: random.Random, split: str) -> list[dict]:
    entry = rng.choice(stdlib_entries())
    if entry.signature and rng.random() < 0.3:
        ask = _pick(rng, split, STDLIB_SIG_ASKS)
        answer = f"{entry.summary} Signature: {entry.signature}"
    else:
        ask = _pick(rng, split, STDLIB_ASKS)
        answer = entry.summary
        if entry.signature and rng.random() < 0.3:
            answer += f" Call it as {entry.signature}."
    return _system(rng, split) + [{"role": "user", "content": ask.format(name=entry.name)},
                                  {"role": "assistant", "content": answer}]


# ----------------------------------------------------------------------------- arith
ARITH_ASKS = {
    "train": {
        "+": ["What is {a} + {b}?", "What's {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.",
              "{a} + {b} = ?", "Calculate {a} plus {b}.", "What is the sum of {a} and {b}?",
              "{a}+{b}?"],
        "-": ["What is {a} - {b}?", "What's {a} minus {b}?", "Subtract {b} from {a}.",
              "Compute {a} - {b}.", "{a} - {b} = ?", "Calculate {a} minus {b}.", "{a}-{b}?"],
        "*": ["What is {a} * {b}?", "What's {a} times {b}?", "Multiply {a} by {b}.",
              "Compute {a} * {b}.", "{a} * {b} = ?", "What is the product of {a} and {b}?",
              "{a}*{b}?"],
    },
    "eval": {
        "+": ["Please work out {a} plus {b}.", "Quick one: {a} + {b}?"],
        "-": ["How much is {a} minus {b}?", "Take {b} away from {a}."],
        "*": ["Find {a} multiplied by {b}.", "How much is {a} times {b}?"],
    },
}
ARITH_ANSWERS = ["{a} {op} {b} = {c}.", "{a} {op} {b} = {c}.", "{a} {op} {b} = {c}.",
                 "{c}.", "The answer is {c}.", "{a} {op} {b} is {c}."]


def arith_pair(rng: random.Random, split: str) -> tuple[str, str]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 20)
    else:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if op == "-" and a < b and rng.random() < 0.7:
            a, b = b, a  # mostly non-negative differences
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    ask = rng.choice(ARITH_ASKS[split][op]).format(a=a, b=b)
    return ask, rng.choice(ARITH_ANSWERS).format(a=a, b=b, op=op, c=c)


def arith(rng: random.Random, split: str) -> list[dict]:
    ask, answer = arith_pair(rng, split)
    return _system(rng, split) + [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]


# ----------------------------------------------------------------------------- units
# unit -> (symbol, singular, plural)
UNIT_NAMES = {
    "km": ("km", "kilometer", "kilometers"), "m": ("m", "meter", "meters"),
    "cm": ("cm", "centimeter", "centimeters"), "kg": ("kg", "kilogram", "kilograms"),
    "g": ("g", "gram", "grams"), "h": ("h", "hour", "hours"), "min": ("min", "minute", "minutes"),
    "C": ("°C", "degree Celsius", "degrees Celsius"), "F": ("°F", "degree Fahrenheit", "degrees Fahrenheit"),
}
# (from, to, factor): multiplying by the factor converts; inputs are chosen to keep it exact.
LINEAR = [("km", "m", 1000), ("m", "cm", 100), ("km", "cm", 100000), ("kg", "g", 1000), ("h", "min", 60)]


def _unit_value(rng: random.Random, src: str, dst: str) -> tuple[Decimal, Decimal]:
    if (src, dst) == ("C", "F"):
        c = Decimal(5 * rng.randint(-8, 20))
        return c, c * 9 / 5 + 32
    if (src, dst) == ("F", "C"):
        f = Decimal(32 + 9 * rng.randint(-8, 23))
        return f, (f - 32) * 5 / 9
    for a, b, factor in LINEAR:
        if (a, b) == (src, dst):
            v = Decimal(rng.randint(1, 60)) / (2 if rng.random() < 0.25 else 1)
            return v, v * factor
        if (a, b) == (dst, src):
            step = 15 if src == "min" else rng.choice([1, 10, 50, 100])
            v = Decimal(step * rng.randint(1, 40))
            return v, v / factor
    raise ValueError((src, dst))


def _unit_text(value: Decimal, unit: str, long: bool) -> str:
    symbol, one, many = UNIT_NAMES[unit]
    if not long:
        return f"{_num(value)} {symbol}"
    return f"{_num(value)} {one if value == 1 else many}"


UNIT_ASKS = {
    "train": ["Convert {v} to {to}.", "What is {v} in {to}?", "How many {to} are in {v}?",
              "How much is {v} in {to}?", "{v} = ? {to}", "Convert {v} into {to}, please."],
    "eval": ["Express {v} in {to}.", "I have {v}. How many {to} is that?"],
}
UNIT_ANSWERS = ["{v} = {r}.", "{v} is {r}.", "That is {r}."]


def units_pair(rng: random.Random, split: str) -> tuple[str, str]:
    pairs = [(a, b) for a, b, _ in LINEAR] + [(b, a) for a, b, _ in LINEAR] + [("C", "F"), ("F", "C")]
    src, dst = rng.choice(pairs)
    v, r = _unit_value(rng, src, dst)
    long = rng.random() < 0.5
    to = UNIT_NAMES[dst][2] if long else UNIT_NAMES[dst][0]
    ask = rng.choice(UNIT_ASKS[split]).format(v=_unit_text(v, src, long), to=to)
    answer = rng.choice(UNIT_ANSWERS).format(v=_unit_text(v, src, long), r=_unit_text(r, dst, long))
    return ask, answer


def units(rng: random.Random, split: str) -> list[dict]:
    ask, answer = units_pair(rng, split)
    return _system(rng, split) + [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]


# ----------------------------------------------------------------------------- chat
# (prompts, replies): any prompt of a group may get any reply of the same group.
CHAT = {
    "train": [
        (["Hey!", "Hey there!", "Hi there!", "Hello there!", "Hiya!", "Greetings!", "Howdy!"],
         ["Hi! How can I help you today?", "Hello! What can I do for you?", "Hey! How can I help?"]),
        (["Good morning!", "Good morning."], ["Good morning! How can I help you today?"]),
        (["Good evening!", "Good evening."], ["Good evening! What can I do for you?"]),
        (["How's it going?", "How are you doing?", "How are things?"],
         ["Going well, thanks! How can I help?", "I'm doing well, thank you. What can I do for you?"]),
        (["Thanks!", "Thank you!", "Thanks a lot.", "Thank you very much."],
         ["You're welcome!", "Happy to help!", "Any time!"]),
        (["Bye!", "Goodbye!", "See you later.", "Good night!"], ["Goodbye! Have a nice day.", "Bye! Take care."]),
        (["Who are you?", "What are you?"],
         ["I'm a small assistant. I answer short questions and can call tools you give me."]),
        (["What can you do?", "How can you help me?"],
         ["I can answer short questions about Python, do small arithmetic, convert units, and call tools."]),
        (["Nice to meet you.", "Pleased to meet you!"], ["Nice to meet you too! How can I help?"]),
    ],
    "eval": [
        (["Yo!", "Morning!", "Hey, what's up?"], ["Hi! How can I help you today?"]),
        (["Cheers, thanks.", "Much appreciated!"], ["You're welcome!"]),
        (["Farewell!", "Catch you later."], ["Goodbye! Have a nice day."]),
    ],
}


def chat_pair(rng: random.Random, split: str) -> tuple[str, str]:
    prompts, replies = rng.choice(CHAT[split])
    return rng.choice(prompts), rng.choice(replies)


def chat(rng: random.Random, split: str) -> list[dict]:
    ask, reply = chat_pair(rng, split)
    msgs = _system(rng, split) + [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]
    if rng.random() < 0.3:  # a follow-up question teaches multi-turn context
        ask2, answer2 = rng.choice([arith_pair, units_pair])(rng, split)
        msgs += [{"role": "user", "content": ask2}, {"role": "assistant", "content": answer2}]
    return msgs


# ----------------------------------------------------------------------------- tools
@dataclass(frozen=True)
class ToolSpec:
    """A tool, how to ask for it, and a fake but deterministic implementation.

    ``sample`` draws the slots for one request: the tool's arguments plus any extra words
    the phrasings need. ``run`` returns the tool message content and the slots the final
    answer uses (at least ``result``, which must appear in that content).
    """

    name: str
    description: str
    properties: dict
    asks: tuple[str, ...]
    answers: tuple[str, ...]
    sample: Callable[[random.Random], dict]
    run: Callable[[dict, random.Random], tuple[str, dict]]

    def schema(self) -> dict:
        params = {"type": "object", "properties": self.properties, "required": list(self.properties)}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": params}}

    def arguments(self, slots: dict) -> dict:
        return {k: slots[k] for k in self.properties}


S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def enum(*values) -> dict:
    return {"type": "string", "enum": list(values)}


def _json(**kw) -> str:
    # Whole floats as ints, so the answer's "4" matches the tool's 4 rather than 4.0.
    kw = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in kw.items()}
    return json.dumps(kw, ensure_ascii=False)


TICKERS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "GOOG", "IBM", "ORCL", "INTC", "AMD", "SAP", "NFLX"]
RATES = {"USD": 1.0, "EUR": 0.9, "GBP": 0.8, "JPY": 150.0, "CHF": 0.88, "CAD": 1.35}
CAPITALS = {  # France is left out: "capital of France?" is a held-out test prompt
    "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Canada": "Ottawa",
    "Australia": "Canberra", "Brazil": "Brasília", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima",
    "Norway": "Oslo", "Poland": "Warsaw", "India": "New Delhi", "Mexico": "Mexico City",
    "Argentina": "Buenos Aires", "Greece": "Athens", "Portugal": "Lisbon", "Turkey": "Ankara",
    "Vietnam": "Hanoi", "Chile": "Santiago", "Ireland": "Dublin", "Sweden": "Stockholm",
    "Thailand": "Bangkok", "Morocco": "Rabat", "Austria": "Vienna", "Finland": "Helsinki",
}
CITIES = ["Tokyo", "Rome", "Oslo", "Lima", "Cairo", "Berlin", "Madrid", "Boston", "Denver", "Sydney",
          "Toronto", "Nairobi", "Dublin", "Seoul", "Chicago", "Lisbon", "Prague", "Austin"]
WORDS = ["apple", "river", "house", "music", "garden", "window", "bridge", "planet", "coffee", "banana",
         "yellow", "rocket", "puzzle", "summer", "letter", "mountain", "pepper", "balloon"]
PHRASES = ["the cat sat on the mat", "tiny models learn fast", "rain falls on green hills",
           "we ship code on friday", "a quick brown fox", "coffee keeps me awake at night",
           "read the docs first", "small steps add up"]
TRANSLATIONS = {  # word -> (French, Spanish, German, Italian)
    "cat": ("chat", "gato", "Katze", "gatto"), "dog": ("chien", "perro", "Hund", "cane"),
    "house": ("maison", "casa", "Haus", "casa"), "water": ("eau", "agua", "Wasser", "acqua"),
    "book": ("livre", "libro", "Buch", "libro"), "bread": ("pain", "pan", "Brot", "pane"),
    "sun": ("soleil", "sol", "Sonne", "sole"), "friend": ("ami", "amigo", "Freund", "amico"),
    "apple": ("pomme", "manzana", "Apfel", "mela"), "car": ("voiture", "coche", "Auto", "macchina"),
}
LANGUAGES = ["French", "Spanish", "German", "Italian"]
DEFINITIONS = {
    "brisk": "quick and energetic", "vivid": "bright and intense", "frugal": "careful with money",
    "candid": "honest and direct", "serene": "calm and peaceful", "sturdy": "strong and solid",
    "novice": "a beginner", "ample": "more than enough", "mellow": "soft and gentle",
}
RECIPES = {"tomato": "tomato soup", "rice": "fried rice", "egg": "an omelette", "lentil": "lentil stew",
           "potato": "potato salad", "chicken": "chicken curry", "pasta": "pasta pesto"}
MOVIES = ["Solar Drift", "The Last Harbor", "Paper Moons", "Quiet Engines", "Red Canyon", "Glass Garden"]
RESTAURANTS = ["Luigi's", "The Green Fork", "Sakura", "Blue Door Cafe", "Casa Nova"]
EMAILS = ["ana@example.com", "bo@example.org", "team@example.com", "kim@example.net", "li@example.com"]
SUBJECTS = ["Lunch on Friday", "Project update", "Invoice 42", "Meeting notes", "Trip plans"]


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _date(rng: random.Random) -> str:
    return (date(2024, 1, 1) + timedelta(days=rng.randint(0, 700))).isoformat()


def _text(value) -> str:
    return _num(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def plain(value, **extra) -> tuple[str, dict]:
    """A tool result that is just the value, e.g. ``Tokyo`` or ``42``."""
    return _text(value), {"result": _text(value), **extra}


def keyed(key: str, value, **fields) -> tuple[str, dict]:
    """A JSON tool result whose ``key`` holds the value the answer reports."""
    return _json(**fields, **{key: value}), {"result": _text(value)}


def _convert(s: dict, _rng) -> tuple[str, dict]:
    value = round(s["amount"] / RATES[s["from_currency"]] * RATES[s["to_currency"]], 2)
    return keyed("amount", value, currency=s["to_currency"])


def _currency_slots(rng: random.Random) -> dict:
    src, dst = rng.sample(sorted(RATES), 2)
    return {"amount": rng.choice([5, 10, 20, 50, 100, 250, 1000, 12.5]), "from_currency": src, "to_currency": dst}


def _prime_check(s: dict, _rng) -> tuple[str, dict]:
    n, prime = s["n"], _is_prime(s["n"])
    verdict = f"Yes, {n} is prime." if prime else f"No, {n} is not prime."
    return _json(n=n, prime=prime), {"result": str(n), "verdict": verdict}


def _flagged(rng: random.Random, p: float, **base) -> dict:
    # Boolean arguments need matching words in the request: "an urgent email", "vegetarian".
    flag = rng.random() < p
    return {k: v(flag) if callable(v) else v for k, v in base.items()}


def _letter_slots(rng: random.Random) -> dict:
    word = rng.choice(WORDS)
    return {"word": word, "letter": rng.choice(sorted(set(word)))}


def _letter_count(s: dict, _rng) -> tuple[str, dict]:
    c = s["word"].count(s["letter"])
    return plain(c, times="time" if c == 1 else "times")


def _date_slots(rng: random.Random) -> dict:
    a, b = sorted([_date(rng), _date(rng)])
    return {"start_date": a, "end_date": b}


def _days_between(s: dict, _rng) -> tuple[str, dict]:
    return keyed("days", (date.fromisoformat(s["end_date"]) - date.fromisoformat(s["start_date"])).days)


def _two_cities(rng: random.Random) -> dict:
    a, b = rng.sample(CITIES, 2)
    return {"origin": a, "destination": b, "unit": rng.choice(["km", "miles"])}


def _next_prime(n: int) -> int:
    return next(k for k in range(n + 1, 2 * n + 3) if _is_prime(k))


TIMEZONES = ["UTC", "Europe/Paris", "Asia/Tokyo", "America/New_York"]
WAREHOUSES = ["north", "south", "east", "west"]
AIRPORTS = {"Tokyo": "HND", "Rome": "FCO", "Oslo": "OSL", "Lima": "LIM"}
WEEKDAYS = ["Monday", "Tuesday", "Friday"]

TOOL_POOL = [
    ToolSpec("get_stock_price", "Get the latest stock price for a ticker.", {"ticker": S},
             ("What's the stock price of {ticker}?", "How much is {ticker} trading at?",
              "Get me the current price of {ticker} stock.", "Check the share price of {ticker}."),
             ("{ticker} is trading at {result} USD.", "The latest price of {ticker} is {result} USD."),
             lambda r: {"ticker": r.choice(TICKERS)},
             lambda s, r: keyed("price", round(r.uniform(5, 900), 2), ticker=s["ticker"])),
    ToolSpec("convert_currency", "Convert an amount between currencies.",
             {"amount": N, "from_currency": enum(*RATES), "to_currency": enum(*RATES)},
             ("Convert {amount} {from_currency} to {to_currency}.",
              "How much is {amount} {from_currency} in {to_currency}?",
              "I have {amount} {from_currency}. What is that in {to_currency}?"),
             ("{amount} {from_currency} is {result} {to_currency}.", "That comes to {result} {to_currency}."),
             _currency_slots, _convert),
    ToolSpec("get_capital_city", "Return the capital city of a country.", {"country": S},
             ("What is the capital of {country}?", "Which city is the capital of {country}?",
              "Look up the capital of {country}.", "{country}'s capital?"),
             ("The capital of {country} is {result}.", "{result} is the capital of {country}."),
             lambda r: {"country": r.choice(sorted(CAPITALS))},
             lambda s, r: plain(CAPITALS[s["country"]])),
    ToolSpec("roll_dice", "Roll a die with the given number of sides.", {"sides": {**I, "minimum": 2}},
             ("Roll a {sides}-sided die.", "Roll a d{sides} for me.", "Can you roll a die with {sides} sides?"),
             ("You rolled {result}.", "The die shows {result}."),
             lambda r: {"sides": r.choice([4, 6, 8, 10, 12, 20, 100])},
             lambda s, r: keyed("roll", r.randint(1, s["sides"]))),
    ToolSpec("get_temperature", "Current temperature in a city.",
             {"city": S, "unit": enum("celsius", "fahrenheit")},
             ("How warm is it in {city} right now, in {unit}?", "What's the temperature in {city} in {unit}?",
              "Temperature in {city}? Use {unit}."),
             ("It is {result} degrees {unit} in {city}.", "{city} is at {result} degrees {unit} right now."),
             lambda r: {"city": r.choice(CITIES), "unit": r.choice(["celsius", "fahrenheit"])},
             lambda s, r: keyed("temperature", r.randint(-5, 35) if s["unit"] == "celsius" else r.randint(25, 95),
                                city=s["city"])),
    ToolSpec("count_words", "Count the words in a text.", {"text": S},
             ('How many words are in "{text}"?', "Count the words in: {text}", 'Word count of "{text}"?'),
             ("That text has {result} words.", "It contains {result} words."),
             lambda r: {"text": r.choice(PHRASES)},
             lambda s, r: plain(len(s["text"].split()))),
    ToolSpec("reverse_text", "Reverse a string.", {"text": S},
             ("Reverse the word {text}.", 'What is "{text}" spelled backwards?', "Reverse this: {text}"),
             ('Reversed, it reads "{result}".', "{result}"),
             lambda r: {"text": r.choice(WORDS)},
             lambda s, r: plain(s["text"][::-1])),
    ToolSpec("is_prime", "Check whether an integer is prime.", {"n": I},
             ("Is {n} a prime number?", "Check if {n} is prime.", "Is {n} prime?"),
             ("{verdict}",),
             lambda r: {"n": r.randint(2, 200)},
             _prime_check),
    ToolSpec("factorial", "Compute n factorial.", {"n": {**I, "minimum": 0}},
             ("What is {n} factorial?", "Compute {n}!", "Calculate the factorial of {n}."),
             ("{n}! = {result}.", "The factorial of {n} is {result}."),
             lambda r: {"n": r.randint(0, 10)},
             lambda s, r: plain(math.factorial(s["n"]))),
    ToolSpec("send_email", "Send an email.", {"to": S, "subject": S, "urgent": B},
             ('Send {article} email to {to} with the subject "{subject}".', 'Email {to} about "{subject}"{flag}.'),
             ("Done: your email to {to} was {result}.", "The email to {to} has been {result}."),
             lambda r: _flagged(r, 0.4, to=r.choice(EMAILS), subject=r.choice(SUBJECTS), urgent=bool,
                                article=lambda u: "an urgent" if u else "an",
                                flag=lambda u: ", it's urgent" if u else ""),
             lambda s, r: keyed("status", "sent", to=s["to"])),
    ToolSpec("set_timer", "Start a countdown timer.", {"minutes": {**I, "minimum": 1}, "label": S},
             ("Set a {minutes} minute timer for {label}.", "Start a timer: {minutes} minutes, label it {label}."),
             ("Timer set: {result} minutes for {label}.", "Your {label} timer runs for {result} minutes."),
             lambda r: {"minutes": r.choice([1, 2, 3, 5, 10, 15, 20, 25, 30, 45, 60]),
                        "label": r.choice(["tea", "pasta", "eggs", "laundry", "pizza", "bread", "rice"])},
             lambda s, r: keyed("minutes", s["minutes"], timer_id=r.randint(1, 99))),
    ToolSpec("translate_word", "Translate one English word.", {"word": S, "language": enum(*LANGUAGES)},
             ('How do you say "{word}" in {language}?', "Translate {word} into {language}.",
              'What is the {language} word for "{word}"?'),
             ('"{word}" in {language} is "{result}".', 'In {language}, "{word}" is "{result}".'),
             lambda r: {"word": r.choice(sorted(TRANSLATIONS)), "language": r.choice(LANGUAGES)},
             lambda s, r: plain(TRANSLATIONS[s["word"]][LANGUAGES.index(s["language"])])),
    ToolSpec("calculate_tip", "Compute a tip for a bill.", {"bill": N, "percent": I},
             ("What's a {percent}% tip on a {bill} dollar bill?", "Calculate a {percent} percent tip on {bill}.",
              "How much should I tip on {bill} at {percent}%?"),
             ("A {percent}% tip on {bill} is {result}.", "The tip comes to {result}."),
             lambda r: {"bill": r.choice([12, 20, 35.5, 48, 60, 82.4, 100, 150]),
                        "percent": r.choice([10, 15, 18, 20, 25])},
             lambda s, r: keyed("tip", round(s["bill"] * s["percent"] / 100, 2))),
    ToolSpec("get_local_time", "Current time in a time zone.", {"timezone": enum(*TIMEZONES)},
             ("What time is it in {timezone}?", "Current time in {timezone}?", "Tell me the time in {timezone}."),
             ("It is {result} in {timezone}.", "The time in {timezone} is {result}."),
             lambda r: {"timezone": r.choice(TIMEZONES)},
             lambda s, r: plain(f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}")),
    ToolSpec("random_number", "Random integer between low and high.", {"low": I, "high": I},
             ("Pick a random number between {low} and {high}.", "Give me a random integer from {low} to {high}."),
             ("Your random number is {result}.", "I got {result}."),
             lambda r: (lambda lo: {"low": lo, "high": lo + r.randint(1, 100)})(r.randint(0, 50)),
             lambda s, r: plain(r.randint(s["low"], s["high"]))),
    ToolSpec("book_table", "Reserve a restaurant table.", {"restaurant": S, "people": I, "time": S},
             ("Book a table for {people} at {restaurant} at {time}.",
              "Reserve {restaurant} for {people} people at {time}."),
             ("Booked: a table for {people} at {restaurant} at {time}, reference {result}.",
              "Your table at {restaurant} is confirmed (reference {result})."),
             lambda r: {"restaurant": r.choice(RESTAURANTS), "people": r.randint(1, 8),
                        "time": r.choice(["18:00", "18:30", "19:00", "19:30", "20:00", "20:45"])},
             lambda s, r: keyed("booking_id", f"BK{r.randint(100, 999)}", confirmed=True)),
    ToolSpec("check_inventory", "Units of an item in stock.", {"item": S, "warehouse": enum(*WAREHOUSES)},
             ("How many {item} are in the {warehouse} warehouse?",
              "Check stock of {item} in the {warehouse} warehouse."),
             ("The {warehouse} warehouse has {result} {item}.", "There are {result} {item} in stock there."),
             lambda r: {"item": r.choice(["chairs", "lamps", "desks", "cables", "monitors", "boxes"]),
                        "warehouse": r.choice(WAREHOUSES)},
             lambda s, r: keyed("in_stock", r.randint(0, 80), item=s["item"])),
    ToolSpec("shorten_url", "Make a short link for a URL.", {"url": S},
             ("Shorten this link: {url}", "Make a short URL for {url}."),
             ("Here is your short link: {result}", "Short link: {result}"),
             lambda r: {"url": f"https://example.com/{r.choice(WORDS)}/{r.randint(1, 999)}"},
             lambda s, r: plain(f"https://sho.rt/{r.randint(1000, 9999)}")),
    ToolSpec("count_letter", "Count a letter in a word.", {"word": S, "letter": S},
             ('How many times does "{letter}" appear in "{word}"?', "Count the letter {letter} in {word}."),
             ('"{letter}" appears {result} {times} in "{word}".',),
             _letter_slots, _letter_count),
    ToolSpec("days_between", "Days between two dates (YYYY-MM-DD).", {"start_date": S, "end_date": S},
             ("How many days are there between {start_date} and {end_date}?",
              "Count the days from {start_date} to {end_date}."),
             ("There are {result} days between them.", "From {start_date} to {end_date} is {result} days."),
             _date_slots, _days_between),
    ToolSpec("flip_coin", "Flip a coin.", {},
             ("Flip a coin.", "Heads or tails? Flip a coin for me.", "Toss a coin please."),
             ("It landed on {result}.", "{result}!"),
             lambda r: {},
             lambda s, r: plain(r.choice(["heads", "tails"]))),
    ToolSpec("get_server_status", "Status of the production server.", {},
             ("Is the server up?", "Check the server status.", "What is the status of the server?"),
             ("The server is {result}.", "Server status: {result}."),
             lambda r: {},
             lambda s, r: keyed("status", r.choice(["online", "online", "degraded", "offline"]))),
    ToolSpec("define_word", "Short dictionary definition of a word.", {"word": S},
             ("What does {word} mean?", "Define {word}.", "Look up the meaning of {word}."),
             ("{word}: {result}.", '"{word}" means {result}.'),
             lambda r: {"word": r.choice(sorted(DEFINITIONS))},
             lambda s, r: plain(DEFINITIONS[s["word"]])),
    ToolSpec("square_root", "Square root of a number.", {"x": N},
             ("What is the square root of {x}?", "Compute sqrt({x}).", "Find the square root of {x}."),
             ("The square root of {x} is {result}.", "sqrt({x}) = {result}."),
             lambda r: {"x": r.randint(2, 500)},
             lambda s, r: plain(round(math.sqrt(s["x"]), 4))),
    ToolSpec("power", "Raise base to an integer exponent.", {"base": I, "exponent": I},
             ("What is {base} to the power of {exponent}?", "Compute {base}^{exponent}.",
              "Raise {base} to the {exponent}."),
             ("{base}^{exponent} = {result}.", "{base} to the power of {exponent} is {result}."),
             lambda r: {"base": r.randint(2, 12), "exponent": r.randint(0, 6)},
             lambda s, r: plain(s["base"] ** s["exponent"])),
    ToolSpec("create_note", "Save a note.", {"title": S, "body": S},
             ('Save a note titled "{title}" that says "{body}".', 'Make a note "{title}": {body}'),
             ('Saved your note "{title}" as note {result}.', "Note saved with id {result}."),
             lambda r: {"title": r.choice(["Groceries", "Ideas", "Todo", "Gift list"]), "body": r.choice(PHRASES)},
             lambda s, r: keyed("note_id", r.randint(1, 500), saved=True)),
    ToolSpec("find_recipe", "Suggest a recipe with an ingredient.", {"ingredient": S, "vegetarian": B},
             ("Find me a {diet}recipe with {ingredient}.", "What can I cook with {ingredient}?{diet_q}"),
             ("Try {result}.", "How about {result}?"),
             lambda r: _flagged(r, 0.4, ingredient=r.choice(sorted(RECIPES)), vegetarian=bool,
                                diet=lambda v: "vegetarian " if v else "",
                                diet_q=lambda v: " Vegetarian please." if v else ""),
             lambda s, r: keyed("recipe", RECIPES[s["ingredient"]])),
    ToolSpec("get_distance", "Travel distance between two cities.",
             {"origin": S, "destination": S, "unit": enum("km", "miles")},
             ("How far is it from {origin} to {destination} in {unit}?",
              "Distance from {origin} to {destination}, in {unit}?"),
             ("It is {result} {unit} from {origin} to {destination}.", "The distance is {result} {unit}."),
             _two_cities,
             lambda s, r: keyed("distance", r.randint(20, 9000), unit=s["unit"])),
    ToolSpec("get_movie_rating", "Average rating of a movie.", {"title": S},
             ("What is the rating of {title}?", "How well rated is the movie {title}?", "Rating for {title}?"),
             ("{title} is rated {result} out of 10.", "It has a rating of {result}/10."),
             lambda r: {"title": r.choice(MOVIES)},
             lambda s, r: keyed("rating", round(r.uniform(3, 9.5), 1), title=s["title"])),
    ToolSpec("set_light", "Turn a room's light on or off.", {"room": S, "on": B},
             ("Turn the {room} light {state}.", "Switch {state} the light in the {room}."),
             ("The {room} light is now {state}.", "Done, the {room} light is {state}."),
             lambda r: _flagged(r, 0.5, room=r.choice(["kitchen", "bedroom", "office", "hall", "garage"]),
                                on=bool, state=lambda on: "on" if on else "off"),
             lambda s, r: keyed("room", s["room"], on=s["on"])),
    ToolSpec("to_binary", "Binary representation of an integer.", {"n": {**I, "minimum": 0}},
             ("What is {n} in binary?", "Convert {n} to binary.", "Binary form of {n}?"),
             ("{n} in binary is {result}.", "{result}"),
             lambda r: {"n": r.randint(0, 300)},
             lambda s, r: plain(format(s["n"], "b"))),
]

EVAL_TOOL_POOL = [
    ToolSpec("get_population", "Population of a city.", {"city": S},
             ("Roughly how many people live in {city}?",), ("{city} has about {result} people.",),
             lambda r: {"city": r.choice(CITIES)},
             lambda s, r: keyed("population", r.randint(100, 9000) * 1000)),
    ToolSpec("count_vowels", "Count the vowels in a word.", {"word": S},
             ("How many vowels does {word} have?",), ("{word} has {result} vowels.",),
             lambda r: {"word": r.choice(WORDS)},
             lambda s, r: plain(sum(ch in "aeiou" for ch in s["word"]))),
    ToolSpec("lookup_airport_code", "IATA code of a city's main airport.", {"city": enum(*AIRPORTS)},
             ("What's the airport code for {city}?",), ("The main airport of {city} is {result}.",),
             lambda r: {"city": r.choice(sorted(AIRPORTS))},
             lambda s, r: plain(AIRPORTS[s["city"]])),
    ToolSpec("schedule_meeting", "Schedule a meeting.", {"person": S, "day": enum(*WEEKDAYS), "hour": I},
             ("Set up a meeting with {person} on {day} at {hour}:00.",),
             ("Your meeting with {person} is booked (id {result}).",),
             lambda r: {"person": r.choice(["Ana", "Bo", "Kim", "Li"]), "day": r.choice(WEEKDAYS),
                        "hour": r.randint(9, 17)},
             lambda s, r: keyed("meeting_id", r.randint(1, 99))),
    ToolSpec("next_prime", "Smallest prime greater than n.", {"n": I},
             ("Which prime comes right after {n}?",), ("The next prime after {n} is {result}.",),
             lambda r: {"n": r.randint(1, 150)},
             lambda s, r: plain(_next_prime(s["n"]))),
]


# Made-up function names for generic "call this tool" requests; the two splits use
# disjoint suffixes, so no evaluation name can occur in training.
GENERIC_NAMES = {
    "train": (["zorb", "blip", "quark", "flux", "frob", "glim", "trel", "vex", "cosmic", "secret", "hidden",
               "lucky", "mystic", "silly", "fuzzy", "shiny", "spooky", "tiny", "wild", "pixel", "nova"],
              ["_value", "_score", "_transform", "_function", "_fn", "_op", "_calc", "_number", "_index", ""]),
    "eval": (["arcane", "stellar", "primal", "glowing", "zorb", "secret"], ["_routine", "_mapping", "_procedure"]),
}
GENERIC_PARAMS = ["x", "n", "value", "input", "number", "a", "b", "k", "count", "num"]
GENERIC_DESCRIPTIONS = ["Apply the {name} operation to its input.", "Compute {name} of the arguments.",
                        "A custom function.", "Returns an integer.", "Evaluate {name}."]
GENERIC_ASKS = {
    "train": ["What is the value of {call}? Use the tool.", "Use the tool to compute {call}.",
              "What does {call} return?", "Use the tool. What is {call}?", "Please evaluate {call}.",
              "What is {call}?", "Call {name} with {argtext}.", "Run {name} on {argtext} and tell me the result.",
              "Compute {call} using {name}.", "What is the result of {call}? Use the {name} tool."],
    "eval": ["I need the output of {call}; please use the tool.", "Invoke {name} for {argtext}.",
             "Tell me {call}, via the tool."],
}
GENERIC_ANSWERS = ["{call} = {result}.", "The value of {call} is {result}.", "{name} returned {result}.",
                   "{call} is {result}."]


def generic_tool(rng: random.Random, split: str) -> tuple[dict, str, dict, str, str]:
    """A made-up integer function: (tool schema, user ask, arguments, tool content, answer)."""
    heads, tails = GENERIC_NAMES[split]
    name = rng.choice(heads) + rng.choice(tails)
    if split == "train" and rng.random() < 0.6:  # made-up syllables: too many names to memorize
        made = "".join(rng.choice(GENERIC_SYLLABLES) for _ in range(rng.randint(2, 3)))
        name = made + rng.choice(tails)
        if name in EVAL_NAMES:
            name = made + "_x"
    params = rng.sample(GENERIC_PARAMS, rng.choices([0, 1, 2], [0.15, 0.6, 0.25])[0])
    args = {p: rng.randint(-20, 120) if rng.random() < 0.8 else rng.randint(-999, 999) for p in params}
    props = {p: {"type": "integer"} for p in params}
    desc = rng.choice(GENERIC_DESCRIPTIONS).format(name=name)
    tool = {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": params}}}
    call = f"{name}({', '.join(str(v) for v in args.values())})"
    argtext = " and ".join(f"{k}={v}" if len(args) > 1 else str(v) for k, v in args.items())
    asks = [a for a in GENERIC_ASKS[split] if args or "{argtext}" not in a]
    ask = rng.choice(asks).format(call=call, name=name, argtext=argtext)
    # The hidden rule is arbitrary: the answer must come from the tool result, not arithmetic.
    result = sum(args.values()) * rng.randint(1, 3) + rng.randint(-9, 9) if args else rng.randint(0, 99)
    content = str(result) if rng.random() < 0.6 else _json(result=result)
    answer = rng.choice(GENERIC_ANSWERS).format(call=call, name=name, result=result)
    return tool, ask, args, content, answer


# Training tools get a fresh name per dialogue (same words, new verb, suffix or casing), so
# the only way to name the right tool is to copy it from the tool list: with fixed names a
# small model memorizes them instead and never learns to read the list.
RENAME_VERBS = ["get", "fetch", "lookup", "find", "query", "read", "check", "calc", "compute", "load", "show",
                "run", "do", "make", "tool"]
_VERBISH = {"get", "check", "calculate", "convert", "count", "find", "set", "send", "create", "define",
            "book", "shorten", "reverse", "roll", "flip", "translate", "is", "to"}
RENAME_SUFFIXES = ["", "", "", "_v2", "_tool", "_api", "_now", "_info", "_fn", "2"]
GENERIC_SYLLABLES = ["ka", "zo", "ri", "mu", "te", "lo", "vi", "na", "qu", "bex", "dor", "fin", "gal", "hop",
                     "jin", "kel", "mor", "pax", "rud", "sil", "tor", "wen", "yab", "zim", "ox", "ul"]
EVAL_NAMES = frozenset(t.name for t in EVAL_TOOL_POOL) | frozenset(
    h + t for h in GENERIC_NAMES["eval"][0] for t in GENERIC_NAMES["eval"][1])


def _fresh_name(name: str, rng: random.Random) -> str:
    if rng.random() < 0.25:
        return name
    words = name.split("_")
    core = words[1:] if words[0] in _VERBISH and len(words) > 1 else words
    if rng.random() < 0.6:
        core = [rng.choice(RENAME_VERBS)] + core
    new = "_".join(core) + rng.choice(RENAME_SUFFIXES)
    if rng.random() < 0.2:  # camelCase
        head, *rest = new.split("_")
        new = head + "".join(w[:1].upper() + w[1:] for w in rest)
    return name if new in EVAL_NAMES else new


def _renamed(schema: dict, rng: random.Random, split: str) -> dict:
    if split != "train":
        return schema
    fn = dict(schema["function"], name=_fresh_name(schema["function"]["name"], rng))
    return {**schema, "function": fn}


def _distractor_specs(rng: random.Random, pool: list[ToolSpec], exclude: str,
                      split: str = "eval") -> list[tuple[ToolSpec, dict]]:
    # Mostly one tool: each tool costs ~100 tokens of system prompt with the tiny tokenizer.
    k = rng.choices([0, 1, 2], [0.5, 0.32, 0.18])[0]
    others = [t for t in pool if t.name != exclude]
    return [(t, _renamed(t.schema(), rng, split)) for t in rng.sample(others, k)]


def _distractors(rng: random.Random, pool: list[ToolSpec], exclude: str, split: str = "eval") -> list[dict]:
    return [schema for _, schema in _distractor_specs(rng, pool, exclude, split)]


def _call_dialogue(tools: list[dict], ask: str, name: str, args: dict, content: str, answer: str,
                   call_id: str = "call_1") -> list[dict]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    return [{"role": "user", "content": ask},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": content},
            {"role": "assistant", "content": answer}]


def _spec_turn(spec: ToolSpec, schema: dict, rng: random.Random, tools: list[dict], call_id: str) -> list[dict]:
    slots = spec.sample(rng)
    content, extra = spec.run(slots, rng)
    ask = rng.choice(spec.asks).format(**slots)
    answer = rng.choice(spec.answers).format(**slots, **extra)
    return _call_dialogue(tools, ask, schema["function"]["name"], spec.arguments(slots), content, answer, call_id)


TOOL_LIST_ASKS = ["Which tools do you have?", "List your tools.", "What tools can you call?",
                  "Name the functions you can use."]


def _list_tools_turn(rng: random.Random, tools: list[dict]) -> list[dict]:
    names = [t["function"]["name"] for t in tools]
    text = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return [{"role": "user", "content": rng.choice(TOOL_LIST_ASKS)},
            {"role": "assistant", "content": rng.choice(["I can call {t}.", "{t}.", "My tools: {t}."]).format(t=text)}]


def _more_turns(rng: random.Random, listed: list[tuple[ToolSpec, dict]], tools: list[dict]) -> list[dict]:
    """Training only: further requests against the same tool list, each calling whichever
    listed tool it needs. The same list with different answers is what teaches a small model
    to read the request and the list instead of memorizing one call."""
    msgs = _list_tools_turn(rng, tools) if rng.random() < 0.25 else []
    for turn in range(rng.choices([0, 1, 2], [0.35, 0.4, 0.25])[0]):
        spec, schema = rng.choice(listed)
        msgs += _spec_turn(spec, schema, rng, tools, f"call_{turn + 2}")
    return msgs


def _no_tool_turn(rng: random.Random, split: str) -> list[dict]:
    ask, answer = rng.choice([arith_pair, units_pair, chat_pair, _stdlib_pair])(rng, split)
    return [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]


def made_up_dialogue(rng: random.Random, nonce: float = 0.0) -> tuple[list[dict], list[dict]]:
    """Training only: (tools, messages) over 1-4 never-seen tools (``synthetic_tools``): a
    request for one of them, then up to three more requests against the same list, each for
    whichever tool it needs, and now and then a question that needs none. ``nonce``: the share
    of tools about a made-up thing (``synthetic_tools.nonce_noun``)."""
    listed = synthetic_tools.tool_set(rng, rng.choices([1, 2, 3, 4], [0.2, 0.4, 0.3, 0.1])[0], nonce)
    tools = [t.schema() for t in listed]
    msgs: list[dict] = []
    for turn in range(1 + rng.choices([0, 1, 2, 3], [0.35, 0.35, 0.2, 0.1])[0]):
        if turn and rng.random() < 0.15:
            msgs += _no_tool_turn(rng, "train")
            continue
        tool = rng.choice(listed)
        req = synthetic_tools.unambiguous_request(tool, listed, rng)
        msgs += _call_dialogue(tools, req.ask, tool.name, req.arguments, req.content, req.answer,
                               f"call_{turn + 1}")
    return tools, msgs


@dataclass(frozen=True)
class Mix:
    """The shares of a generated set: of each kind, of each kind of tool dialogue, of the
    no-tool dialogues that list made-up tools instead of pool tools, and of made-up tools about
    a made-up thing."""
    kinds: dict
    tool_modes: dict
    made_up_none: float = 0.0
    nonce_nouns: float = 0.0
    json_keys_named: float = 0.0  # of JSON answers, the share whose request asks for JSON and names the keys
    json_off_topic: float = 0.0  # of JSON answers, the share whose request gives the schema nothing to fill


# Training mixes (``generate(mix=...)``). Both lean on tool use: its dialogues carry the skills a
# small model learns last. "v2" is what the shipped model was trained on (run 7). "made_up"
# (runs 10-12 in docs/demo_model.md) puts most tool dialogues on made-up tools, the part that
# cannot be recalled, only read (runs 3-9 learned the hand-written pool as concepts); it
# taught argument copying but not selection, so it is not the default.
_MADE_UP = Mix({"stdlib_qa": 0.16, "arith": 0.11, "units": 0.11, "tool": 0.52, "chat": 0.10},
               {"made_up": 0.45, "domain": 0.25, "generic": 0.15, "none": 0.15}, made_up_none=0.5)
TRAIN_MIXES = {
    "v2": Mix({"stdlib_qa": 0.18, "arith": 0.12, "units": 0.12, "tool": 0.48, "chat": 0.10},
              {"domain": 0.55, "generic": 0.25, "none": 0.20}),
    "made_up": _MADE_UP,
    "nonce": replace(_MADE_UP, nonce_nouns=0.5),  # half of the fresh made-up tools about a made-up thing
}
# "nonce" with 8% JSON answers (structured_answers.py), the other kinds scaled to make room.
TRAIN_MIXES["nonce_json"] = replace(TRAIN_MIXES["nonce"], kinds={
    **{k: round(w * 0.92, 4) for k, w in TRAIN_MIXES["nonce"].kinds.items()}, structured_answers.KIND: 0.08})
# "nonce_json" with half of the JSON answers asked for by name (JSON mode), and unit
# conversions back to about v2's count of examples (run 16 had a third fewer: 44% right, v2
# 66%), taken from the tool dialogues.
TRAIN_MIXES["nonce_json2"] = replace(TRAIN_MIXES["nonce_json"], json_keys_named=0.5, kinds={
    **TRAIN_MIXES["nonce_json"].kinds, "units": 0.14, "tool": 0.4396})
# "nonce_json2" with 10% JSON answers (from the small talk), 30% of them over requests that
# give the schema nothing to fill (run 18 ran on inside a string on 7 of 40 such answers).
TRAIN_MIXES["nonce_json3"] = replace(TRAIN_MIXES["nonce_json2"], json_off_topic=0.3, kinds={
    **TRAIN_MIXES["nonce_json2"].kinds, "chat": 0.072, structured_answers.KIND: 0.10})
DEFAULT_MIX = "v2"
TRAIN_KIND_WEIGHTS = TRAIN_MIXES[DEFAULT_MIX].kinds
EVAL_MIX = Mix(KIND_WEIGHTS, {"domain": 0.55, "generic": 0.25, "none": 0.20})


def tool_record(rng: random.Random, split: str, mix: Mix = EVAL_MIX) -> dict:
    pool = TOOL_POOL if split == "train" else EVAL_TOOL_POOL
    system = _system(rng, split, p=0.25)
    mode = rng.choices(list(mix.tool_modes), list(mix.tool_modes.values()))[0]
    if mode == "made_up":
        tools, msgs = made_up_dialogue(rng, mix.nonce_nouns)
    elif mode == "none":  # tools are offered but the question needs none of them
        if mix.made_up_none and rng.random() < mix.made_up_none:
            tools = [t.schema() for t in synthetic_tools.tool_set(rng, rng.randint(1, 3), mix.nonce_nouns)]
        else:
            tools = _distractors(rng, pool, "", split) or [_renamed(rng.choice(pool).schema(), rng, split)]
        msgs = _no_tool_turn(rng, split)
    elif mode == "generic":
        tool, ask, args, content, answer = generic_tool(rng, split)
        listed = _distractor_specs(rng, pool, "", split)
        tools = [schema for _, schema in listed] + [tool]
        msgs = _call_dialogue(tools, ask, tool["function"]["name"], args, content, answer)
        if split == "train" and listed:
            msgs += _more_turns(rng, listed, tools)
    else:
        spec = rng.choice(pool)
        slots = spec.sample(rng)
        content, extra = spec.run(slots, rng)
        schema = _renamed(spec.schema(), rng, split)
        listed = _distractor_specs(rng, pool, spec.name, split) + [(spec, schema)]
        tools = [s for _, s in listed]
        ask = rng.choice(spec.asks).format(**slots)
        answer = rng.choice(spec.answers).format(**slots, **extra)
        msgs = _call_dialogue(tools, ask, schema["function"]["name"], spec.arguments(slots), content, answer)
        if split == "train":
            msgs += _more_turns(rng, listed, tools)
    rng.shuffle(tools)  # the right tool can sit anywhere in the list
    return {"kind": "tool", "messages": system + msgs, "tools": tools}


def _stdlib_pair(rng: random.Random, split: str) -> tuple[str, str]:
    msgs = stdlib_qa(rng, split)
    return msgs[-2]["content"], msgs[-1]["content"]


# ----------------------------------------------------------------------------- assembly
_MAKERS = {"stdlib_qa": stdlib_qa, "arith": arith, "units": units, "chat": chat}


def _record(kind: str, rng: random.Random, split: str, mix: Mix) -> dict:
    # Redraw until clean: a few arithmetic phrasings can coincide with a held-out prompt.
    for _ in range(100):
        if kind == "tool":
            record = tool_record(rng, split, mix)
        elif kind == structured_answers.KIND:
            record = structured_answers.record(rng, split, mix.json_keys_named, mix.json_off_topic)
        else:
            record = {"kind": kind, "messages": _MAKERS[kind](rng, split), "tools": None}
        if not held_out_violations(record):
            return record
    raise RuntimeError(f"could not draw a clean {kind} record")


def _kind_plan(n: int, kinds, rng: random.Random, weights: dict = KIND_WEIGHTS) -> list[str]:
    """Exact quotas per kind (largest remainder), in a seeded random order."""
    chosen = list(kinds or weights)
    unknown = set(chosen) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}; expected some of {KINDS}")
    total = sum(weights[k] for k in chosen)
    shares = {k: n * weights[k] / total for k in chosen}
    counts = {k: int(v) for k, v in shares.items()}
    for k in sorted(chosen, key=lambda k: counts[k] - shares[k])[: n - sum(counts.values())]:
        counts[k] += 1
    plan = [k for k in chosen for _ in range(counts[k])]
    rng.shuffle(plan)
    return plan


def _build(n: int, seed: int, kinds, split: str, mix: Mix) -> list[dict]:
    rng = random.Random(seed)
    return [_record(kind, rng, split, mix) for kind in _kind_plan(n, kinds, rng, mix.kinds)]


def generate(n: int, seed: int = 0, kinds=None, mix: str = DEFAULT_MIX) -> list[dict]:
    """``n`` training records; the same (n, seed, kinds, mix) always gives the same list."""
    if mix not in TRAIN_MIXES:
        raise ValueError(f"unknown mix {mix!r}; expected one of {sorted(TRAIN_MIXES)}")
    records = _build(n, seed, kinds, "train", TRAIN_MIXES[mix])
    bad = [(i, v) for i, r in enumerate(records) for v in held_out_violations(r)]
    assert not bad, f"held-out material in training data: {bad[:5]}"
    return records


def held_out_examples(n: int, seed: int = 0) -> list[dict]:
    """``n`` evaluation records from phrasings and tool names that ``generate`` never uses."""
    return _build(n, seed, None, "eval", EVAL_MIX)


def held_out_structured(n: int, seed: int = 0) -> list[dict]:
    """``n`` evaluation JSON-answer records (phrasings and key spellings training never uses),
    each with the ``schema`` to hold the answer to and the ``scored`` keys."""
    return _build(n, seed, [structured_answers.KIND], "eval", replace(EVAL_MIX, kinds={structured_answers.KIND: 1.0}))


def held_out_test_cases() -> list[dict]:
    """The tests' own tool-call requests, with the call each expects (for evaluation only)."""
    def case(name, desc, props, prompt, args):
        tool = {"type": "function", "function": {"name": name, "description": desc, "parameters": {
            "type": "object", "properties": props, "required": list(props)}}}
        call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}
        return {"kind": "tool", "tools": [tool], "messages": [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": "", "tool_calls": [call]}]}

    two_ints = {"a": I, "b": I}
    return [
        case("magic_function", "Apply a magic function to an input.", {"input": I},
             "What is the value of magic_function(3)? Use the tool.", {"input": 3}),
        case("magic_function_no_args", "Calculate a magic function.", {},
             "What is the value of magic_function_no_args()? Use the tool.", {}),
        case("get_weather", "Get the weather at a location.", {"location": S},
             "What is the weather in San Francisco, CA?", {"location": "San Francisco, CA"}),
        case("my_adder_tool", "Tool that adds two integers.", two_ints, "What is 1 + 2", {"a": 1, "b": 2}),
        case("greeting_generator", "Generate a greeting in a particular style of speaking.",
             {"answer_style": S}, "Using the tool, generate a Pirate greeting.", {"answer_style": "Pirate"}),
        case("add", "Add two integers.", two_ints, "What is 2 + 3?", {"a": 2, "b": 3}),
        case("add", "Add two integers.", two_ints, "Use the add tool to add 2 and 3.", {"a": 2, "b": 3}),
        case("add", "Add two integers.", two_ints, "add 2 and 3", {"a": 2, "b": 3}),
        case("multiply", "Multiply two integers.", two_ints, "What is 2 * 3?", {"a": 2, "b": 3}),
    ]


def write_jsonl(records: Iterable[dict], path: str | Path) -> None:
    """Write beside ``path``, then rename: a run killed mid-write leaves no partial file that a
    resume would take as the whole data (the trainer reuses whatever ``data.jsonl`` it finds)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "w", encoding="utf-8") as fh:
            for r in records:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output .jsonl path")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=None, help=f"comma-separated subset of {','.join(KINDS)}")
    ap.add_argument("--mix", default=DEFAULT_MIX, choices=sorted(TRAIN_MIXES))
    ap.add_argument("--json-top-up", type=int, default=0, metavar="N",
                    help="add N JSON answers, half over requests with nothing for the schema (run 32)")
    ap.add_argument("--top-up-seed", type=int, default=None, help="their seed (default: --seed)")
    ap.add_argument("--held-out", action="store_true", help="write the evaluation set instead")
    args = ap.parse_args(argv)
    if args.held_out:
        records = held_out_examples(args.n, args.seed)
    else:
        records = generate(args.n, args.seed, args.kinds.split(",") if args.kinds else None, mix=args.mix)
        if args.json_top_up:
            seed = args.seed if args.top_up_seed is None else args.top_up_seed
            records = structured_answers.top_up(records, args.json_top_up, seed)
    write_jsonl(records, args.out)
    counts = Counter(r["kind"] for r in records)
    print(f"wrote {len(records)} records to {args.out}: {dict(sorted(counts.items()))}", file=sys.stderr)


if __name__ == "__main__":
    main()
