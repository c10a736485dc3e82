"""scripts/demo_data.py: deterministic chat-model training data, held-out material kept out."""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jsonschema
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "demo_data.py"


def _load():
    spec = importlib.util.spec_from_file_location("demo_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_data"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


dd = _load()


@pytest.fixture(scope="module")
def big():
    return dd.generate(10_000, seed=0)


@pytest.fixture(scope="module")
def tokenizer(qwen3_5_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_5_path)


def texts(record, role=None):
    return [m.get("content") or "" for m in record["messages"] if role in (None, m["role"])]


def tool_calls(record):
    return [c for m in record["messages"] for c in m.get("tool_calls") or []]


# ----------------------------------------------------------------------------- determinism
def test_same_seed_same_records_and_different_seed_different():
    a = dd.generate(300, seed=0)
    assert a == dd.generate(300, seed=0)
    assert a != dd.generate(300, seed=1)
    assert dd.held_out_examples(100, seed=0) == dd.held_out_examples(100, seed=0)


def test_cli_writes_the_same_records_in_a_fresh_process(tmp_path):
    out = tmp_path / "data.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--n", "60", "--seed", "3"],
                   check=True, capture_output=True)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(ln) for ln in lines] == dd.generate(60, seed=3)


# ----------------------------------------------------------------------------- shape
def test_every_kind_in_its_share(big):
    counts = Counter(r["kind"] for r in big)
    assert set(counts) == set(dd.KIND_WEIGHTS)
    for kind, weight in dd.TRAIN_KIND_WEIGHTS.items():
        assert abs(counts[kind] - weight * len(big)) <= 1, (kind, counts)
    held = Counter(r["kind"] for r in dd.held_out_examples(1000, seed=0))
    for kind, weight in dd.KIND_WEIGHTS.items():  # the evaluation split keeps its own shares
        assert abs(held[kind] - weight * 1000) <= 1, (kind, held)
    tools = [r for r in big if r["kind"] == "tool"]
    no_call = sum(not tool_calls(r) for r in tools) / len(tools)
    assert 0.05 <= no_call <= 0.24
    assert Counter(r["kind"] for r in dd.generate(90, kinds=["arith", "chat"])) == {"arith": 49, "chat": 41}


def test_records_are_openai_style(big):
    for r in big[:2000]:
        assert set(r) == {"kind", "messages", "tools"}
        assert (r["tools"] is not None) == (r["kind"] == "tool")
        roles = [m["role"] for m in r["messages"]]
        assert roles[-1] == "assistant" and "system" not in roles[1:]
        assert all(isinstance(t, str) for t in texts(r))


def test_stdlib_answers_start_with_a_docstring_summary_and_are_short(big):
    summaries = tuple(e.summary for e in dd.stdlib_entries())
    assert len(summaries) > 150
    qa = [r for r in big if r["kind"] == "stdlib_qa"]
    for r in qa:
        answer = texts(r, "assistant")[-1]
        assert answer.startswith(summaries) and len(answer.split()) < 60, answer


def test_arith_and_units_answers_are_exact():
    for r in dd.generate(400, seed=5, kinds=["arith"]):
        q, a = texts(r, "user")[-1], texts(r, "assistant")[-1]
        nums = [int(x) for x in re.findall(r"-?\d+", q)]
        a_, b_ = nums[:2]
        assert any(str(v) in a for v in (a_ + b_, a_ - b_, b_ - a_, a_ * b_)), (q, a)
    for r in dd.generate(200, seed=5, kinds=["units"]):
        assert re.search(r"\d", texts(r, "assistant")[-1])


# ----------------------------------------------------------------------------- tools
def _leaves(content: str) -> list[str]:
    try:
        data = json.loads(content)
    except json.JSONDecodeError:
        return [content]
    if not isinstance(data, dict):
        return [content]
    return [v if isinstance(v, str) else json.dumps(v) for v in data.values()]


@functools.lru_cache(maxsize=None)
def _validator(schema_json: str) -> jsonschema.Draft202012Validator:
    # Building a validator checks the schema too; cached, as most schemas repeat.
    schema = json.loads(schema_json)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _turns(msgs: list[dict]) -> list[list[dict]]:
    """The conversation cut at each user message."""
    turns: list[list[dict]] = []
    for m in msgs:
        if m["role"] == "user":
            turns.append([])
        turns[-1].append(m)
    return turns


