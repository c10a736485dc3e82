"""JSON answers: what the demo model writes when the engine holds its answer to a schema.

Under ``response_format`` (and LangChain's ``with_structured_output``, LlamaIndex's
``structured_predict``) the engine's grammar forces the opening brace and the keys; the
model fills in the values. A model trained only on prose and tool calls has never seen that
context. v2 fills it with recalled text that happens to end; run 15, which copies well,
repeats itself inside a string or a number until the budget runs out (``{"name":
"get_get_get_...``, docs/demo_model.md). These dialogues show short values that fit their
key, copied from the request or computed from it, then closed.

Most requests never name the format, as the engine does not show the schema to the model
either. For those the trainer puts no loss on the answer's first token (``LOSS_FREE_FIRST_TOKEN``):
the model learns to continue a JSON answer, never to start one unasked. With ``keys_named``
(the "nonce_json2" mix) some requests ask for JSON and name its keys, as JSON mode is used
(``response_format={"type": "json_object"}``: the grammar holds the answer to JSON, the keys
are the model's to write); there the whole answer is learned.

With ``off_topic`` (the "nonce_json3" mix) some requests give the schema nothing to fill
("Show me one." held to a schema of a title and a year), as users of
``with_structured_output`` often send: the values are made up, short, and the answer closes.
Run 18 wrote on inside the first string of such answers until the budget ran out.

``record(rng, split, keys_named, off_topic)`` gives ``{"kind": "structured", "messages", "tools": None,
"schema", "scored", "asks_json"}``: the schema to hold the answer to, and the keys whose values are determined by
the request (the others, such as a made-up name for "a sailor", are not scored). The
evaluation split uses other phrasings and other key spellings.
"""

from __future__ import annotations

import json
import random

from synthetic_tools import CITY_NAMES, FIRST_NAMES

KIND = "structured"
LOSS_FREE_FIRST_TOKEN = True

# Not "pirate" or "cat": "Describe a pirate." and "Tell me a joke about cats." are test prompts.
ROLES = ["sailor", "baker", "teacher", "pilot", "farmer", "doctor", "painter", "knight", "wizard",
         "gardener", "chef", "miner", "poet", "ranger", "tailor", "guard"]
THINGS = ["lamp", "kettle", "bicycle", "notebook", "umbrella", "backpack", "guitar", "helmet", "candle",
          "teapot", "scarf", "compass", "ladder", "basket", "clock", "hammer", "mirror", "blanket"]
ANIMALS = ["dog", "owl", "fox", "horse", "goat", "frog", "whale", "bee", "crow", "duck", "mouse", "tiger"]

# key spellings per split: the grammar decides the keys, so the model must fit a value to any
KEYS = {
    "train": {"name": ["name", "full_name", "person"], "age": ["age", "years"],
              "city": ["city", "home", "location"], "item": ["name", "item", "product"],
              "price": ["price", "cost"], "answer": ["answer", "result", "value"],
              "word": ["word", "text"], "count": ["count", "letters", "length"],
              "setup": ["setup"], "punchline": ["punchline"], "role": ["role", "job"],
              "in_stock": ["in_stock", "available"], "animal": ["animal", "topic"]},
    "eval": {"name": ["name", "who"], "age": ["age", "age_years"], "city": ["city", "lives_in"],
             "item": ["product_name", "name"], "price": ["price", "price_usd"],
             "answer": ["answer", "total"], "word": ["word", "input"], "count": ["letter_count", "n"],
             "setup": ["setup", "question"], "punchline": ["punchline", "answer"],
             "role": ["occupation", "role"], "in_stock": ["in_stock"], "animal": ["subject", "animal"]},
}

