"""Request bodies of the HTTP API (pydantic), and their conversion to SamplingParams."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from engine.sampling_params import SamplingParams

MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class RoutingFields(BaseModel):
    """Fields a router adds: request id, cache namespace and priority, and the PD bootstrap triple."""

    model_config = ConfigDict(extra="ignore")
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
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAISampling):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None


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
    messages: list[ChatMessage]
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
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def to_params(self, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)


class GenerateRequest(RoutingFields):
    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: GenerateSampling = GenerateSampling()
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: StrictInt = 0