def test_tool_calls_name_a_given_tool_and_validate_against_its_schema(big):
    calls = follow_ups = 0
    for r in (x for x in big if x["kind"] == "tool"):
        tools = {t["function"]["name"]: t["function"] for t in r["tools"]}
        assert 1 <= len(r["tools"]) <= 3 and len(tools) == len(r["tools"])
        validators = {name: _validator(json.dumps(t["parameters"], sort_keys=True)) for name, t in tools.items()}
        msgs = [m for m in r["messages"] if m["role"] != "system"]
        ids = []
        for i, turn in enumerate(_turns(msgs)):
            follow_ups += i > 0
            if not turn[1].get("tool_calls"):
                assert [m["role"] for m in turn] == ["user", "assistant"]
                continue
            calls += 1
            assert [m["role"] for m in turn] == ["user", "assistant", "tool", "assistant"]
            (call,) = turn[1]["tool_calls"]
            assert turn[1]["content"] == "" and turn[2]["tool_call_id"] == call["id"]
            ids.append(call["id"])
            fn = call["function"]
            assert fn["name"] in tools and isinstance(fn["arguments"], dict)
            validators[fn["name"]].validate(fn["arguments"])
            answer = turn[3]["content"]
            assert any(leaf in answer for leaf in _leaves(turn[2]["content"])), (turn[2]["content"], answer)
        assert len(ids) == len(set(ids))  # every call of a conversation has its own id
    assert calls > 4000 and follow_ups > 2000


def test_training_tool_names_are_fresh_so_they_must_be_read_from_the_list(big):
    """A tool keeps its words but gets a new name per dialogue; a model cannot memorize them."""
    called = Counter(c["function"]["name"] for r in big if r["kind"] == "tool" for c in tool_calls(r))
    pool = {t.name for t in dd.TOOL_POOL}
    assert len(called) > 5 * len(pool)
    assert sum(n for name, n in called.items() if name in pool) < 0.4 * sum(called.values())
    assert not set(called) & dd.EVAL_NAMES


def _is_generic(r) -> bool:
    fn = tool_calls(r)[0]["function"]
    schema = next(t["function"] for t in r["tools"] if t["function"]["name"] == fn["name"])
    return schema["description"] in {d.format(name=fn["name"]) for d in dd.GENERIC_DESCRIPTIONS}


def test_generic_requests_name_the_function_and_its_arguments(big):
    generic = [r for r in big if tool_calls(r) and _is_generic(r)]
    assert len(generic) > 500
    for r in generic:
        fn = tool_calls(r)[0]["function"]
        ask = texts(r, "user")[0]
        assert fn["name"] in ask and all(str(v) in ask for v in fn["arguments"].values()), ask
    assert any("Use the tool." in texts(r, "user")[0] for r in generic)


# ----------------------------------------------------------------------------- made-up tools
st = sys.modules["synthetic_tools"]  # imported by demo_data from beside it


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def test_made_up_tools_share_no_concept_with_the_evaluation_tools():
    # The held-out tools must stay concepts training never saw: of their names' words only the
    # generic verbs every kind of tool uses may occur in a made-up tool.
    eval_words = {w for t in dd.EVAL_TOOL_POOL for w in t.name.split("_")}
    assert st.vocabulary() & eval_words <= {"get", "lookup", "count"}
    assert not st.vocabulary() & st.EVAL_CONCEPT_WORDS
    assert eval_words - {"get", "lookup", "count", "code", "next"} <= st.EVAL_CONCEPT_WORDS | {"schedule"}


@pytest.mark.parametrize("nonce", [0.0, 0.7])
def test_made_up_requests_spell_out_their_arguments_and_match_only_their_tool(nonce):
    rng = random.Random(7)
    kinds = Counter()
    for _ in range(1500):
        listed = st.tool_set(rng, rng.randint(1, 4), nonce)
        assert len({t.name for t in listed}) == len(listed)
        tool = rng.choice(listed)
        req = st.unambiguous_request(tool, listed, rng)
        kinds[tool.kind] += 1
        # Selection: the request carries all of the tool's words, and no other tool's all.
        assert tool.words <= _words(req.ask) and tool.words <= _words(tool.name + " " + tool.description)
        assert not [t.name for t in listed if t is not tool and t.words <= _words(req.ask)], req.ask
        # Arguments: every value is in the request (a flag only when the request says it),
        # and the call validates against the tool's schema.
        _validator(json.dumps(tool.schema()["function"]["parameters"], sort_keys=True)).validate(req.arguments)
        for key, value in req.arguments.items():
            if isinstance(value, bool):
                flag = next(f for f in st.FLAGS if f[0] == key)
                assert flag[1 if value else 2] in req.ask
            else:
                assert str(value) in req.ask, (key, value, req.ask)
        assert req.answer and any(leaf in req.answer for leaf in _leaves(req.content))
    assert min(kinds.values()) > 150


