"""Function calling on the real model through the real ``openai`` client (SmolLM2's ChatML template does not
render tools, so ``--tool-call-parser auto`` writes them in the hermes format): a named function and
``required`` always give a valid call to a declared tool with arguments that satisfy its schema; ``auto``
calls are read out of free text; a tool result goes back through the template; streamed calls, assembled by the
client, equal the whole answer; a server with ``--tool-call-parser none`` refuses tools by name, and one with a
1 ms compile deadline refuses a schema with a 400 naming the deadline."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from engine.models.source import ModelSource
from tests.helpers import ServerProcess
from tests.real_model.conftest import SERVED_NAME
from tests.real_model.structured import client

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def earlier_call(i: int, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
        "name": "get_time", "arguments": json.dumps({"city": city})}}]}


def create(url: str, **kw):  # noqa: ANN003, ANN201
    return client(url).chat.completions.create(**{"model": SERVED_NAME, "temperature": 0, "max_tokens": 120, **kw})


def streamed(url: str, **kw) -> tuple[str | None, list[tuple[str, str]], str]:  # noqa: ANN003
    """(content, [(name, arguments)], finish_reason) as the openai client's stream delivers them."""
    content, calls, reason = "", {}, None
    for chunk in client(url).chat.completions.create(**{"model": SERVED_NAME, "temperature": 0, "max_tokens": 120,
                                                         "stream": True, **kw}):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


def valid_calls(message) -> list[tuple[str, str]]:  # noqa: ANN001
    out = []
    for tc in message.tool_calls or []:
        assert tc.type == "function" and tc.id.startswith("call_")
        jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
        out.append((tc.function.name, tc.function.arguments))
    return out


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_choice_always_gives_a_valid_call(smollm2_server: ServerProcess, choice: object) -> None:
    for question in ("What's the weather in Paris?", "Tell me a joke.", "What time is it in Tokyo?"):
        for sampled in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            r = create(smollm2_server.url, messages=[{"role": "user", "content": question}], tools=TOOLS,
                       tool_choice=choice, parallel_tool_calls=False, **sampled)
            calls = valid_calls(r.choices[0].message)
            assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls", r
            assert r.choices[0].message.content is None
            if isinstance(choice, dict):
                assert calls[0][0] == "get_time"


def test_auto_calls_are_read_from_free_text_and_streamed_alike(smollm2_server: ServerProcess) -> None:
    shots = [{"role": "user", "content": "What time is it in Rome?"}, earlier_call(1, "Rome"),
             {"role": "user", "content": "And the time in Madrid?"}, earlier_call(2, "Madrid")]
    kw = {"messages": shots + [{"role": "user", "content": "And the time in Paris?"}], "tools": TOOLS,
          "tool_choice": "auto"}
    whole = create(smollm2_server.url, **kw)
    calls = valid_calls(whole.choices[0].message)
    assert calls and whole.choices[0].finish_reason == "tool_calls", whole
    assert streamed(smollm2_server.url, **kw) == (whole.choices[0].message.content, calls, "tool_calls")
    plain = create(smollm2_server.url, messages=ASK, tools=TOOLS, tool_choice="none")
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


def test_streamed_forced_calls_equal_the_whole_answer(smollm2_server: ServerProcess) -> None:
    kw = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    whole = create(smollm2_server.url, **kw)
    assert streamed(smollm2_server.url, **kw) == (None, valid_calls(whole.choices[0].message), "tool_calls")


def test_a_tool_result_round_trip_goes_through_the_template(smollm2_server: ServerProcess) -> None:
    first = create(smollm2_server.url, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    answer = create(smollm2_server.url, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40)
    assert answer.choices[0].message.content
    # the call and its result are in the prompt now, and /tokenize renders the history the same way
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    counted = httpx.post(smollm2_server.url + "/tokenize", timeout=60, json={
        "model": SERVED_NAME, "messages": history, "tools": TOOLS}).json()
    assert counted["count"] == answer.usage.prompt_tokens, counted
    with pytest.raises(openai.BadRequestError) as e:  # an earlier call whose arguments are not JSON
        bad = {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": "{not json"}}]}
        create(smollm2_server.url, messages=[ASK[0], bad], tools=TOOLS)
    assert e.value.body["param"] == "messages"


@pytest.fixture(scope="module")
def no_parser_server(smollm2: ModelSource) -> Iterator[ServerProcess]:
    srv = ServerProcess("engine", ["--max-total-tokens", "4096", "--tool-call-parser", "none",
                                   "--grammar-compile-timeout", "0.001", "--served-model-name", SERVED_NAME]).wait_ready()
    yield srv
    srv.stop()


def test_tools_without_a_parser_or_template_support_are_refused(no_parser_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        create(no_parser_server.url, messages=ASK, tools=TOOLS)
    assert e.value.body["param"] == "tools" and "--tool-call-parser" in e.value.body["message"]


def test_a_grammar_that_misses_its_compile_deadline_is_a_400(no_parser_server: ServerProcess) -> None:
    """This server allows 1 ms: no JSON schema compiles that fast, so the refusal names the deadline."""
    with pytest.raises(openai.BadRequestError) as e:
        create(no_parser_server.url, messages=ASK, response_format={"type": "json_schema", "json_schema": {
            "name": "w", "schema": WEATHER}})
    assert e.value.body["param"] == "response_format" and e.value.body["code"] == "grammar_timeout", e.value.body
    plain = create(no_parser_server.url, messages=ASK, max_tokens=4)  # the server goes on serving
    assert plain.choices[0].finish_reason == "length"
