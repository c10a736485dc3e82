"""Made-up tools built from word lists, so that calling the right one is a skill, not recall.

Runs 3-9 of the demo model (docs/demo_model.md) trained on about 30 hand-written tools and
learned them as 30 concepts: it picked well among those and at chance among tools it had never
seen, and its arguments were values it remembered from small pools ("Lima" for every city)
rather than values copied from the request. Here every training dialogue gets tools that were
never seen before, composed from a few hundred nouns, attributes and actions, with argument
values drawn from pools too large to remember (made-up names, codes, numbers). Two things hold
by construction:

* the request shares its key words with the right tool's name and description and not all of
  them with any other listed tool (other tools often share one word: hard negatives), so the
  way to the right call is matching the request against the list;
* every argument value is spelled out in the request, so the way to the arguments is copying.

No word of the evaluation tools' names (``EVAL_CONCEPT_WORDS``) is used, so the held-out
tools stay unseen concepts. Everything is drawn from the caller's ``random.Random``.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Callable

# Words of the evaluation tools and of the tests' tools: never part of a made-up tool, so the
# held-out dialogues keep concepts training never saw (a test checks the lists below).
EVAL_CONCEPT_WORDS = frozenset({
    "population", "vowel", "vowels", "airport", "meeting", "meetings", "prime", "weather", "magic",
    "greeting", "adder", "customer", "customers", "joke", "picker", "capital", "population",
})

# (singular, plural)
NOUNS = [
    ("order", "orders"), ("invoice", "invoices"), ("parcel", "parcels"), ("ticket", "tickets"),
    ("flight", "flights"), ("hotel", "hotels"), ("booking", "bookings"), ("account", "accounts"),
    ("file", "files"), ("folder", "folders"), ("document", "documents"), ("photo", "photos"),
    ("album", "albums"), ("playlist", "playlists"), ("song", "songs"), ("podcast", "podcasts"),
    ("episode", "episodes"), ("product", "products"), ("coupon", "coupons"), ("cart", "carts"),
    ("payment", "payments"), ("subscription", "subscriptions"), ("device", "devices"),
    ("sensor", "sensors"), ("printer", "printers"), ("router", "routers"), ("task", "tasks"),
    ("project", "projects"), ("repository", "repositories"), ("branch", "branches"),
    ("container", "containers"), ("bucket", "buckets"), ("database", "databases"),
    ("report", "reports"), ("dashboard", "dashboards"), ("survey", "surveys"), ("course", "courses"),
    ("lesson", "lessons"), ("student", "students"), ("book", "books"), ("train", "trains"),
    ("bus", "buses"), ("route", "routes"), ("station", "stations"), ("bike", "bikes"),
    ("plant", "plants"), ("tree", "trees"), ("lake", "lakes"), ("trail", "trails"), ("park", "parks"),
    ("museum", "museums"), ("concert", "concerts"), ("festival", "festivals"), ("team", "teams"),
    ("player", "players"), ("match", "matches"), ("stadium", "stadiums"), ("horse", "horses"),
    ("pet", "pets"), ("patient", "patients"), ("prescription", "prescriptions"), ("workout", "workouts"),
    ("meal", "meals"), ("menu", "menus"), ("shop", "shops"), ("shipment", "shipments"),
    ("truck", "trucks"), ("driver", "drivers"), ("employee", "employees"), ("contract", "contracts"),
    ("apartment", "apartments"), ("room", "rooms"), ("building", "buildings"), ("door", "doors"),
    ("camera", "cameras"), ("alarm", "alarms"), ("thermostat", "thermostats"), ("lamp", "lamps"),
    ("battery", "batteries"), ("phone", "phones"), ("laptop", "laptops"), ("planet", "planets"),
    ("comet", "comets"), ("satellite", "satellites"), ("volcano", "volcanoes"), ("island", "islands"),
    ("poem", "poems"), ("novel", "novels"), ("painting", "paintings"), ("gallery", "galleries"),
    ("coin", "coins"), ("stamp", "stamps"), ("card", "cards"), ("wallet", "wallets"), ("budget", "budgets"),
    ("expense", "expenses"), ("loan", "loans"), ("fund", "funds"), ("permit", "permits"),
    ("license", "licenses"), ("passport", "passports"), ("badge", "badges"), ("vehicle", "vehicles"),
    ("garage", "garages"), ("recipe", "recipes"), ("bakery", "bakeries"), ("farm", "farms"),
    ("field", "fields"), ("boat", "boats"), ("harbor", "harbors"), ("bridge", "bridges"),
    ("tunnel", "tunnels"), ("server", "servers"), ("cluster", "clusters"), ("job", "jobs"),
    ("queue", "queues"), ("channel", "channels"), ("message", "messages"), ("invitation", "invitations"),
    ("event", "events"), ("venue", "venues"), ("seat", "seats"), ("locker", "lockers"),
    ("warehouse", "warehouses"), ("supplier", "suppliers"), ("vendor", "vendors"), ("claim", "claims"),
    ("policy", "policies"), ("vote", "votes"), ("poll", "polls"), ("petition", "petitions"),
    ("garden", "gardens"), ("greenhouse", "greenhouses"), ("robot", "robots"), ("drone", "drones"),
    ("rocket", "rockets"), ("telescope", "telescopes"), ("glacier", "glaciers"), ("canyon", "canyons"),
    ("forest", "forests"), ("beach", "beaches"), ("cabin", "cabins"), ("tent", "tents"),
]
ATTRIBUTES = [
    "status", "price", "size", "weight", "color", "owner", "rating", "length", "height", "width", "depth",
    "speed", "age", "capacity", "location", "address", "balance", "total", "score", "level", "version",
    "duration", "distance", "deadline", "priority", "category", "title", "summary", "tags", "members",
    "volume", "brightness", "humidity", "altitude", "elevation", "area", "cost", "fee", "discount",
    "progress", "uptime", "latency", "language", "author", "origin", "rank", "mileage", "temperature",
]
LOOKUP_VERBS = ["get", "fetch", "lookup", "find", "check", "read", "query", "show", "view", "retrieve", "load"]
# (verb, past participle)
ACTIONS = [
    ("cancel", "cancelled"), ("archive", "archived"), ("delete", "deleted"), ("create", "created"),
    ("rename", "renamed"), ("restart", "restarted"), ("pause", "paused"), ("resume", "resumed"),
    ("approve", "approved"), ("reject", "rejected"), ("refund", "refunded"), ("ship", "shipped"),
    ("track", "tracked"), ("share", "shared"), ("lock", "locked"), ("unlock", "unlocked"),
    ("reset", "reset"), ("update", "updated"), ("close", "closed"), ("open", "opened"),
    ("assign", "assigned"), ("renew", "renewed"), ("rate", "rated"), ("follow", "followed"),
    ("mute", "muted"), ("print", "printed"), ("export", "exported"), ("sync", "synced"),
    ("block", "blocked"), ("invite", "invited"), ("tag", "tagged"), ("register", "registered"),
    ("schedule", "scheduled"), ("reserve", "reserved"), ("clean", "cleaned"), ("water", "watered"),
    ("inspect", "inspected"), ("repair", "repaired"), ("publish", "published"), ("translate", "translated"),
]
# "schedule" is the verb of the held-out schedule_meeting; it stays out of made-up names too.
ACTIONS = [a for a in ACTIONS if a[0] not in {"schedule"}]

FIRST_NAMES = [
    "Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kai", "Lena", "Malik",
    "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Viktor", "Wei", "Ximena", "Yusuf",
    "Zoe", "Aiko", "Bruno", "Carmen", "Dario", "Esme", "Felix", "Gwen", "Hana", "Ivo", "Jade", "Kofi",
    "Luca", "Mira", "Nils", "Olga", "Pablo", "Rafa", "Sven", "Teo", "Vera", "Wanda", "Yara", "Zeno",
]
CITY_NAMES = [
    "Tokyo", "Rome", "Oslo", "Lima", "Cairo", "Berlin", "Madrid", "Boston", "Denver", "Sydney", "Toronto",
    "Nairobi", "Dublin", "Seoul", "Chicago", "Lisbon", "Prague", "Austin", "Vienna", "Quito", "Hanoi",
    "Dakar", "Accra", "Bogota", "Porto", "Zagreb", "Riga", "Tallinn", "Kyoto", "Osaka", "Perth", "Auckland",
    "Calgary", "Seattle", "Phoenix", "Miami", "Geneva", "Zurich", "Munich", "Hamburg", "Naples", "Turin",
    "Seville", "Valencia", "Krakow", "Gdansk", "Bergen", "Malmo", "Antwerp", "Utrecht", "Leeds", "Cardiff",
]
SYLLABLES = ["ka", "zo", "ri", "mu", "te", "lo", "vi", "na", "bex", "dor", "fin", "gal", "hop", "jin", "kel",
             "mor", "pax", "rud", "sil", "tor", "wen", "yab", "zim", "ox", "ul", "bra", "cle", "dru", "fa",
             "gri", "ha", "ish", "jo", "kru", "lim", "ne", "pe", "qua", "sto", "tri", "vo", "wu"]
COMMON_WORDS = [
    "apple", "river", "house", "music", "window", "bridge", "coffee", "banana", "yellow", "puzzle", "summer",
    "letter", "mountain", "pepper", "balloon", "candle", "silver", "orange", "marble", "thunder", "velvet",
    "copper", "meadow", "harbor", "lantern", "pillow", "rabbit", "saddle", "tiger", "violet", "walnut",
    "anchor", "basket", "cactus", "dolphin", "ember", "falcon", "ginger", "hazel", "iris", "jasmine",
    "kettle", "lemon", "mango", "nutmeg", "olive", "pebble", "quartz", "raven", "sparrow", "tulip",
]
ENUMS = {
    "priority": ["low", "medium", "high", "urgent"],
    "format": ["json", "csv", "pdf", "xml", "txt"],
    "size": ["small", "medium", "large"],
    "unit": ["metric", "imperial"],
    "sort": ["newest", "oldest", "popular", "cheapest"],
    "state": ["open", "closed", "pending", "draft"],
    "visibility": ["public", "private", "internal"],
    "mode": ["fast", "safe", "quiet", "eco"],
    "color": ["red", "green", "blue", "black", "white", "orange"],
    "language": ["English", "French", "Spanish", "German", "Italian", "Dutch"],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
}


# ----------------------------------------------------------------------------- values
def _made_up_name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _code(rng: random.Random) -> str:
    letters = "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(rng.randint(1, 3)))
    return f"{letters}-{rng.randint(10, 99999)}" if rng.random() < 0.7 else f"{letters}{rng.randint(100, 9999)}"


def _phrase(rng: random.Random) -> str:
    return " ".join(rng.sample(COMMON_WORDS + [n for n, _ in NOUNS], rng.randint(2, 4)))


def _iso_date(rng: random.Random) -> str:
    return (date(2023, 1, 1) + timedelta(days=rng.randint(0, 1500))).isoformat()


def _money(rng: random.Random) -> float | int:
    value = round(rng.uniform(1, 2000), rng.choice([0, 1, 2]))
    return int(value) if float(value).is_integer() else value


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class Slot:
    """One kind of argument: its JSON schema, how a value is drawn, and how a request says it.

    ``phrases`` spell the value out ({v}); ``{key}`` is the parameter's name, so some phrasings
    name the parameter ("with limit 5") and others only carry the value ("at most 5").
    """

    keys: tuple[str, ...]
    schema: dict
    draw: Callable[[random.Random], object]
    phrases: tuple[str, ...]


S, I, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}

# The slot that names the thing a tool acts on ("parcel XK-4821", "the album called Moruvi").
ID_SLOTS = [
    Slot(("{noun}_id", "id"), S, _code, ("{noun} {v}", "{noun} {v}", "the {noun} with id {v}", "{noun} #{v}")),
    Slot(("{noun}_id", "id", "number"), I, lambda r: r.randint(1, 99999), ("{noun} {v}", "{noun} number {v}",
                                                                           "the {noun} with id {v}")),
    Slot(("name", "{noun}_name", "title"), S, _made_up_name, ("the {noun} {v}", "the {noun} called {v}",
                                                              '{noun} "{v}"', "my {noun} {v}")),
]
# Further arguments, said after the thing.
EXTRA_SLOTS = [
    Slot(("person", "user", "owner", "contact", "assignee", "recipient"), S, lambda r: r.choice(FIRST_NAMES),
         ("for {v}", "with {v}", "to {v}", "{key} {v}")),
    Slot(("username", "handle"), S, lambda r: _made_up_name(r).lower() + str(r.randint(1, 99)),
         ("for user {v}", "{key} {v}", "as {v}")),
    Slot(("email",), S, lambda r: f"{_made_up_name(r).lower()}@example.{r.choice(['com', 'org', 'net'])}",
         ("to {v}", "email {v}", "cc {v}")),
    Slot(("city", "location", "place"), S, lambda r: r.choice(CITY_NAMES), ("in {v}", "at {v}", "{key} {v}", "near {v}")),
    Slot(("date", "start_date", "due_date"), S, _iso_date, ("on {v}", "for {v}", "{key} {v}", "by {v}")),
    Slot(("time",), S, lambda r: f"{r.randint(6, 22):02d}:{r.choice(['00', '15', '30', '45'])}", ("at {v}", "time {v}")),
    Slot(("hour",), I, lambda r: r.randint(0, 23), ("at {v} o'clock", "at hour {v}", "around {v}:00")),
    Slot(("limit", "max_results", "top"), I, lambda r: r.randint(1, 50), ("at most {v}", "limit {v}", "top {v}",
                                                                          "{key} {v}")),
    Slot(("count", "quantity", "copies"), I, lambda r: r.randint(1, 500), ("{v} times", "{key} {v}", "x{v}",
                                                                          "{v} of them")),
    Slot(("days", "minutes", "hours", "weeks"), I, lambda r: r.randint(1, 120), ("for {v} {key}", "{v} {key}")),
    Slot(("year",), I, lambda r: r.randint(1950, 2030), ("from {v}", "in {v}", "year {v}")),
    Slot(("offset", "delta", "adjustment"), I, lambda r: r.choice([-1, 1]) * r.randint(1, 999),
         ("{key} {v}", "by {v}", "with {key} {v}")),
    Slot(("amount", "price", "budget", "max_price"), N, _money, ("{key} {v}", "of {v}", "up to {v}", "for {v} dollars")),
    Slot(("percent", "ratio", "threshold"), N, lambda r: round(r.uniform(0, 100), r.choice([0, 1])),
         ("{key} {v}", "at {v} percent", "{v}%")),
    Slot(("latitude", "longitude", "x", "y"), N, lambda r: round(r.uniform(-90, 90), r.choice([1, 2, 3])),
         ("{key} {v}", "{key}={v}")),
    Slot(("text", "message", "note", "comment", "reason", "body"), S, _phrase,
         ('saying "{v}"', 'with the {key} "{v}"', '{key}: "{v}"', 'because "{v}"')),
    Slot(("query", "keyword", "search"), S, _phrase, ('for "{v}"', 'matching "{v}"', '{key} "{v}"', "about {v}")),
    Slot(("word", "tag", "label"), S, lambda r: r.choice(COMMON_WORDS), ("{key} {v}", 'labelled "{v}"', "with {v}")),
    Slot(("new_name", "alias"), S, _made_up_name, ("to {v}", "as {v}", "{key} {v}")),
] + [
    Slot((key,), {"type": "string", "enum": values}, (lambda vs: lambda r: r.choice(vs))(values),
         ("{v} {key}", "{key} {v}", "as {v}", "in {v}") if key not in ("day", "language", "color") else
         ("on {v}", "{key} {v}") if key == "day" else ("in {v}", "{key} {v}"))
    for key, values in ENUMS.items()
]
# A flag: said with words when true, left out (the default) or denied when false.
FLAGS = [("notify", "and notify them", "without notifying anyone"), ("urgent", "urgently", "no rush"),
         ("public", "and make it public", "keep it private"), ("force", "and force it", "without forcing"),
         ("dry_run", "as a dry run", "for real"), ("include_archived", "including archived ones", "skip archived ones"),
         ("recursive", "recursively", "not recursively"), ("overwrite", "and overwrite it", "do not overwrite")]


@dataclass(frozen=True)
class Param:
    """A tool parameter: a slot under one key, or a boolean flag."""

    key: str
    slot: Slot | None = None
    flag: tuple[str, str, str] | None = None  # (key, words when true, words when false)

    @property
    def schema(self) -> dict:
        return {"type": "boolean"} if self.flag else dict(self.slot.schema)

    @property
    def required(self) -> bool:
        return self.flag is None  # a flag defaults to false and may be left out

    def draw(self, rng: random.Random, noun: str) -> tuple[object, str, bool]:
        """(value, the request's words for it, whether the call passes it)."""
        if self.flag:
            value = rng.random() < 0.5
            said = self.flag[1] if value else (self.flag[2] if rng.random() < 0.5 else "")
            return value, said, bool(said)
        value = self.slot.draw(rng)
        phrase = rng.choice(self.slot.phrases).format(v=_text(value), key=self.key.replace("_", " "), noun=noun)
        return value, phrase, True


@dataclass(frozen=True)
class Request:
    ask: str
    arguments: dict
    content: str  # the tool's reply
    answer: str   # the assistant's report of it


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _fill(template: str, **kw) -> str:
    kw.update({k[:1].upper() + k[1:]: _cap(str(v)) for k, v in list(kw.items())})
    return template.format(**kw)


LOOKUP_ASKS = [
    "What is the {attr} of {ref}{tail}?", "What's the {attr} of {ref}{tail}?", "{Verb} the {attr} of {ref}{tail}.",
    "I need the {attr} of {ref}{tail}.", "Tell me the {attr} of {ref}{tail}.", "{Ref}{tail}: what is its {attr}?",
    "Can you {verb} the {attr} for {ref}{tail}?", "How about the {attr} of {ref}{tail}?", "{Attr} of {ref}{tail}?",
]
LOOKUP_DESCRIPTIONS = ["{Verb} the {attr} of {a_noun}.", "Return the {attr} of {a_noun}.",
                       "{Attr} of {a_noun}.", "Looks up {a_noun}'s {attr}."]
LOOKUP_ANSWERS = ["The {attr} of {ref} is {result}.", "{Ref} has a {attr} of {result}.", "{Attr}: {result}.",
                  "It is {result}."]
ACTION_ASKS = ["Please {verb} {ref}{tail}.", "{Verb} {ref}{tail}.", "Can you {verb} {ref}{tail}?",
               "I want to {verb} {ref}{tail}.", "{Verb} {ref}{tail}, please.", "Go ahead and {verb} {ref}{tail}."]
ACTION_DESCRIPTIONS = ["{Verb} {a_noun}.", "{Verb} an existing {noun}.", "Use this to {verb} {a_noun}.",
                       "{Verb} the given {noun}."]
ACTION_ANSWERS = ["Done: {ref} is {past} (reference {result}).", "{Ref} has been {past}. Reference: {result}.",
                  "OK, {ref} was {past}; the reference is {result}."]
SEARCH_ASKS = ["Search {plural}{tail}.", "Find {plural}{tail}.", "Look for {plural}{tail}.",
               "Which {plural} are there{tail}?", "List {plural}{tail}.", "Show me {plural}{tail}."]
SEARCH_DESCRIPTIONS = ["Search {plural}.", "Find {plural} that match the filters.", "List {plural}.",
                       "Search the {plural} catalog."]
SEARCH_ANSWERS = ["I found {result} {plural}.", "There are {result} matching {plural}.", "{result} {plural} match."]
_TEMPLATES = {  # kind -> (asks, answers)
    "lookup": (LOOKUP_ASKS, LOOKUP_ANSWERS), "action": (ACTION_ASKS, ACTION_ANSWERS),
    "search": (SEARCH_ASKS, SEARCH_ANSWERS),
}


def _result_value(attr: str, rng: random.Random):
    if attr in ("status", "progress"):
        return rng.choice(["active", "pending", "done", "delayed", "ok", "offline", "in transit", "paused"])
    if attr in ("owner", "author", "members"):
        return rng.choice(FIRST_NAMES)
    if attr in ("location", "address", "origin"):
        return rng.choice(CITY_NAMES)
    if attr in ("color", "language"):
        return rng.choice(ENUMS[attr])
    if attr in ("title", "summary", "tags", "category"):
        return _phrase(rng)
    if attr == "deadline":
        return _iso_date(rng)
    return rng.choice([rng.randint(0, 5000), round(rng.uniform(0, 500), 1), rng.randint(1, 10)])


@dataclass(frozen=True)
class MadeUpTool:
    """A made-up tool: ``kind`` "lookup" (get_parcel_status), "action" (cancel_order) or
    "search" (search_tickets). For lookups and actions the first parameter names the thing."""

    kind: str
    name: str
    description: str
    noun: str
    plural: str
    word: str  # the attribute (lookup), action verb (action) or search verb
    verb: str  # how a request says the lookup verb / the action's past participle
    params: tuple[Param, ...]

    @property
    def words(self) -> frozenset[str]:
        """The words a request for this tool is matched by (a search's verb varies in requests)."""
        return frozenset({self.plural} if self.kind == "search" else {self.noun, self.word})

    def matched_by(self, ask: str) -> bool:
        return self.words <= set(re.findall(r"[a-z]+", ask.lower()))

    def schema(self) -> dict:
        params = {"type": "object", "properties": {p.key: p.schema for p in self.params},
                  "required": [p.key for p in self.params if p.required]}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": params}}

    def request(self, rng: random.Random) -> Request:
        """A fresh request for this tool: new values, spelled out in the words of the ask."""
        drawn = [(p, *p.draw(rng, self.noun)) for p in self.params]
        has_ref = self.kind != "search"
        ref = drawn[0][2] if has_ref else ""
        rest = drawn[1:] if has_ref else list(drawn)
        if rng.random() < 0.3:
            rng.shuffle(rest)  # not always in the schema's order
        tail = "".join(" " + said for _, _, said, _ in rest if said)
        result = _code(rng) if self.kind == "action" else (
            rng.randint(0, 40) if self.kind == "search" else _result_value(self.word, rng))
        kw = dict(noun=self.noun, plural=self.plural, attr=self.word.replace("_", " "), verb=self.verb,
                  past=self.verb, ref=ref, tail=tail, result=_text(result))
        if self.kind == "action":
            kw["verb"] = self.word
        asks, answers = _TEMPLATES[self.kind]
        if self.kind == "lookup":
            content = json.dumps({self.word: result}) if rng.random() < 0.7 else _text(result)
        elif self.kind == "action":
            content = json.dumps({"ok": True, "reference": result}) if rng.random() < 0.7 else _text(result)
        else:
            content = json.dumps({"matches": result})
        arguments = {p.key: value for p, value, _, passed in drawn if passed}
        return Request(_fill(rng.choice(asks), **kw), arguments, content, _fill(rng.choice(answers), **kw))


def _join(words: list[str], rng: random.Random) -> str:
    if rng.random() < 0.15:  # camelCase
        return words[0] + "".join(w[:1].upper() + w[1:] for w in words[1:])
    return "_".join(words)


def _params(rng: random.Random, noun: str, n_extra: int, with_ref: bool) -> tuple[Param, ...]:
    params: list[Param] = []
    slots = ([rng.choice(ID_SLOTS)] if with_ref else []) + rng.sample(EXTRA_SLOTS, n_extra)
    for slot in slots:
        keys = [k.format(noun=noun) for k in slot.keys]
        keys = [k for k in keys if k not in {p.key for p in params}]
        if keys:
            params.append(Param(rng.choice(keys), slot=slot))
    if rng.random() < 0.15:
        flag = rng.choice(FLAGS)
        if flag[0] not in {p.key for p in params}:
            params.append(Param(flag[0], flag=flag))
    return tuple(params)


def lookup_tool(rng: random.Random, noun: str | None = None, attr: str | None = None) -> MadeUpTool:
    """``get_parcel_status(parcel_id)``: "What is the status of parcel XK-4821?"."""
    singular, plural = _noun(noun, rng)
    attr = attr or rng.choice(ATTRIBUTES)
    verb = rng.choice(LOOKUP_VERBS)
    words = ([verb] if rng.random() < 0.8 else []) + [singular, attr]
    say = "look up" if verb == "lookup" else verb
    description = _fill(rng.choice(LOOKUP_DESCRIPTIONS), verb=say, attr=attr, a_noun=_a(singular))
    params = _params(rng, singular, rng.choices([0, 1, 2], [0.5, 0.35, 0.15])[0], with_ref=True)
    return MadeUpTool("lookup", _join(words, rng), description, singular, plural, attr, say, params)


def action_tool(rng: random.Random, noun: str | None = None, action: tuple[str, str] | None = None) -> MadeUpTool:
    """``cancel_order(order_id, reason)``: "Please cancel order 5521 because "..."."""
    singular, plural = _noun(noun, rng)
    verb, past = action or rng.choice(ACTIONS)
    words = [verb, singular] if rng.random() < 0.85 else [singular, verb]
    description = _fill(rng.choice(ACTION_DESCRIPTIONS), verb=verb, noun=singular, a_noun=_a(singular))
    params = _params(rng, singular, rng.choices([0, 1, 2], [0.45, 0.4, 0.15])[0], with_ref=True)
    return MadeUpTool("action", _join(words, rng), description, singular, plural, verb, past, params)


def search_tool(rng: random.Random, noun: str | None = None) -> MadeUpTool:
    """``search_tickets(query, limit)``: "Find tickets matching "..." at most 5."."""
    singular, plural = _noun(noun, rng)
    verb = rng.choice(["search", "find", "list"])
    description = _fill(rng.choice(SEARCH_DESCRIPTIONS), plural=plural)
    params = _params(rng, singular, rng.choices([1, 2], [0.6, 0.4])[0], with_ref=False)
    return MadeUpTool("search", _join([verb, plural], rng), description, singular, plural, verb, verb, params)


_PLURAL = dict(NOUNS)


def _noun(noun: str | None, rng: random.Random) -> tuple[str, str]:
    if noun is None:
        return rng.choice(NOUNS)
    return noun, _PLURAL.get(noun) or _plural(noun)


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("s", "x")) else "s")