def test_the_made_up_mix_leans_on_made_up_tools_and_keeps_the_held_out_split():
    def made_up_share(records):  # of tool dialogues whose every tool is named in made-up words
        listed = [r for r in records if r["kind"] == "tool"]
        return sum(all(set(t["function"]["name"].lower().split("_")) <= st.vocabulary() for t in r["tools"])
                   for r in listed) / len(listed)

    records = dd.generate(600, seed=2, mix="made_up")
    assert Counter(r["kind"] for r in records)["tool"] == 312  # 52%
    assert made_up_share(records) > 0.3 and made_up_share(dd.generate(600, seed=2)) < 0.05
    assert max(len(r["tools"]) for r in records if r["tools"]) == 4
    assert not [v for r in records for v in dd.held_out_violations(r)]
    with pytest.raises(ValueError, match="unknown mix"):
        dd.generate(2, mix="nope")


def test_nonce_mix_puts_made_up_things_in_made_up_tools():
    rng, known = random.Random(4), st.vocabulary()
    # A share of the tools is about a new thing (and so are neighbours that share its noun),
    # hardly ever the same one twice.
    tools = [t for _ in range(400) for t in st.tool_set(rng, 3, nonce=0.6)]
    fresh = [t.noun for t in tools if t.noun not in known]
    assert 0.3 < len(fresh) / len(tools) < 0.7 and len(set(fresh)) > 300
    assert not set(fresh) & (known | st.EVAL_CONCEPT_WORDS)
    assert all(t.noun in known for _ in range(100) for t in st.tool_set(rng, 3))  # off by default

    def unknown_words(records):  # the words of made-up and pool tool names no word list holds
        names = [t["function"]["name"] for r in records if r["kind"] == "tool" for t in r["tools"]]
        return {w.lower() for n in names for w in re.split(r"_|(?=[A-Z])", n) if w} - known

    nonce, made_up = dd.generate(600, seed=2, mix="nonce"), dd.generate(600, seed=2, mix="made_up")
    assert len(unknown_words(nonce)) > len(unknown_words(made_up)) + 50
    assert not [v for r in nonce for v in dd.held_out_violations(r)]


def test_made_up_tools_are_too_many_to_memorize():
    rng = random.Random(3)
    calls = [c["function"]["name"] for _ in range(2000) for m in dd.made_up_dialogue(rng)[1]
             for c in m.get("tool_calls") or []]
    assert len(calls) > 3000
    assert len(set(calls)) > 0.6 * len(calls)  # most names are called once, none often
    assert Counter(calls).most_common(1)[0][1] < 10


# ----------------------------------------------------------------------------- rendering
def test_every_record_renders_and_most_are_short(big, tokenizer):
    sample = big[:1500] + dd.held_out_examples(200, seed=1)
    full, convo = [], []
    for r in sample:
        full.append(tokenizer.apply_chat_template(r["messages"], tools=r["tools"], tokenize=False))
        convo.append(tokenizer.apply_chat_template(r["messages"], tokenize=False))
    n_full = [len(x) for x in tokenizer(full, add_special_tokens=False)["input_ids"]]
    n_convo = [len(x) for x in tokenizer(convo, add_special_tokens=False)["input_ids"]]
    assert all("<tool_call>" in text for r, text in zip(sample, full) if tool_calls(r))

    def share_under(lengths, limit):
        return sum(n < limit for n in lengths) / len(lengths)

    # The template's fixed tool instructions cost ~130 tokens and each tool's JSON ~100, so
    # a record with tools cannot fit 256; the budgets below apply to the conversation itself.
    # Training tool dialogues carry up to two follow-up requests (the trainer drops the few
    # longer than its --max-len).
    plain = [n for r, n in zip(sample, n_full) if r["tools"] is None]
    with_tools = [n for r, n in zip(sample, n_full) if r["tools"] is not None]
    assert share_under(plain, 128) >= 0.95 and max(plain) < 256
    assert share_under(n_convo, 384) >= 0.95
    assert share_under(with_tools, 1024) >= 0.95


