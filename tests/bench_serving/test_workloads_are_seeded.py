"""Every workload is a pure function of its flags and seed, and has the shape its flags describe."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from benchmarks.serving.config import ConfigError, WorkloadConfig
from benchmarks.serving.text import TextMaker, load_tokenizer
from benchmarks.serving.workloads import build_items, describe, render_messages, render_prompt
from engine.tiny_model import ensure_tiny_model


@pytest.fixture(scope="module")
def tokens() -> TextMaker:
    return TextMaker(load_tokenizer(ensure_tiny_model()))


WORDS = TextMaker(None)


@pytest.mark.parametrize("workload", ["random", "shared-prefix", "multi-turn", "interference"])
def test_same_seed_same_items_other_seed_other_items(workload):
    cfg = WorkloadConfig(workload=workload, num_prompts=12, input_len=20, output_len=5, prefix_len=30,
                         suffix_len=6, length_dist="uniform", num_groups=3, num_turns=2, long_every=4)
    assert build_items(cfg, WORDS) == build_items(cfg, WORDS)
    assert build_items(cfg, WORDS) != build_items(dataclasses.replace(cfg, seed=1), WORDS)


def test_prompts_have_the_requested_token_lengths(tokens):
    items = build_items(WorkloadConfig(workload="random", num_prompts=20, input_len=100), tokens)
    assert all(abs(len(tokens.tokenizer.encode(it.turns[0].text)) - 100) <= 3 for it in items)
    assert len({it.turns[0].text for it in items}) == 20


@pytest.mark.parametrize("dist", ["uniform", "lognormal"])
def test_length_distributions_spread_around_the_length(dist):
    cfg = WorkloadConfig(workload="random", num_prompts=400, input_len=50, output_len=40, length_dist=dist,
                         length_spread=0.5)
    items = build_items(cfg, WORDS)
    ins = [it.turns[0].planned_len for it in items]
    outs = [it.turns[0].output_len for it in items]
    assert min(ins) >= 1 and len(set(ins)) > 10 and len(set(outs)) > 10
    if dist == "uniform":
        assert min(ins) >= 25 and max(ins) <= 75 and min(outs) >= 20 and max(outs) <= 60
    assert sorted(ins)[200] == pytest.approx(50, rel=0.2)  # centred on the length (the median for lognormal)


def test_shared_prefix_groups_share_their_system_prompt_with_zipf_popularity():
    cfg = WorkloadConfig(workload="shared-prefix", num_prompts=300, num_groups=5, prefix_len=40, suffix_len=8,
                         zipf_alpha=1.2)
    items = build_items(cfg, WORDS)
    prefixes = {}
    for it in items:
        assert prefixes.setdefault(it.group, it.system) == it.system
        assert render_prompt(it, 0, []).startswith(it.system + "\n")
        assert render_messages(it, 0, [])[0] == {"role": "system", "content": it.system}
    assert len(set(prefixes.values())) == 5
    assert len({it.turns[0].text for it in items}) == 300  # every question is distinct
    counts = Counter(it.group for it in items)
    assert [counts[g] for g in range(5)] == sorted(counts.values(), reverse=True)  # group 0 most popular
    assert counts[0] > 2 * counts[4]
    assert describe(cfg, items, WORDS)["group_counts"] == [counts[g] for g in range(5)]
    flat = build_items(dataclasses.replace(cfg, zipf_alpha=0.0), WORDS)
    assert max(Counter(it.group for it in flat).values()) < 2 * min(Counter(it.group for it in flat).values())


def test_multi_turn_resends_the_growing_history():
    cfg = WorkloadConfig(workload="multi-turn", num_prompts=2, num_turns=3, input_len=5)
    item = build_items(cfg, WORDS)[0]
    assert [t.tag for t in item.turns] == ["turn1", "turn2", "turn3"]
    msgs = render_messages(item, 2, ["answer one", "answer two"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"] == "answer one" and msgs[4]["content"] == item.turns[2].text
    prompt = render_prompt(item, 1, ["answer one"])
    assert prompt.startswith(f"User: {item.turns[0].text}\nAssistant: answer one\nUser: ")
    assert prompt.endswith("\nAssistant:")


def test_interference_sends_a_long_prompt_every_nth_item(tokens):
    cfg = WorkloadConfig(workload="interference", num_prompts=9, input_len=16, output_len=4, long_prompt_len=300,
                         long_output_len=2, long_every=3)
    items = build_items(cfg, tokens)
    assert [it.turns[0].tag for it in items] == ["short", "short", "long"] * 3
    for it in items:
        n = len(tokens.tokenizer.encode(it.turns[0].text))
        want = 300 if it.turns[0].tag == "long" else 16
        assert abs(n - want) <= 3
        assert it.turns[0].output_len == (2 if it.turns[0].tag == "long" else 4)


def test_jsonl_prompts_and_messages_are_read_in_order(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "one two three", "output_len": 7, "tag": "a"}, {},
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]},
             {"prompt": "not read: past --num-prompts"}]
    path.write_text("\n".join(json.dumps(x) if x else "" for x in lines) + "\n")
    items = build_items(WorkloadConfig(workload="jsonl", dataset_path=str(path), num_prompts=2, output_len=5),
                        WORDS)
    assert len(items) == 2
    assert items[0].turns[0].text == "one two three" and items[0].turns[0].output_len == 7
    assert items[0].turns[0].tag == "a" and items[0].turns[0].planned_len == 3
    assert items[1].turns[0].output_len == 5
    assert render_messages(items[1], 0, []) == lines[2]["messages"]
    assert render_prompt(items[1], 0, []) == "System: be brief\nUser: hi there\nAssistant:"


@pytest.mark.parametrize("content, message", [
    ("not json\n", "p.jsonl:1: not JSON"),
    ('{"prompt": ""}\n', "p.jsonl:1: needs a non-empty \"prompt\""),
    ('{"prompt": "x", "output_len": 0}\n', "output_len must be a positive integer"),
    ("\n\n", "no prompts"),
])
def test_bad_jsonl_names_the_line_and_the_fix(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        build_items(WorkloadConfig(workload="jsonl", dataset_path=str(path)), WORDS)


def test_missing_jsonl_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        build_items(WorkloadConfig(workload="jsonl", dataset_path=str(tmp_path / "none.jsonl")), WORDS)
    with pytest.raises(ConfigError, match="--dataset-path"):
        WorkloadConfig(workload="jsonl")