def nonce_noun(rng: random.Random) -> str:
    """A made-up thing ("kazori"): a word no tool, request or evaluation dialogue has used.

    The nouns above are few enough (about 150) that a model can learn each one's tools as
    associations of that word; a thing never seen before can only be matched, the request's
    word against the listed names, whatever the word (docs/demo_model.md, ``--mix nonce``)."""
    taken = _taken_words()
    while True:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
        if word not in taken and _plural(word) not in taken:
            return word


def random_tool(rng: random.Random, noun: str | None = None) -> MadeUpTool:
    return rng.choices([lookup_tool, action_tool, search_tool], [0.5, 0.35, 0.15])[0](rng, noun)


def _neighbour(tool: MadeUpTool, rng: random.Random) -> MadeUpTool:
    """A distractor sharing one word with ``tool``: the same thing with another attribute or
    action, or the same attribute or action of another thing."""
    if rng.random() < 0.6:
        return rng.choice([lookup_tool, action_tool, search_tool])(rng, tool.noun)
    if tool.kind == "lookup":
        return lookup_tool(rng, attr=tool.word)
    if tool.kind == "action":
        return action_tool(rng, action=(tool.word, tool.verb))
    return random_tool(rng)


def unambiguous_request(tool: MadeUpTool, listed: list[MadeUpTool], rng: random.Random) -> Request:
    """A request for ``tool`` that no other listed tool is matched by as well (a value such as
    "price 12" could otherwise carry another tool's attribute)."""
    while True:
        req = tool.request(rng)
        if not any(t.matched_by(req.ask) for t in listed if t is not tool):
            return req


def tool_set(rng: random.Random, k: int, nonce: float = 0.0) -> list[MadeUpTool]:
    """``k`` tools with distinct names, no two matched by the same words; about half of them
    share a word with another tool of the set. A share ``nonce`` of the tools not drawn as
    neighbours are about a made-up thing (``nonce_noun``) instead of a listed noun."""
    tools: list[MadeUpTool] = []
    while len(tools) < k:
        if tools and rng.random() < 0.5:
            cand = _neighbour(rng.choice(tools), rng)
        else:
            cand = random_tool(rng, nonce_noun(rng) if nonce and rng.random() < nonce else None)
        if any(cand.name == t.name or cand.words == t.words for t in tools):
            continue
        tools.append(cand)
    return tools


@functools.cache
def _taken_words() -> frozenset[str]:
    return frozenset(vocabulary() | EVAL_CONCEPT_WORDS)


def vocabulary() -> set[str]:
    """Every word a made-up tool's name or description can carry."""
    words = set(LOOKUP_VERBS) | set(ATTRIBUTES) | {a for a, _ in ACTIONS} | {"search", "find", "list"}
    return words | {w for pair in NOUNS for w in pair}