ASKS = {
    "train": {
        "person": ["Describe {name}, aged {age}.", "{name} is {age} years old. Describe them.",
                   "Make a profile for {name}, age {age}, from {city}.", "Tell me about {name} ({age}) of {city}."],
        "role": ["Describe a {role}.", "Invent a {role} for a story.", "Make up a {role} character."],
        "item": ["A {item} costs {price} dollars. Describe it.", "Price tag: {item}, ${price}.",
                 "Record a {item} at {price} dollars, {stock}."],
        "arith": ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Work out {a} {op} {b}."],
        "word": ["How many letters are in the word {word}?", "Count the letters of {word}."],
        "joke": ["Tell me a joke about a {animal}.", "Make a joke about the {animal}."],
    },
    "eval": {
        "person": ["Who is {name}? They are {age} and live in {city}.", "Profile: {name}, {age}, {city}."],
        "role": ["Create a character who is a {role}.", "Sketch a {role}."],
        "item": ["List the {item}: {price} dollars, {stock}.", "Catalog entry for a {item} priced {price}."],
        "arith": ["Calculate {a} {op} {b}.", "{a} {op} {b} equals what?"],
        "word": ["Give the letter count of {word}.", "{word}: how long is it?"],
        "joke": ["Got a {animal} joke?", "Joke time: the {animal}."],
    },
}
# JSON-mode instructions: the request names the keys (never langchain-tests' own phrasing,
# "Return the result as a JSON with ... keys", which is held out).
FORMAT_ASKS = {
    "train": [" Reply in JSON with the keys {keys}.", " Answer as a JSON object: {keys}.",
              " Give JSON only, keys {keys}.", " Output JSON with {keys} fields."],
    "eval": [" Respond with JSON having keys {keys}.", " JSON please, with {keys}."],
}
JOKES = [("Why did the {x} cross the road?", "To see the other {x}."),
         ("What do you call a sleepy {x}?", "A {x} nap."),
         ("Why was the {x} late?", "It took the long way.")]


# Off-topic requests (training only). Not the evaluation's common prompts ("Give me an
# example.", "Who are you?", ...): those measure this skill on requests never seen.
VAGUE_ASKS = ["Show me one.", "Make something up.", "Surprise me.", "Fill this in.", "Give me a sample.",
              "Any will do.", "Write one.", "Go ahead.", "Something, please.", "An instance, please.",
              "Invent one.", "Just pick one.", "Do it.", "Continue.", "Fill in the form.", "Try again.",
              "Make one for me.", "Another one.", "Okay.", "Whatever you like."]
# key -> the kind of value it holds; none of the common schemas' own keys beyond those above
COLORS = ["red", "blue", "green", "black", "white", "orange", "gray", "yellow"]
FREE_KEYS = {"title": "thing", "label": "thing", "kind": "thing", "color": "color", "size": "size",
             "tag": "thing", "status": "status", "text": "phrase", "topic": "animal", "owner": "person",
             "author": "person", "place": "city", "town": "city", "job": "role", "pet": "animal",
             "year": "year", "count": "small", "level": "small", "id": "small", "amount": "small",
             "score": "number", "rating": "number", "weight": "number", "value": "number",
             "done": "bool", "active": "bool", "ok": "bool"}


def _free_value(rng: random.Random, kind: str):
    if kind == "person":
        return rng.choice(FIRST_NAMES)
    if kind == "city":
        return rng.choice(CITY_NAMES)
    if kind == "thing":
        return rng.choice(THINGS)
    if kind == "animal":
        return rng.choice(ANIMALS)
    if kind == "role":
        return rng.choice(ROLES)
    if kind == "color":
        return rng.choice(COLORS)
    if kind == "size":
        return rng.choice(["small", "medium", "large"])
    if kind == "status":
        return rng.choice(["open", "closed", "new", "done"])
    if kind == "phrase":
        return f"A {rng.choice(COLORS)} {rng.choice(THINGS)}."
    if kind == "year":
        return rng.randint(1900, 2030)
    if kind == "small":
        return rng.randint(0, 99)
    if kind == "number":
        return round(rng.uniform(0, 10), 1)
    return rng.random() < 0.5


def off_topic_record(rng: random.Random) -> dict:
    """A request that says nothing the schema asks for, and a short made-up answer (unscored)."""
    if rng.random() < 0.6:
        ask = rng.choice(VAGUE_ASKS)
    else:  # a request of another kind, answered in the schema's terms
        ask, _ = _fill(rng, "train", rng.choice(list(ASKS["train"])))
    keys = rng.sample(sorted(FREE_KEYS), rng.randint(1, 3))
    obj = {k: _free_value(rng, FREE_KEYS[k]) for k in keys}
    schema = {"type": "object", "properties": {k: _schema_type(v) for k, v in obj.items()}, "required": keys}
    messages = [{"role": "user", "content": ask},
                {"role": "assistant", "content": json.dumps(obj, ensure_ascii=False)}]
    return {"kind": KIND, "messages": messages, "tools": None, "schema": schema, "scored": [],
            "asks_json": False, "off_topic": True}


def _key(rng: random.Random, split: str, field: str) -> str:
    return rng.choice(KEYS[split][field])


def _price(rng: random.Random) -> float | int:
    return rng.choice([rng.randint(1, 99), round(rng.uniform(0.5, 99), 2)])