# ----------------------------------------------------------------------------- held out
def _langchain_tests_material():
    """Tool names and tool-calling prompts in the installed langchain-tests suite."""
    pytest.importorskip("langchain_tests")
    import langchain_tests

    src = (Path(langchain_tests.__file__).parent / "integration_tests" / "chat_models.py").read_text()
    names = set(re.findall(r"@tool(?:\([^)]*\))?\s*\n\s*def (\w+)", src))
    names |= set(re.findall(r"""\bname["']?\s*[=:]\s*["'](\w+)["']""", src))
    prompts = set(re.findall(r'query = "([^"]+)"', src))
    return names - {"example_user"}, prompts  # a message author's name, not a tool


def test_held_out_lists_cover_the_tests():
    names, prompts = _langchain_tests_material()
    assert names >= {"magic_function", "get_weather", "my_adder_tool"}
    assert names <= dd.HELD_OUT_TOOL_NAMES
    assert prompts and prompts <= dd.HELD_OUT_PROMPTS
    assert {"add", "multiply", "add_tool", "lookup_capital"} <= dd.HELD_OUT_TOOL_NAMES
    assert {"What is 2 + 3?", "What is 1 + 2", "Hello"} <= dd.HELD_OUT_PROMPTS


def test_violation_check_catches_held_out_material():
    clean = {"kind": "chat", "tools": None, "messages": [{"role": "user", "content": "Hello there!"}]}
    assert dd.held_out_violations(clean) == []
    for case in dd.held_out_test_cases():
        assert dd.held_out_violations(case)
    assert dd.held_out_violations({"messages": [{"role": "user", "content": "hello"}]})
    assert dd.held_out_violations({"messages": [{"role": "user", "content": "Q: What is 1 + 2? A:"}]})
    assert not dd.held_out_violations({"messages": [{"role": "user", "content": "What is 1 + 25?"}]})


def test_no_held_out_name_or_prompt_in_a_large_training_set(big):
    names = {n.casefold() for n in dd.HELD_OUT_TOOL_NAMES}
    long_prompts = re.compile("|".join(rf"(?<!\w){re.escape(p.casefold().rstrip(' .?!'))}(?!\w)"
                                       for p in dd.HELD_OUT_PROMPTS if len(p.split()) >= 4))
    exact = {p.casefold().strip(" .?!") for p in dd.HELD_OUT_PROMPTS}
    for r in big:
        used = {t["function"]["name"] for t in r["tools"] or []} | {c["function"]["name"] for c in tool_calls(r)}
        assert not {u.casefold() for u in used} & names, used
        for text in texts(r):
            folded = text.casefold()
            assert folded.strip(" .?!") not in exact, text
            assert not long_prompts.search(folded), text


def test_held_out_examples_are_disjoint_from_training(big):
    held = dd.held_out_examples(2000, seed=0)
    assert {r["kind"] for r in held} == set(dd.KIND_WEIGHTS)
    train_prompts = {t for r in big for t in texts(r, "user")}
    held_prompts = {t for r in held for t in texts(r, "user")}
    assert not train_prompts & held_prompts
    train_tools = {t["function"]["name"] for r in big for t in r["tools"] or []}
    held_tools = {t["function"]["name"] for r in held for t in r["tools"] or []}
    assert held_tools and not train_tools & held_tools


