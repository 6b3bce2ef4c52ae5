"""Tool calls are read back out of text exactly as they were written, in both formats, whole or streamed in
chunks of any size; text around calls stays content; malformed or undeclared calls stay text; the tools list is
checked; tool_choice becomes the structural tag that its mode needs."""
from __future__ import annotations

import json
import random

import pytest

from engine.sampling_params import InvalidRequestError
from engine.server.tools import FORMATS, CallStream, chosen, extract_calls, grammar_for, parse_tools, pick_format

NAMES = {"get_weather", "get_time"}
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"city": "Tōkyō"})]


def written(fmt_name: str, before: str = "", after: str = "") -> str:
    fmt = FORMATS[fmt_name]
    return before + fmt.separator.join(fmt.write(n, a) for n, a in CALLS) + after


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("before, after", [("", ""), ("Let me check. ", ""), ("", "\n")])
def test_written_calls_are_read_back_whole_and_streamed(fmt_name: str, before: str, after: str) -> None:
    fmt = FORMATS[fmt_name]
    text = written(fmt_name, before, after)
    content, calls = extract_calls(text, fmt, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert (content if content.strip() else None) == (before or None)
    rng = random.Random(0)
    for _ in range(20):  # chunked at random, as tokens arrive
        stream, pos, got, streamed = CallStream(fmt, NAMES), 0, [], ""
        while pos < len(text):
            step = rng.randint(1, 7)
            c, found = stream.feed(text[pos:pos + step])
            streamed, got, pos = streamed + c, got + found, pos + step
        c, found = stream.feed("", final=True)
        streamed, got = streamed + c, got + found
        assert [(x.name, x.arguments) for x in got] == [(x.name, x.arguments) for x in calls]
        assert (streamed or None) == (content if content.strip() else None)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not a declared tool
    '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "x"',  # cut off (max_tokens)
    'I would write <tool_call> here but I will not.',
])
def test_malformed_or_undeclared_calls_stay_text(text: str) -> None:
    content, calls = extract_calls(text, FORMATS["hermes"], NAMES)
    assert calls == [] and content == text


def test_the_format_is_picked_from_the_chat_template() -> None:
    assert pick_format("auto", "{{'<|im_start|>' + message['role']}}").name == "hermes"
    assert pick_format("auto", "<|start_header_id|>{{ role }}<|end_header_id|>").name == "llama3_json"
    assert pick_format("auto", "{{ messages }}") is None and pick_format("none", "<|im_start|>") is None
    assert pick_format("llama3_json", None).name == "llama3_json"


@pytest.mark.parametrize("raw, words", [
    ([{"type": "code_interpreter"}], "tools.0"),
    ([{"type": "function", "function": {"name": "a b"}}], "name"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}], "twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
     "uniqueItems"),
    ([{"type": "function", "function": {"name": "f", "paramters": {"type": "object"}}}], "paramters"),
])
def test_bad_tools_are_refused_naming_the_problem(raw: list, words: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        parse_tools(raw)
    assert words in str(e.value)


def test_tool_choice_modes_become_structural_tags() -> None:
    tools = parse_tools([{"type": "function", "function": {"name": n}} for n in sorted(NAMES)])
    fmt = FORMATS["hermes"]
    assert chosen(tools, None)[0] == "auto" and chosen([], None)[0] == "none"
    mode, allowed = chosen(tools, {"type": "function", "function": {"name": "get_time"}})
    assert mode == "named" and [t.name for t in allowed] == ["get_time"]
    with pytest.raises(InvalidRequestError):
        chosen(tools, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidRequestError):
        chosen([], "required")
    forms = {m: json.loads(grammar_for(fmt, m, tools, parallel=False).text)["format"]
             for m in ("auto", "required")}
    assert forms["auto"]["type"] == "triggered_tags" and not forms["auto"]["at_least_one"]
    assert forms["required"]["type"] == "tags_with_separator" and forms["required"]["stop_after_first"]
    assert json.loads(grammar_for(fmt, "named", allowed, True).text)["format"]["begin"].startswith("<tool_call>")
    assert grammar_for(fmt, "none", tools, True) is None


def test_a_malformed_tool_choice_is_a_400_and_raw_control_characters_in_arguments_still_parse() -> None:
    tools = parse_tools([{"type": "function", "function": {"name": "get_time"}}])
    for bad in ({"type": "function", "function": "get_time"}, {"type": "function"}, {"function": {"name": 3}}):
        with pytest.raises(InvalidRequestError) as e:
            chosen(tools, bad)
        assert e.value.param == "tool_choice"
    text = '<tool_call>\n{"name": "get_time", "arguments": {"city": "a\tb"}}\n</tool_call>'  # a raw tab
    _, calls = extract_calls(text, FORMATS["hermes"], NAMES)
    assert [json.loads(c.arguments) for c in calls] == [{"city": "a\tb"}] and "\\t" in calls[0].arguments
