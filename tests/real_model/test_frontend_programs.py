"""The frontend language (``frontend/``) on the real model, against a colocated server: the seed's multi-turn
program answers both questions and its second call hits the cache for the first turn; ``fork(4)`` over a long
context computes that context about once; ``select`` picks the choice the server scores highest; constrained
``gen`` matches; ``run_batch`` equals sequential runs; errors name the program line; no torch is imported."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import jsonschema
import pytest

from frontend import Endpoint, ServerError, UnsupportedError, function, gen, image, select
from tests.helpers import REPO, ServerProcess
from tests.pd.conftest import metric_sum


@function
def multi_turn_question(s, question_1: str, question_2: str) -> None:  # noqa: ANN001 - the seed's example
    with s.system():
        s += "You are a helpful assistant."
    with s.user():
        s += question_1
    with s.assistant():
        s += gen("answer_1", max_tokens=48)
    with s.user():
        s += question_2
    with s.assistant():
        s += gen("answer_2", max_tokens=48)


def test_the_seed_program_answers_and_reuses_its_first_turn(smollm2_server: ServerProcess) -> None:
    ep = Endpoint(smollm2_server.url)
    s = multi_turn_question.run(question_1="What is the capital of the United States?",
                                question_2="List two local attractions.", backend=ep)
    assert s["answer_1"] and s["answer_2"] and s["answer_1"] in s.text()
    first_turn = s.meta("answer_1")["prompt_tokens"] + s.meta("answer_1")["completion_tokens"]
    assert s.meta("answer_2")["cached_tokens"] >= first_turn - 16  # all of it but a partial page
    assert s.text().count("<|im_start|>assistant") == 2 and s.text().endswith("<|im_end|>\n")


def test_fork_computes_a_shared_context_once(smollm2_server: ServerProcess) -> None:
    ep = Endpoint(smollm2_server.url)
    httpx.post(smollm2_server.url + "/flush_cache")
    context = "Background: " + " ".join(f"Fact {i} is that lighthouses guide ships at night." for i in range(40))

    @function
    def branches(s, ctx: str) -> None:  # noqa: ANN001
        s += ctx + "\n"
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f"Question {i}: what do lighthouses do? Answer:"
            f += gen("a", max_tokens=8)
        s += "Answers: " + " | ".join(f["a"] for f in forks)

    before = metric_sum(smollm2_server.url, "splitserve_prompt_tokens_total") - metric_sum(
        smollm2_server.url, "splitserve_cached_prompt_tokens_total")
    s = branches.run(ctx=context, backend=ep)
    computed = metric_sum(smollm2_server.url, "splitserve_prompt_tokens_total") - metric_sum(
        smollm2_server.url, "splitserve_cached_prompt_tokens_total") - before
    ctx_tokens = len(ep.tokenize(context + "\n"))
    assert ctx_tokens > 300 and "Answers:" in s.text()
    assert computed < 2 * ctx_tokens, (computed, ctx_tokens)  # four branches, one context (not four)


def test_select_picks_the_choice_the_server_scores_highest(smollm2_server: ServerProcess) -> None:
    ep = Endpoint(smollm2_server.url)
    choices = ["Paris", "London", "a small village in Peru"]

    @function
    def capital(s) -> None:  # noqa: ANN001
        s += "The capital of France is"
        s += " " + select("city", choices=choices)

    s = capital.run(backend=ep)
    prefix = ep.tokenize("The capital of France is ")
    totals = {}
    for c in choices:  # each choice scored on its own, by the server's prompt logprobs
        out = httpx.post(smollm2_server.url + "/v1/completions", timeout=60, json={
            "prompt": prefix + ep.tokenize(c), "max_tokens": 0, "echo": True, "logprobs": 0}).json()
        totals[c] = sum(out["choices"][0]["logprobs"]["token_logprobs"][len(prefix):])
    assert s["city"] == max(totals, key=totals.get)
    assert s.meta("city")["scores"] == pytest.approx(totals, abs=1e-3)


def test_constrained_gen_matches_its_regex_and_schema(smollm2_server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}

    @function
    def person(s) -> None:  # noqa: ANN001
        with s.user():
            s += "Invent a person and give their birthday and details."
        with s.assistant():
            s += "Birthday: " + gen("day", regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}") + "\n"
            s += gen("details", json_schema=schema, max_tokens=80)

    s = person.run(backend=Endpoint(smollm2_server.url))
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", s["day"]), s["day"]
    jsonschema.validate(json.loads(s["details"]), schema)


def test_run_batch_equals_sequential_runs(smollm2_server: ServerProcess, capsys: pytest.CaptureFixture) -> None:
    ep = Endpoint(smollm2_server.url)

    @function
    def short(s, topic: str) -> None:  # noqa: ANN001
        with s.user():
            s += f"One sentence about {topic}."
        with s.assistant():
            s += gen("line", max_tokens=12)

    topics = [{"topic": t} for t in ["cats", "rain", "bread", "trains"] * 8]  # 32 programs
    batch = short.run_batch(topics, backend=ep, num_threads=8, progress_bar=True)
    assert "32/32" in capsys.readouterr().err
    sequential = [short.run(backend=ep, **t)["line"] for t in topics[:4]]
    assert [s["line"] for s in batch[:4]] == sequential
    assert len({s["line"] for s in batch}) == 4  # greedy: the same topic, the same line


def test_errors_name_the_program_line(smollm2_server: ServerProcess) -> None:
    @function
    def bad(s) -> None:  # noqa: ANN001
        s += "x"
        s += gen("y", regex="(unclosed")

    with pytest.raises(ServerError) as e:
        bad.run(backend=Endpoint(smollm2_server.url))
    assert e.value.status == 400 and e.value.param == "regex"
    assert e.value.site.endswith(f"test_frontend_programs.py:{bad.fn.__code__.co_firstlineno + 3}"), e.value.site
    with pytest.raises(UnsupportedError):
        image("cat.png")


def test_the_frontend_imports_without_torch() -> None:
    code = "import sys, frontend; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_a_streamed_run_yields_the_text_of_a_whole_run(smollm2_server: ServerProcess) -> None:
    ep = Endpoint(smollm2_server.url)
    args = {"question_1": "Name a colour.", "question_2": "Name another."}
    chunks = list(multi_turn_question.stream(backend=ep, **args))
    assert len(chunks) > 10  # generated text arrives piece by piece
    assert "".join(chunks) == multi_turn_question.run(backend=ep, **args).text()


def test_a_program_traces_without_a_server() -> None:
    @function
    def branches(s) -> None:  # noqa: ANN001
        with s.user():
            s += "Pick a number."
        forks = s.fork(2)
        for f in forks:
            f += gen("n", max_tokens=4)
        s += "Chosen: " + forks[0]["n"]

    nodes = branches.trace()
    kinds = [n["kind"] for n in nodes]
    assert kinds == ["role", "text", "role", "fork", "gen", "gen", "text"], kinds
    fork = nodes[3]
    assert [n["after"] for n in nodes if n["kind"] == "gen"] == [fork["id"], fork["id"]]  # both follow the fork
    assert nodes[-1]["text"] == "Chosen: <n>" and nodes[-1]["after"] == fork["id"]  # a read is a placeholder


def test_plain_gen_runs_against_any_openai_compatible_server(smollm2_server: ServerProcess) -> None:
    """OpenAICompatible speaks only /v1/completions (our server stands in for a third-party one): text and gen
    work, and give what the token-exact Endpoint gives for a prompt that tokenizes the same either way."""
    from frontend import OpenAICompatible

    @function
    def story(s, opening: str) -> None:  # noqa: ANN001
        s += opening
        s += gen("next", max_tokens=12, stop="\n")

    plain = story.run(backend=OpenAICompatible(smollm2_server.url, "SmolLM2-135M-Instruct"),
                      opening="Once upon a time")
    exact = story.run(backend=Endpoint(smollm2_server.url), opening="Once upon a time")
    assert plain["next"] == exact["next"] and plain["next"]

    @function
    def chatty(s) -> None:  # noqa: ANN001
        with s.user():
            s += "hi"

    with pytest.raises(UnsupportedError):
        chatty.run(backend=OpenAICompatible(smollm2_server.url, "SmolLM2-135M-Instruct"))
