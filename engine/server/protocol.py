"""Request bodies of the HTTP API (pydantic), and their conversion to SamplingParams."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from engine.grammar.spec import GrammarSpec
from engine.sampling_params import InvalidRequestError, SamplingParams

MAX_N = 16
# Accepted and ignored, since they change nothing about the answer (OpenAI's bookkeeping and routing hints).
HARMLESS_FIELDS = ("user", "metadata", "store", "service_tier")


class UnencodableText(Exception):
    """A body string that UTF-8 cannot encode (a lone surrogate such as "\\ud800", which JSON escapes allow).
    Not a ValueError, so pydantic lets it through to the app's handler, which answers 400 naming the field."""

    def __init__(self, param: str) -> None:
        super().__init__(f"{param or 'the body'} holds text that is not valid Unicode (a lone UTF-16 surrogate "
                         "such as \\ud800); send well-formed UTF-8 text")
        self.param = param or None


def first_unencodable(value: object) -> str | None:
    """The dotted path of the first string (or key) in a parsed JSON body that UTF-8 cannot encode, if any."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, path))
                stack.append((x, f"{path}.{k}" if path else str(k)))
        elif isinstance(v, list) and not all(type(x) is int for x in v):
            stack.extend((x, f"{path}.{i}" if path else str(i)) for i, x in enumerate(v))
    return None


class Body(BaseModel):
    """A top-level request body: text in it must be encodable, whatever field it is in."""

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: object) -> object:
        path = first_unencodable(data)
        if path is not None:
            raise UnencodableText(path)
        return data


def logit_bias_ids(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends logit_bias keys as token-id strings."""
    if not raw:
        return None
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except ValueError:
        bad = next(k for k in raw if not k.lstrip("-").isdigit())
        raise InvalidRequestError(f"logit_bias keys must be token ids, got {bad!r}", param="logit_bias") from None


