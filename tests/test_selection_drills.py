"""scripts/selection_drills.py: drills that list 2-4 tools and put the loss on the called
tool's name; the request tells the right tool apart, and nothing held out is touched."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules[name]


dd = _load("demo_data")  # puts scripts/ on sys.path for the sibling modules
sd = _load("selection_drills")
st = _load("synthetic_tools")


@pytest.fixture(scope="module")
def drills():
    return sd.generate(2000, seed=0)


def _called(record) -> str:
    return record["messages"][1]["tool_calls"][0]["function"]["name"]


def test_same_seed_same_drills_and_different_seed_different():
    assert sd.generate(50, seed=1) == sd.generate(50, seed=1)
    assert sd.generate(50, seed=1) != sd.generate(50, seed=2)


def test_drills_call_one_of_two_to_four_listed_tools_and_touch_nothing_held_out(drills):
    for record in drills:
        names = [t["function"]["name"] for t in record["tools"]]
        assert 2 <= len(names) <= 4 and len(set(names)) == len(names)
        assert _called(record) in names
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
        assert not dd.held_out_violations(record)
        texts = [record["messages"][0]["content"]] + [
            f"{t['function']['name']} {t['function']['description']}" for t in record["tools"]]
        words = {w for text in texts for w in re.findall(r"[a-z]+", text.lower())}
        assert not words & st.EVAL_CONCEPT_WORDS, texts


def test_a_stdlib_request_names_its_tool_or_says_a_word_only_that_tool_has(drills):
    stdlib = {t.name: t for pair in sd.stdlib_tools() for t in pair}
    checked = Counter()
    for record in drills:
        name = _called(record)
        if name not in stdlib:
            continue
        ask = record["messages"][0]["content"]
        if name in ask:
            checked["named"] += 1
            continue
        others = set().union(*(sd.tool_key_words(t["function"]["name"], t["function"]["description"])
                               for t in record["tools"] if t["function"]["name"] != name))
        said = set(re.findall(r"[a-z]+", ask.lower()))
        assert said & (stdlib[name].key_words - others), (ask, record["tools"])
        checked["described"] += 1
    # Most requests describe the tool; some quote its name, as users do.
    assert checked["described"] > 2 * checked["named"] > 0


def test_drills_span_many_tool_concepts_and_mix_in_made_up_tools(drills):
    stdlib = {t.name for pair in sd.stdlib_tools() for t in pair}
    called = Counter(_called(r) for r in drills)
    descriptions = {t["function"]["description"] for r in drills for t in r["tools"] if t["function"]["name"] in stdlib}
    assert len(descriptions) >= 190  # about every usable stdlib callable, not a few memorizable ones
    made_up = sum(n for name, n in called.items() if name not in stdlib)
    assert 0.25 < made_up / len(drills) < 0.45
    assert max(called.values()) < 0.02 * len(drills)


def test_the_trainer_scores_only_the_called_name(tmp_path, drills):
    from transformers import AutoTokenizer

    from mlx_tandem.testing.factory import make_tiny_model

    trainer = _load("train_demo_model")
    tok = AutoTokenizer.from_pretrained(make_tiny_model("qwen3_5", tmp_path / "m", seed=0))
    for record in drills[:40]:
        ids, mask = trainer.encode_dialogue(tok, record)
        scored = [i for i, m in zip(ids, mask) if m]
        assert tok.decode(scored) == _called(record)
        # The same dialogue as an ordinary one is scored on the whole call, the name inside it.
        plain_ids, plain_mask = trainer.encode_dialogue(tok, {**record, "kind": "tool"})
        assert plain_ids == ids and sum(plain_mask) > sum(mask)
        assert all(p >= m for p, m in zip(plain_mask, mask))


def _head(name: str) -> str:
    return re.match(r"[a-z]+", name).group()


def test_prefixed_drills_start_every_name_with_a_word_the_request_does_not_say():
    drills = sd.generate(600, seed=4, prefixed=1.0)
    described = 0
    for record in drills:
        names = [t["function"]["name"] for t in record["tools"]]
        heads = [_head(n) for n in names]
        assert len(set(heads)) == len(heads), names  # the first word tells no two tools apart...
        assert not dd.held_out_violations(record)
        ask, called = record["messages"][0]["content"], _called(record)
        assert called in names
        if called in ask:  # a named request quotes the prefixed name
            continue
        said = set(re.findall(r"[a-z]+", ask.lower()))
        assert not said & set(heads), (ask, names)  # ...and the request says none of them
        described += 1
    assert described > 400
    # The prefixes are drawn fresh: no head is a fixed stand-in for a tool.
    assert len({_head(t["function"]["name"]) for r in drills for t in r["tools"]}) > 300


def test_a_prefixed_share_prefixes_about_that_share_and_keeps_the_rest_as_they_were():
    drills = sd.generate(800, seed=5, prefixed=0.5)
    stdlib = {t.name for pair in sd.stdlib_tools() for t in pair}
    plain_named = sum(_called(r) in stdlib for r in drills)
    # Half keep their names, and of those about 65% call a stdlib tool (unprefixed: its plain name).
    assert 0.25 < plain_named / len(drills) < 0.45


def test_every_tool_drills_ask_for_each_tool_in_turn_and_the_trainer_scores_each_name(tmp_path):
    from transformers import AutoTokenizer

    from mlx_tandem.testing.factory import make_tiny_model

    drills = sd.generate(300, seed=6, prefixed=1.0, every_tool=True)
    assert drills == sd.generate(300, seed=6, prefixed=1.0, every_tool=True)
    lengths = Counter()
    for record in drills:
        msgs, names = record["messages"], [t["function"]["name"] for t in record["tools"]]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
        called = [m["tool_calls"][0]["function"]["name"] for m in msgs[1::2]]
        assert len(set(called)) == len(called) and set(called) <= set(names)
        assert not dd.held_out_violations(record)
        heads = {_head(n) for n in names}
        for ask, name in zip([m["content"] for m in msgs[::2]], called):
            if name not in ask:
                assert not set(re.findall(r"[a-z]+", ask.lower())) & heads, (ask, names)
        lengths[len(called)] += 1
    assert lengths[1] and lengths[2] and lengths[3]  # most lists ask for more than one tool

    trainer = _load("train_demo_model")
    tok = AutoTokenizer.from_pretrained(make_tiny_model("qwen3_5", tmp_path / "m", seed=0))
    for record in drills[:30]:
        encoded = trainer.encode_dialogue(tok, record)
        assert encoded is not None
        ids, mask = encoded
        scored = tok.decode([i for i, m in zip(ids, mask) if m])
        assert scored == "".join(m["tool_calls"][0]["function"]["name"] for m in record["messages"][1::2])


def _name_words(name: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[A-Z]?[a-z]+", name)]


def test_a_lexical_request_says_a_word_only_its_tool_has_and_not_the_first_word_of_any_name():
    drills = sd.generate(1500, seed=7, lexical=1.0)
    assert drills == sd.generate(1500, seed=7, lexical=1.0)
    frame = {w for ask in sd.LEXICAL_ASKS for w in re.findall(r"[a-z]+", ask.lower())}
    keys, in_name_only, in_description_only = Counter(), 0, 0
    for record in drills:
        assert not dd.held_out_violations(record)
        tools = [t["function"] for t in record["tools"]]
        names = [t["name"] for t in tools]
        assert 2 <= len(names) <= 4 and len(set(names)) == len(names)
        called, ask = _called(record), record["messages"][0]["content"]
        said = set(re.findall(r"[a-z]+", ask.lower())) - frame
        in_name = [set(_name_words(t["name"])) & said for t in tools]
        in_description = [set(re.findall(r"[a-z]+", t["description"].lower())) & said for t in tools]
        holders = [t["name"] for t, a, b in zip(tools, in_name, in_description) if a or b]
        assert holders == [called], (ask, tools)  # the request's word is in its tool's entry only
        assert not {_name_words(n)[0] for n in names} & said, (ask, names)  # never a name's first word
        (key,) = set.union(*in_name, *in_description)
        keys[key] += 1
        words = set(re.findall(r"[a-z]+", " ".join([ask] + [f"{t['name']} {t['description']}" for t in tools]).lower()))
        assert not words & st.EVAL_CONCEPT_WORDS
        at = names.index(called)
        in_name_only += not in_description[at]
        in_description_only += not in_name[at]
    # Random words, real and made-up: no key word recurs often enough to be learned as a tool.
    assert len(keys) > 0.6 * len(drills) and max(keys.values()) < 10
    # The word is found in the name alone, in the description alone, or in both.
    assert 0.15 < in_name_only / len(drills) < 0.35 and 0.15 < in_description_only / len(drills) < 0.35


def test_every_tool_lexical_drills_ask_as_often_as_tools_are_listed_each_for_a_fresh_target():
    """With every_tool a lexical drill asks once per listed tool, each request saying only its
    own target's key word, and the targets are drawn afresh (repeats and all), so the last
    request cannot be answered by elimination. Off, the drills are those of before."""
    frame = {w for ask in sd.LEXICAL_ASKS for w in re.findall(r"[a-z]+", ask.lower())}
    drills = sd.generate(400, seed=10, lexical=1.0, every_tool=True)
    repeats = 0
    for record in drills:
        tools = [t["function"] for t in record["tools"]]
        users, calls = record["messages"][0::2], record["messages"][1::2]
        assert len(users) == len(calls) == len(tools)
        called = [c["tool_calls"][0]["function"]["name"] for c in calls]
        assert [c["tool_calls"][0]["id"] for c in calls] == [f"call_{i}" for i in range(1, len(calls) + 1)]
        for user, name in zip(users, called):
            said = set(re.findall(r"[a-z]+", user["content"].lower())) - frame
            holders = [t["name"] for t in tools
                       if said & (set(_name_words(t["name"])) | set(re.findall(r"[a-z]+", t["description"].lower())))]
            assert holders == [name], (user["content"], tools)
        repeats += len(set(called)) < len(called)
    assert repeats > 0.3 * len(drills)  # not each tool once in turn (about 0.7 are drawn so)
    singles = sd.generate(50, seed=10, lexical=1.0)
    assert all(len(r["messages"]) == 2 for r in singles)
    assert [r["tools"] for r in singles][:1] == [r["tools"] for r in drills][:1]  # the same first draws


def test_a_lexical_share_makes_about_that_share_of_the_drills_lexical():
    frames = [re.compile(re.escape(f).replace(r"\{w\}", ".+").replace(r"\{v\}", ".+").replace(r"\{V\}", ".+") + "$")
              for f in sd.LEXICAL_ASKS]

    def lexical(record):
        return any(f.match(record["messages"][0]["content"]) for f in frames)

    assert not any(map(lexical, sd.generate(400, seed=9)))  # the other drills never use these frames
    assert 0.4 < sum(map(lexical, sd.generate(400, seed=9, lexical=0.5))) / 400 < 0.6


def test_first_token_scoring_keeps_one_scored_token_per_called_name(tmp_path):
    """--selection-first-token: of each scored name, only its first token (the one that
    decides) stays scored; the ids are untouched."""
    from transformers import AutoTokenizer

    from mlx_tandem.testing.factory import make_tiny_model

    trainer = _load("train_demo_model")
    tok = AutoTokenizer.from_pretrained(make_tiny_model("qwen3_5", tmp_path / "m", seed=0))
    drills = sd.generate(20, seed=8, prefixed=1.0, every_tool=True) + sd.generate(20, seed=8, lexical=1.0)
    encoded = [trainer.encode_dialogue(tok, r) for r in drills]
    firsts = trainer.first_tokens_only(encoded)
    for record, (ids, mask), (ids1, mask1) in zip(drills, encoded, firsts):
        assert ids1 == ids and all(a <= b for a, b in zip(mask1, mask))
        names = [m["tool_calls"][0]["function"]["name"] for m in record["messages"][1::2]]
        heads = [tok.encode(n, add_special_tokens=False)[0] for n in names]
        assert [i for i, m in zip(ids1, mask1) if m] == heads
        assert sum(mask) > sum(mask1)  # the names were scored whole before
