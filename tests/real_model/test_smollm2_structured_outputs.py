"""Structured output on the real model through the real ``openai`` client: 20 seeded JSON schemas answered
greedy and sampled always parse and validate; regex, EBNF and json_object outputs match; a constraint cut by
max_tokens ends with "length"; n > 1 gives each choice its own valid document; streamed text equals the
non-streamed answer; bad constraints are 400s naming the field, before any compute."""
from __future__ import annotations

import re
import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import ServerProcess
from tests.real_model.conftest import SERVED_NAME
from tests.pd.conftest import metric_sum
from tests.real_model.structured import SCHEMA_SEEDS, ask_all, assert_valid, client, schema_request
from tests.schemas import random_schema

CHAT = [{"role": "user", "content": "Give me a date and a short note."}]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_twenty_seeded_schemas_always_give_valid_documents(smollm2_server: ServerProcess, sampled: bool) -> None:
    answers = ask_all(smollm2_server.url, [schema_request(s, sampled) for s in SCHEMA_SEEDS])
    docs = [assert_valid(a, random_schema(s)) for a, s in zip(answers, SCHEMA_SEEDS)]
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > 10  # real, varied answers, not one template


def test_regex_ebnf_and_json_object_outputs_match(smollm2_server: ServerProcess) -> None:
    c = client(smollm2_server.url)
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]: [A-Za-z ,.]{1,40}"
    r = c.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=64, temperature=0,
                                  extra_body={"regex": pattern})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, r.choices[0].message.content), r
    ebnf = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,30}'
    r = c.chat.completions.create(model=SERVED_NAME, max_tokens=64, temperature=0, extra_body={"ebnf": ebnf},
                                  messages=[{"role": "user", "content": "Is the sky blue?"}])
    text = r.choices[0].message.content
    assert re.fullmatch(r"(yes|no) because [a-z ]{3,30}", text), text
    r = c.chat.completions.create(model=SERVED_NAME, max_tokens=128, temperature=0,
                                  response_format={"type": "json_object"},
                                  messages=[{"role": "user", "content": "Give the name and age of a person named "
                                                                        "Tom who is 5, as JSON."}])
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
    # completions take the same fields; /generate takes SGLang's in sampling_params
    r = c.completions.create(model=SERVED_NAME, prompt="The year was", max_tokens=16, temperature=0,
                             extra_body={"regex": r" [0-9]{4}\."})
    assert re.fullmatch(r" [0-9]{4}\.", r.choices[0].text), r.choices[0].text
    g = httpx.post(smollm2_server.url + "/generate", timeout=120, json={
        "text": "My favourite colour is", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                              "regex": " (red|green|blue)"}}).json()
    assert g["text"] in (" red", " green", " blue"), g


def test_max_tokens_mid_structure_ends_with_length(smollm2_server: ServerProcess) -> None:
    body = schema_request(SCHEMA_SEEDS[0], sampled=False)
    r = client(smollm2_server.url).chat.completions.create(**{**body, "max_tokens": 5})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_each_of_n_choices_follows_the_schema_on_its_own(smollm2_server: ServerProcess) -> None:
    seed = SCHEMA_SEEDS[1]
    r = client(smollm2_server.url).chat.completions.create(**{**schema_request(seed, sampled=True), "n": 3})
    docs = [jsonschema.validate(doc := json.loads(ch.message.content), random_schema(seed)) or doc
            for ch in r.choices]
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > 1


def test_logprobs_of_constrained_output_are_the_models_own(smollm2_server: ServerProcess) -> None:
    r = client(smollm2_server.url).chat.completions.create(**schema_request(SCHEMA_SEEDS[4], sampled=False),
                                                           logprobs=True, top_logprobs=2)
    assert_valid(r, random_schema(SCHEMA_SEEDS[4]))
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens  # one per token: requests with logprobs are never jumped
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in content)
    assert content[-1].token == "<|im_end|>"  # the grammar's end, where it allowed EOS
    assert "".join(lp.token for lp in content[:-1]) == r.choices[0].message.content


def test_streamed_structured_output_equals_the_whole_answer(smollm2_server: ServerProcess) -> None:
    body = schema_request(SCHEMA_SEEDS[2], sampled=False)
    c = client(smollm2_server.url)
    whole = c.chat.completions.create(**body).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**body, stream=True)
                       if ch.choices)
    assert streamed == whole


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}]}}}}}}, "response_format", "oneOf"),
    ({"extra_body": {"regex": "(unclosed"}}, "regex", "does not compile"),
    ({"extra_body": {"ebnf": "root ::= missing_rule"}}, "ebnf", "does not compile"),
    ({"extra_body": {"json_schema": "{not json"}}, "json_schema", "not valid JSON"),
    ({"extra_body": {"regex": "a", "json_schema": {"type": "string"}}}, "json_schema", "at most one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format", "name"),
])
def test_bad_constraints_are_refused_by_name(smollm2_server: ServerProcess, extra: dict, param: str,
                                             words: str) -> None:
    counters = ("splitserve_requests_total", "splitserve_prompt_tokens_total")
    before = [metric_sum(smollm2_server.url, c) for c in counters]
    with pytest.raises(openai.BadRequestError) as e:
        client(smollm2_server.url).chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=8, **extra)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
    assert [metric_sum(smollm2_server.url, c) for c in counters] == before  # refused before the engine saw it


def test_grammar_metrics_count_compiles_hits_and_jumps(smollm2_server: ServerProcess) -> None:
    body = schema_request(SCHEMA_SEEDS[3], sampled=False)
    ask_all(smollm2_server.url, [body, body])
    text = httpx.get(smollm2_server.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("splitserve_grammar") and " " in line}
    assert values['splitserve_grammar_requests_total{cache="hit",role="colocated"}'] >= 1
    assert values['splitserve_grammar_compile_seconds_count{role="colocated"}'] >= 1
    assert values['splitserve_grammar_jump_forward_tokens_total{role="colocated"}'] > 0