def test_json_answers_fit_their_schema_and_copy_the_request():
    """The JSON-answer dialogues of the "nonce_json" mix: the answer is one JSON object that
    its schema accepts, in the schema's key order; every scored value comes from the request
    (computed for sums and letter counts); training and evaluation share no phrasing."""
    train = dd.generate(2000, seed=6, mix="nonce_json")
    structured = [r for r in train if r["kind"] == "structured"]
    assert len(structured) == 160  # 8%
    assert Counter(r["kind"] for r in dd.generate(2000, seed=6, mix="nonce"))["tool"] == \
        pytest.approx(Counter(r["kind"] for r in train)["tool"] / 0.92, abs=2)
    held = dd.held_out_structured(300, seed=1)
    for r in structured + held:
        ask, answer = r["messages"][0]["content"], json.loads(r["messages"][1]["content"])
        jsonschema.validate(answer, r["schema"])
        assert list(answer) == list(r["schema"]["properties"])  # the grammar's key order
        expression = re.search(r"(\d+) ([-+*]) (\d+)", ask)
        for key in r["scored"]:
            value = answer[key]
            if isinstance(value, bool):
                assert ("sold out" in ask) != value, ask
            elif isinstance(value, int) and expression:
                a, op, b = expression.groups()
                assert value == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            elif isinstance(value, int) and str(value) not in ask:  # a letter count
                assert value == len(answer[r["scored"][0]]), (ask, answer)
            else:
                assert str(value) in ask, (key, value, ask)
    train_asks = {r["messages"][0]["content"] for r in structured}
    held_asks = {r["messages"][0]["content"] for r in held}
    assert not train_asks & held_asks
    train_keys = {k for r in structured for k in r["schema"]["properties"]}
    held_keys = {k for r in held for k in r["schema"]["properties"]}
    assert held_keys - train_keys  # some key spellings only the evaluation uses
    assert not [v for r in train for v in dd.held_out_violations(r)]
    assert "Describe a pirate." not in train_asks


def test_the_trainer_puts_no_loss_on_a_json_answers_first_token(tmp_path):
    """The engine's grammar opens a JSON answer; the model must not learn to open one unasked."""
    import importlib.util

    from mlx_tandem.testing.factory import make_tiny_model
    from transformers import AutoTokenizer

    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT.parent / "train_demo_model.py")
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    path = make_tiny_model("qwen3_5", tmp_path / "m", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    record = dd.held_out_structured(1, seed=0)[0]
    ids, mask = trainer.encode_dialogue(tok, record)
    plain_ids, plain_mask = trainer.encode_dialogue(tok, {**record, "kind": "chat"})
    assert ids == plain_ids
    first = plain_mask.index(1)
    assert mask[first] == 0 and mask[first + 1:] == plain_mask[first + 1:] and sum(mask) == sum(plain_mask) - 1


def test_json_mode_answers_name_their_keys_and_are_learned_whole(tmp_path):
    """The "nonce_json2" mix: about half of the JSON answers are asked for as JSON mode asks,
    naming exactly the answer's keys; the trainer learns those answers from the first token."""
    import importlib.util

    from mlx_tandem.testing.factory import make_tiny_model
    from transformers import AutoTokenizer

    sa = dd.structured_answers
    records = [r for r in dd.generate(3000, seed=8, mix="nonce_json2") if r["kind"] == "structured"]
    named = [r for r in records if r["asks_json"]]
    assert 0.4 < len(named) / len(records) < 0.6
    assert Counter(r["kind"] for r in dd.generate(3000, seed=8, mix="nonce_json2"))["units"] == 420  # 14%
    for r in named:
        ask, answer = r["messages"][0]["content"], json.loads(r["messages"][1]["content"])
        lead = next(f.split("{")[0].strip() for f in sa.FORMAT_ASKS["train"] if f.split("{")[0].strip() in ask)
        instruction = ask[ask.index(lead):]
        assert all(k in instruction for k in answer), ask
        assert None not in answer.values() and list(answer) == r["schema"]["required"]
    assert not any(r["asks_json"] for r in dd.generate(600, seed=8, mix="nonce_json") if r["kind"] == "structured")

    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT.parent / "train_demo_model.py")
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    tok = AutoTokenizer.from_pretrained(make_tiny_model("qwen3_5", tmp_path / "m", seed=0))
    ids, mask = trainer.encode_dialogue(tok, named[0])
    assert mask == trainer.encode_dialogue(tok, {**named[0], "kind": "chat"})[1]