def _fill(rng: random.Random, split: str, template: str) -> tuple[str, list[tuple[str, object, bool]]]:
    """A request and its answer fields: (field, value, scored)."""
    name, age, city = rng.choice(FIRST_NAMES), rng.randint(3, 95), rng.choice(CITY_NAMES)
    if template == "person":
        ask = rng.choice(ASKS[split]["person"]).format(name=name, age=age, city=city)
        fields = [("name", name, True), ("age", age, True)]
        if city in ask:
            fields.append(("city", city, True))
        return ask, fields
    if template == "role":
        role = rng.choice(ROLES)
        ask = rng.choice(ASKS[split]["role"]).format(role=role)
        return ask, [("name", name, False), ("age", age, False), ("role", role, True)]
    if template == "item":
        item, price, stock = rng.choice(THINGS), _price(rng), rng.random() < 0.6
        ask = rng.choice(ASKS[split]["item"]).format(item=item, price=price,
                                                     stock="in stock" if stock else "sold out")
        fields = [("item", item, True), ("price", price, True)]
        if "stock" in ask or "sold out" in ask:
            fields.append(("in_stock", stock, True))
        return ask, fields
    if template == "arith":
        a, b, op = rng.randint(0, 99), rng.randint(0, 20), rng.choice("+-*")
        ask = rng.choice(ASKS[split]["arith"]).format(a=a, b=b, op=op)
        return ask, [("answer", {"+": a + b, "-": a - b, "*": a * b}[op], True)]
    if template == "word":
        word = rng.choice(THINGS + ANIMALS + ROLES)
        ask = rng.choice(ASKS[split]["word"]).format(word=word)
        return ask, [("word", word, True), ("count", len(word), True)]
    animal = rng.choice(ANIMALS)
    setup, punchline = rng.choice(JOKES)
    ask = rng.choice(ASKS[split]["joke"]).format(animal=animal)
    return ask, [("setup", setup.format(x=animal), False), ("punchline", punchline.format(x=animal), False)]


def _schema_type(value) -> dict:
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    return {"type": "string"}


def _key_list(rng: random.Random, keys: list[str]) -> str:
    quoted = [rng.choice(["'{}'", '"{}"', "{}"]).format(k) for k in keys]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def record(rng: random.Random, split: str, keys_named: float = 0.0, off_topic: float = 0.0) -> dict:
    if off_topic and split == "train" and rng.random() < off_topic:  # no draw at 0: older mixes stay as they were
        return off_topic_record(rng)
    template = rng.choice(list(ASKS[split]))
    ask, fields = _fill(rng, split, template)
    obj, scored, used = {}, [], set()
    for field, value, is_scored in fields:
        key = _key(rng, split, field)
        while key in used:  # two fields drew one spelling ("name" for the item and the person)
            key = _key(rng, split, field) + "_" + field
        used.add(key)
        obj[key] = value
        if is_scored:
            scored.append(key)
    props = {k: _schema_type(v) for k, v in obj.items()}
    if rng.random() < 0.3:  # an optional field the request says nothing about: null
        props["note" if split == "train" else "comment"] = {"anyOf": [{"type": "string"}, {"type": "null"}]}
        obj["note" if split == "train" else "comment"] = None
    schema = {"type": "object", "properties": props, "required": [k for k in props if obj[k] is not None]}
    asks_json = rng.random() < keys_named
    if asks_json:  # exactly the keys asked for
        obj = {k: v for k, v in obj.items() if v is not None}
        props = {k: props[k] for k in obj}
        schema = {"type": "object", "properties": props, "required": list(obj)}
        ask += rng.choice(FORMAT_ASKS[split]).format(keys=_key_list(rng, list(obj)))
    messages = [{"role": "user", "content": ask},
                {"role": "assistant", "content": json.dumps(obj, ensure_ascii=False)}]
    return {"kind": KIND, "messages": messages, "tools": None, "schema": schema, "scored": scored,
            "asks_json": asks_json}


def top_up(records: list[dict], n: int, seed: int) -> list[dict]:
    """``records`` with ``n`` more JSON answers, every other one off-topic, shuffled in.

    Run 32 (docs/demo_model.md) fine-tuned v3 on run 30's dialogues topped up so: its CPU
    fine-tunes (runs 30b, 31) had lost the common schemas, where the model writes on inside a
    string when the schema asks for what the request never gave (a city for a pencil).
    """
    rng = random.Random(seed)
    extra = [off_topic_record(rng) if i % 2 else record(rng, "train", keys_named=0.5) for i in range(n)]
    out = records + extra
    random.Random(seed + 1).shuffle(out)
    return out
