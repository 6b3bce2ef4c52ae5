"""Request bodies of the HTTP API (pydantic), and their conversion to SamplingParams."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

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


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


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
    # not supported yet: refused with a 400 naming the field unless they ask for the default
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
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
        """The fields we cannot honour yet, each refused by name unless it asks for plain text."""
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError(f"response_format {self.response_format.get('type')!r} (structured output) is "
                                      "not supported yet; leave response_format out or use {\"type\": \"text\"}",
                                      param="response_format", code="unsupported_parameter")
        if self.tools or self.functions:
            name = "tools" if self.tools else "functions"
            raise InvalidRequestError(f"{name} (function calling) is not supported yet", param=name,
                                      code="unsupported_parameter")
        for name in ("tool_choice", "function_call"):
            value = getattr(self, name)
            if value is not None and value != "none":
                raise InvalidRequestError(f"{name}={value!r} needs function calling, which is not supported yet",
                                          param=name, code="unsupported_parameter")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self.refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias=logit_bias_ids(self.logit_bias))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                from engine.sampling_params import InvalidRequestError
                raise InvalidRequestError("only text content parts are supported", param="messages")
            content = "".join(p.text or "" for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True


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

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def to_params(self, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias=logit_bias_ids(self.logit_bias))


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
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]