_RESPONSE_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _response_format_spec(rf: dict[str, Any]) -> GrammarSpec | None:
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema (its schema;
    ``strict`` false is honoured as true: the output always satisfies the schema)."""
    kind = rf.get("type")
    if kind not in _RESPONSE_FORMAT_KEYS:
        raise InvalidRequestError(f"response_format.type must be one of {', '.join(_RESPONSE_FORMAT_KEYS)}, got "
                                  f"{kind!r}", param="response_format")
    extra = set(rf) - _RESPONSE_FORMAT_KEYS[kind]
    if extra:
        raise InvalidRequestError(f"response_format of type {kind!r} does not take {', '.join(sorted(extra))}",
                                  param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise InvalidRequestError("response_format.json_schema must be an object with a name and a schema",
                                  param="response_format")
    extra = set(js) - _JSON_SCHEMA_KEYS
    if extra:
        raise InvalidRequestError(f"response_format.json_schema does not take {', '.join(sorted(extra))}",
                                  param="response_format")
    if js.get("schema") is None:
        return GrammarSpec("json_object", "", "response_format")
    return GrammarSpec.from_json_schema(js["schema"], "response_format")


def grammar_spec(response_format: dict[str, Any] | None, regex: str | None, ebnf: str | None,
                 json_schema: str | dict[str, Any] | None) -> GrammarSpec | None:
    """The one constraint a request asks for (OpenAI's response_format or SGLang's regex / ebnf / json_schema);
    asking for two is refused, naming both."""
    given: list[tuple[str, GrammarSpec]] = []
    if response_format is not None:
        spec = _response_format_spec(response_format)
        if spec is not None:
            given.append(("response_format", spec))
    if regex is not None:
        given.append(("regex", GrammarSpec.of_text("regex", regex, "regex")))
    if ebnf is not None:
        given.append(("ebnf", GrammarSpec.of_text("ebnf", ebnf, "ebnf")))
    if json_schema is not None:
        given.append(("json_schema", GrammarSpec.from_json_schema(json_schema, "json_schema")))
    if len(given) > 1:
        raise InvalidRequestError(f"give at most one output constraint; this request has {given[0][0]} and "
                                  f"{given[1][0]}", param=given[1][0])
    return given[0][1] if given else None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False  # OpenAI's: a last chunk with the request's usage
    continuous_usage_stats: StrictBool = False  # vLLM's: every chunk carries its choice's usage so far


class RoutingFields(Body):
    """Fields a router adds: request id, cache namespace and priority, and the PD bootstrap triple."""

    model_config = ConfigDict(extra="forbid")  # a field we do not know is refused, never silently ignored
    rid: str | None = Field(default=None, max_length=256)
    extra_key: str | None = Field(default=None, max_length=256)  # prefix-cache namespace
    cache_salt: str | None = Field(default=None, max_length=256)  # vLLM's spelling of the same
    priority: StrictInt = 0
    # PD mode (added by the router): one value, or one per prompt for batched /generate bodies
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: StrictInt | list[StrictInt | None] | None = None
    bootstrap_room: StrictInt | list[StrictInt] | None = None

    @property
    def namespace(self) -> str | None:
        return self.extra_key or self.cache_salt


class OpenAISampling(RoutingFields):
    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    min_p: float = 0.0
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    logit_bias: dict[str, float] | None = None
    # harmless (HARMLESS_FIELDS): accepted, recorded nowhere, change nothing
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    # structured output (one at most): OpenAI's, and SGLang's as extra body fields
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    # OpenAI's deprecated function calling: refused with a 400 naming the field (use tools)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not 0.0 <= v <= 2.0:  # OpenAI's bound (/generate allows more)
            raise ValueError(f"must be in [0, 2], got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:  # OpenAI's bound (/generate allows 16)
            raise ValueError(f"may hold at most 4 sequences, got {len(v)}")
        return v

    def refuse_unsupported(self) -> None:
        """The fields we do not honour, each refused by name unless it asks for the default."""
        if self.functions:
            raise InvalidRequestError("functions (deprecated function calling) is not supported; send tools",
                                      param="functions", code="unsupported_parameter")
        if self.function_call is not None and self.function_call != "none":
            raise InvalidRequestError("function_call is not supported; send tool_choice", param="function_call",
                                      code="unsupported_parameter")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self.refuse_unsupported()
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer it
            raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias=logit_bias_ids(self.logit_bias),
            grammar=grammar_spec(self.response_format, self.regex, self.ebnf, self.json_schema))

    @property
    def stream_opts(self) -> StreamOptions:
        """``stream_options``, or its defaults when not given."""
        return self.stream_options or StreamOptions()


class CompletionRequest(OpenAISampling):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: object) -> object:
        if v == "" or v == [] or (isinstance(v, list) and any(x == "" or x == [] for x in v)):
            raise ValueError("must not be empty (nor hold an empty prompt)")
        return v


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    # Extra keys are harmless: clients send back whole response messages (refusal, audio, annotations: null)
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # a participant's name: harmless, chat templates do not render it
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise InvalidRequestError("only text content parts are supported", param="messages")
            content = "".join(p.text or "" for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise InvalidRequestError(f"the arguments of the earlier call to {c.function.name!r} are not "
                                              "a JSON object", param="messages")
                calls.append({"name": c.function.name, "arguments": args, "id": c.id})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True


class GenerateSampling(BaseModel):
    """SGLang-style ``sampling_params`` of /generate; unknown keys are refused so typos do not pass silently."""

    max_new_tokens: StrictInt | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: StrictInt | None = Field(default=None, alias="sampling_seed")
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    logit_bias: dict[str, float] | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def to_params(self, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias=logit_bias_ids(self.logit_bias), grammar=grammar_spec(None, self.regex, self.ebnf,
                                                                            self.json_schema))


class GenerateRequest(RoutingFields):
    text: str | list[str] | None = Field(default=None, description="the prompt as text (or a batch); give this "
                                                                    "or input_ids")
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: GenerateSampling = GenerateSampling()
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: StrictInt = 0

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self


class TokenizeRequest(Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered as the chat endpoint renders them
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]
