"""Function calling: the tools a chat request declares, how they reach the prompt, how ``tool_choice`` becomes a
grammar, and how calls are read back out of the model's text (whole or streamed).

A tool-call format says how a call is written: ``hermes`` (ChatML models: ``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``, one block per call) or ``llama3_json`` (Llama 3: ``{"name": ...,
"parameters": {...}}``, calls separated by ``; ``). ``--tool-call-parser auto`` picks it from the chat template
(``<tool_call>`` or ChatML: hermes; ``<|python_tag|>``: llama3_json). A template that renders ``tools`` itself
gets them; otherwise the tools go into the system message, described in the format's words, and earlier
assistant calls and tool results are written the way the format writes them.

``tool_choice`` constrains decoding with an xgrammar structural tag: ``auto`` lets the model write text and, once
it starts a call, holds the call to a declared tool with arguments that satisfy its schema; ``required`` makes
the output one or more calls and nothing else; a named function makes the output exactly one call to it; ``none`` leaves the
output free (the tools stay in the prompt). ``parallel_tool_calls: false`` allows one call at most."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.grammar.spec import GrammarSpec, check_schema
from engine.sampling_params import InvalidRequestError

PARSERS = ("auto", "hermes", "llama3_json", "none")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str  # what every call starts with
    separator: str  # between two calls

    def begin(self, tool: str) -> str:
        key = "arguments" if self.name == "hermes" else "parameters"
        head = '<tool_call>\n{"name": ' if self.name == "hermes" else '{"name": '
        return f'{head}{json.dumps(tool)}, "{key}": '

    @property
    def end(self) -> str:
        return "}\n</tool_call>" if self.name == "hermes" else "}"

    def write(self, name: str, arguments: dict[str, Any]) -> str:
        return self.begin(name) + json.dumps(arguments, ensure_ascii=False) + self.end

    def describe(self, tools: list[Tool]) -> str:
        """The system-message text that tells the model which tools it has and how to call them."""
        listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                       ensure_ascii=False) for t in tools)
        example = self.write("tool_name", {"argument": "value"})
        return ("You can call functions to help answer. The available functions, with JSON schemas for their "
                f"arguments:\n{listing}\nTo call a function, reply with exactly:\n{example}\n"
                "using one of the names above and arguments matching its schema.")


FORMATS = {"hermes": ToolFormat("hermes", "<tool_call>", "\n"),
           "llama3_json": ToolFormat("llama3_json", '{"name": ', "; ")}


def pick_format(parser: str, chat_template: str | None) -> ToolFormat | None:
    if parser != "auto":
        return FORMATS.get(parser)
    template = chat_template or ""
    if "<tool_call>" in template or "<|im_start|>" in template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return FORMATS["llama3_json"]
    return None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


def parse_tools(raw: list[dict[str, Any]]) -> list[Tool]:
    """OpenAI's ``tools`` list, checked: function tools only, unique names, parameters the grammar enforces."""
    tools: list[Tool] = []
    for i, item in enumerate(raw):
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"tools.{i} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                      param="tools")
        extra = (set(item) - {"type", "function"}) | (set(fn) - {"name", "description", "parameters", "strict"})
        if extra:  # a misspelt "parameters" would otherwise give a tool without arguments
            raise InvalidRequestError(f"tools.{i} has unknown keys: {', '.join(sorted(extra))}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"tools.{i}.function.name must be 1-64 letters, digits, '_', '-' or '.'",
                                      param="tools")
        if any(t.name == name for t in tools):
            raise InvalidRequestError(f"tools.{i}: the function name {name!r} is declared twice", param="tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools.{i}.function.parameters must be a JSON schema", param="tools")
        check_schema(params, "tools", f"tools.{i}.function.parameters")
        tools.append(Tool(name, str(fn.get("description") or ""), params))
    return tools