def test_off_topic_json_answers_are_short_made_up_and_never_opened_unasked(tmp_path):
    """The "nonce_json3" mix: 10% JSON answers, about 30% of them over requests that give the
    schema nothing to fill (training only); their values are short and fit the schema, the
    first token carries no loss, and the evaluation's common prompts never appear."""
    import importlib.util

    from mlx_tandem.testing.factory import make_tiny_model
    from transformers import AutoTokenizer

    sys.path.insert(0, str(SCRIPT.parent))
    from eval_demo_model import COMMON_PROMPTS, COMMON_SCHEMAS

    train = dd.generate(3000, seed=9, mix="nonce_json3")
    structured = [r for r in train if r["kind"] == "structured"]
    off = [r for r in structured if r.get("off_topic")]
    assert len(structured) == 300 and 0.2 < len(off) / len(structured) < 0.4
    for r in off:
        answer = json.loads(r["messages"][1]["content"])
        jsonschema.validate(answer, r["schema"])
        assert list(answer) == r["schema"]["required"] and r["scored"] == [] and not r["asks_json"]
        assert all(len(str(v).split()) <= 3 for v in answer.values()), answer
    asks = {r["messages"][0]["content"] for r in structured}
    assert not asks & set(COMMON_PROMPTS)
    common_only = {k for s in COMMON_SCHEMAS.values() for k in s["properties"]} - set(
        k for keys in dd.structured_answers.KEYS["train"].values() for k in keys)
    assert common_only and not common_only & {k for r in structured for k in r["schema"]["properties"]}
    assert not [v for r in train for v in dd.held_out_violations(r)]
    assert not any(r.get("off_topic") for r in dd.held_out_structured(300, seed=1))
    assert not any(r.get("off_topic") for r in dd.generate(1000, seed=9, mix="nonce_json2"))

    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT.parent / "train_demo_model.py")
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    tok = AutoTokenizer.from_pretrained(make_tiny_model("qwen3_5", tmp_path / "m", seed=0))
    ids, mask = trainer.encode_dialogue(tok, off[0])
    plain = trainer.encode_dialogue(tok, {**off[0], "kind": "chat"})[1]
    first = plain.index(1)
    assert mask[first] == 0 and mask[first + 1:] == plain[first + 1:]


def test_json_top_up_adds_json_answers_half_off_topic_and_keeps_every_record(tmp_path):
    """``demo_data.py --json-top-up N`` (run 32): the mix's records, all of them, and N more
    JSON answers shuffled in, every other one off-topic; the same files from the same seeds."""
    out = tmp_path / "data.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--n", "200", "--seed", "7", "--mix", "nonce_json2",
           "--json-top-up", "60", "--top-up-seed", "32"]
    subprocess.run(cmd, check=True, capture_output=True)
    got = [json.loads(ln) for ln in out.read_text(encoding="utf-8").splitlines()]
    base = dd.generate(200, seed=7, mix="nonce_json2")
    key = functools.partial(json.dumps, sort_keys=True)
    extra = Counter(map(key, got)) - Counter(map(key, base))
    assert len(got) == 260 and sum(extra.values()) == 60  # every base record is still there
    extra = [json.loads(k) for k in extra.elements()]
    assert all(r["kind"] == "structured" for r in extra)
    assert sum(bool(r.get("off_topic")) for r in extra) == 30
    assert got[:200] != base  # shuffled in, not appended
    assert not [v for r in got for v in dd.held_out_violations(r)]
    again = tmp_path / "again.jsonl"
    subprocess.run([*cmd[:3], str(again), *cmd[4:]], check=True, capture_output=True)
    assert again.read_bytes() == out.read_bytes()
    subprocess.run([*cmd[:-1], "33"], check=True, capture_output=True)
    assert out.read_bytes() != again.read_bytes()


def test_eval_scores_named_selection_apart():
    """Among two or more tools, a request that quotes the tool's name is also scored on its
    own (selection by lookup); with one tool, or a request that describes the tool, it is not."""
    from types import SimpleNamespace

    sys.path.insert(0, str(SCRIPT.parent))
    from eval_demo_model import _score_call

    def want(name):
        return {"role": "assistant", "tool_calls": [{"function": {"name": name, "arguments": {"n": 1}}}]}

    def out(name):
        return SimpleNamespace(tool_calls=[SimpleNamespace(name=name, arguments={"n": 1})])

    score = {k: [] for k in ("tool_choice", "tool_args", "tool_choice_multi", "tool_choice_multi_chance",
                             "tool_choice_multi_named", "tool_choice_multi_named_chance")}
    _score_call(score, "", want("primal_mapping"), out("primal_mapping"), 2, "Invoke primal_mapping for n=1.")
    _score_call(score, "", want("primal_mapping"), out("next_prime"), 4, "Run primal_mapping on 1, please.")
    _score_call(score, "", want("next_prime"), out("count_vowels"), 2, "Which prime comes right after 1?")
    _score_call(score, "", want("next_prime"), out("next_prime"), 1, "Call next_prime for 1.")
    assert score["tool_choice"] == [True, False, False, True] and score["tool_args"] == [True, False, False, True]
    assert score["tool_choice_multi"] == [True, False, False]
    assert score["tool_choice_multi_named"] == [True, False]
    assert score["tool_choice_multi_named_chance"] == [0.5, 0.25]


