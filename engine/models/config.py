"""The architecture description we need, read from a Hugging Face ``config.json``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(RuntimeError):
    """The model folder cannot be served; the message names what is missing or unsupported."""


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, per byte of dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Normalise the two spellings (transformers <5 ``rope_theta``/``rope_scaling``, >=5 ``rope_parameters``)."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        scaling["rope_type"] = rope_type
        scaling.pop("type", None)
        scaling.pop("rope_theta", None)
        if rope_type == "default":
            scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_arch_config(model_dir: Path) -> ArchConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json; pass a Hugging Face model folder to --model-path")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    if raw.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise ModelLoadError("sliding-window attention is not supported (use_sliding_window=true)")
    theta, scaling = _rope(raw)
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    gen_path = model_dir / "generation_config.json"
    eos = _eos_ids(raw.get("eos_token_id"))
    if gen_path.is_file():
        eos = tuple(dict.fromkeys(eos + _eos_ids(json.loads(gen_path.read_text()).get("eos_token_id"))))
    qkv_bias = arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
    return ArchConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos,
    )
