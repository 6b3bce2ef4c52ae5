"""Per-request sampling parameters and their validation (errors name the field and the allowed range)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.grammar.spec import GrammarSpec


MAX_LOGIT_BIAS = 1024  # tokens one request may bias


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message is shown to the client (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    max_new_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: and the top k
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's -100..100)
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and the top k (echo)
    grammar: GrammarSpec | None = None  # what the output must match (compiled by the server before queueing)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias: per-row work before sampling."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias))

    def validate(self, vocab_size: int) -> None:
        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} {msg}", param=name)

        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", "must fit in a signed 64-bit integer")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be at most 16 non-empty strings")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise bad("stop_token_ids", f"has {t}, outside the vocabulary [0, {vocab_size})")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
            for t, v in self.logit_bias.items():
                if not 0 <= t < vocab_size:
                    raise bad("logit_bias", f"has token id {t}, outside the vocabulary [0, {vocab_size})")
                if not -100.0 <= v <= 100.0:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {v} for token {t}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