def test_eval_selection_probe_draws_multi_tool_first_calls_and_splits_named_from_described():
    from types import SimpleNamespace

    sys.path.insert(0, str(SCRIPT.parent))
    from eval_demo_model import _score_pick, probe_turns

    held_out = probe_turns(60, "eval", "nonce_json2")
    assert probe_turns(60, "eval", "nonce_json2") == held_out  # a fixed draw, comparable across models
    training_like = probe_turns(60, "train", "nonce_json2")
    eval_names = {t.name for t in dd.EVAL_TOOL_POOL}
    listed = []
    for turns in (held_out, training_like):
        for r, k in turns:
            assert len(r["tools"]) > 1 and r["messages"][k]["tool_calls"]
            assert r["messages"][k - 1]["role"] == "user"
        listed.append({t["function"]["name"] for r, _ in turns for t in r["tools"]})
    assert listed[0] & eval_names and not listed[1] & eval_names  # held out: the evaluation's own tools
    assert not any(dd.held_out_violations(r) for r, _ in training_like)

    score: dict = {}
    right = SimpleNamespace(tool_calls=[SimpleNamespace(name="next_prime")])
    wrong = SimpleNamespace(tool_calls=[SimpleNamespace(name="count_vowels")])
    tools = [{"function": {"name": n}} for n in ("next_prime", "count_vowels", "get_population")]

    def record(ask):
        return {"tools": tools, "messages": [{"role": "user", "content": ask}, {
            "role": "assistant", "tool_calls": [{"function": {"name": "next_prime", "arguments": {}}}]}]}

    _score_pick(score, "held_out", record("Call next_prime on 4."), 1, right)
    _score_pick(score, "held_out", record("Which prime comes right after 4?"), 1, wrong)
    _score_pick(score, "held_out", record("Which prime comes right after 5?"), 1, right)
    _score_pick(score, "held_out", record("Which prime comes right after 6?"), 1, SimpleNamespace(tool_calls=[]))
    assert score == {"probe_held_out_named": [True], "probe_held_out_named_chance": [1 / 3],
                     "probe_held_out_described": [False, True, False],
                     "probe_held_out_described_chance": [1 / 3] * 3}


def test_eval_pairwise_puts_each_described_request_beside_every_other_tool_in_both_orders():
    """``eval_demo_model.py --pairwise``: a pick that ignores the request scores exactly half."""
    from types import SimpleNamespace

    sys.path.insert(0, str(SCRIPT.parent))
    from eval_demo_model import _score_pair, pairwise_turns

    pairs = pairwise_turns(seed=1)
    assert pairs == pairwise_turns(seed=1)
    eval_names = {t.name for t in dd.EVAL_TOOL_POOL}
    wanted = {want for _, want, _ in pairs}
    assert len(wanted) >= 3 and wanted <= eval_names
    for ask, want, tools in pairs:
        names = [t["function"]["name"] for t in tools]
        assert want in names and len(set(names)) == 2 and want not in ask
        assert (ask, want, tools[::-1]) in pairs  # the other order too
    per_want = Counter(want for _, want, _ in pairs)
    assert set(per_want.values()) <= {2 * (len(wanted) - 1) * k for k in (1, 2, 3)}

    def pick(name):
        return SimpleNamespace(tool_calls=[SimpleNamespace(name=name)] if name else [])

    # a model that always picks the alphabetically first tool of the pair, whatever is asked
    score, picks = {}, {}
    for _, want, tools in pairs:
        _score_pair(score, picks, want, tools, pick(min(t["function"]["name"] for t in tools)))
    assert sum(score["pairwise_right"]) * 2 == len(pairs)
    assert sum(score["pairwise_first"]) * 2 == len(pairs)
    first = min(wanted)
    assert all(picks[first]) and not any(picks[max(wanted)])
    score, picks = {}, {}
    for _, want, tools in pairs:  # one that follows the request, and one that never calls
        _score_pair(score, picks, want, tools, pick(want))
        _score_pair(score, picks, want, tools, pick(None))
    assert score["pairwise_right"] == [True, False] * len(pairs)