def chosen(tools: list[Tool], tool_choice: str | dict[str, Any] | None) -> tuple[str, list[Tool]]:
    """("none" | "auto" | "required" | "named", the tools a call may use)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), tools
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be none, auto, required or a function, got {tool_choice!r}",
                                      param="tool_choice")
        if tool_choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
        return tool_choice, tools
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) and tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', param="tool_choice")
    match = [t for t in tools if t.name == name]
    if not match:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools",
                                  param="tool_choice")
    return "named", match


def grammar_for(fmt: ToolFormat, mode: str, tools: list[Tool], parallel: bool) -> GrammarSpec | None:
    """The structural tag that holds calls to the declared tools and their schemas (None for ``none``)."""
    if mode == "none":
        return None
    tags = [{"type": "tag", "begin": fmt.begin(t.name), "end": fmt.end,
             "content": {"type": "json_schema", "json_schema": t.parameters, "max_whitespace_cnt": 1}}
            for t in tools]  # at most one blank between tokens: a weak model cannot loop in whitespace
    if mode == "named":
        form: dict[str, Any] = tags[0]
    elif mode == "required":  # calls only, nothing around them
        form = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator, "at_least_one": True,
                "stop_after_first": not parallel}
    else:
        form = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags, "at_least_one": False,
                "stop_after_first": not parallel}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": form}), "tools")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: object, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _read_call(text: str, fmt: ToolFormat, names: set[str]) -> tuple[ToolCall | None, int] | None:
    """``text`` starts with the trigger: the call it holds (None: a whole block that is not a call to a declared
    tool) and where the block ends; None if the block is not complete yet (or never can be)."""
    body = len("<tool_call>") if fmt.name == "hermes" else 0
    try:
        # strict=False: a raw control character inside a string (the call grammar allows one) is read, and the
        # arguments are written back out escaped
        obj, end = json.JSONDecoder(strict=False).raw_decode(text, _skip_space(text, body))
    except ValueError:
        return None
    call = _call(obj, names)
    if fmt.name == "hermes":
        close = _skip_space(text, end)
        if not text.startswith("</tool_call>", close):
            return None if len(text) - close < len("</tool_call>") else (None, close)
        end = close + len("</tool_call>")
    return call, end


def extract_calls(text: str, fmt: ToolFormat, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(the text outside calls, the calls), for a whole answer. Text that looks like a call but does not parse as
    one to a declared tool stays text."""
    stream = CallStream(fmt, names)
    content, calls = stream.feed(text, final=True)
    return content, calls


class CallStream:
    """Streamed text in, content deltas and whole tool calls out: text that may begin a call is held back until
    it either is one (then the call is emitted once complete) or cannot be (then it is released as content)."""

    def __init__(self, fmt: ToolFormat, names: set[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.buffer = ""
        self.calls = 0
        self._space = ""  # whitespace-only content held back: an answer of calls and blanks has no content
        self._wrote = False
        self._after_call = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        content, calls = self._feed(text, final)
        content, self._space = self._space + content, ""
        if content and not content.strip() and not (final and self._wrote):
            self._space, content = ("" if final else content), ""
        self._wrote = self._wrote or bool(content)
        return content, calls

    def _feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content, calls = "", []
        sep = self.fmt.separator.strip()
        while self.buffer:
            if self._after_call:  # blanks and the separator after a call are not content
                rest = self.buffer.lstrip()
                if sep and rest.startswith(sep):
                    self.buffer = rest[len(sep):]
                    continue
                if not final and (not rest or (sep and sep.startswith(rest))):
                    break  # the separator may still be arriving
                self.buffer, self._after_call = rest, False
                continue
            start = self.buffer.find(self.fmt.trigger)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, self.fmt.trigger)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            read = _read_call(self.buffer, self.fmt, self.names)
            if read is None:  # not complete yet
                if final:
                    content += self.buffer
                    self.buffer = ""
                break
            call, end = read
            if call is None:
                content += self.buffer[:end]
            else:
                calls.append(call)
                self._after_call = True
            self.buffer = self.buffer[end:]
        self.calls += len(calls)
        return content, calls


def _partial_suffix(text: str, trigger: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``trigger``."""
    for n in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0


def chat_inputs(messages: list[dict[str, Any]], raw_tools: list[dict[str, Any]] | None, parser: str,
                chat_template: str | None, renders_tools: bool
                ) -> tuple[ToolFormat | None, list[Tool], list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(the tool-call format, the tools, the messages and the ``tools`` argument for the chat template): what the
    chat endpoint and /tokenize both render. Tools, or tool turns in the history, need a format or a template
    that renders them (else a 400 naming ``--tool-call-parser``)."""
    tools = parse_tools(raw_tools) if raw_tools else []
    needs = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    fmt = pick_format(parser, chat_template) if needs else None
    if needs and fmt is None and not renders_tools:
        raise InvalidRequestError("this model's chat template does not render tools and no --tool-call-parser is "
                                  "set, so tool calls cannot be written or read; start the server with "
                                  "--tool-call-parser hermes or llama3_json", param="tools",
                                  code="unsupported_parameter")
    rendered, native = template_messages(messages, fmt, tools, renders_tools)
    return fmt, tools, rendered, native


def template_messages(messages: list[dict[str, Any]], fmt: ToolFormat | None, tools: list[Tool],
                      native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages for the chat template, and the ``tools`` argument for a template that renders tools itself.
    Without native support, the tools join the system message and earlier calls and results are written in the
    format's own words (results as ``<tool_response>`` blocks in a user turn)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant" and calls:
            if native:
                out.append({**m, "tool_calls": [{"type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls]})
                continue
            assert fmt is not None
            written = fmt.separator.join(fmt.write(c["name"], c["arguments"]) for c in calls)
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + written})
        elif m["role"] == "tool" and not native:
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    for m in out:
        m.pop("tool_results", None)
    if not tools:
        return out, None
    if native:
        return out, [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                       "parameters": t.parameters}} for t in tools]
    assert fmt is not None
    text = fmt.describe(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None
