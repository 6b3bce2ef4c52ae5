"""A GGUF file loads into the same weights transformers' own GGUF loader makes of it, for every tensor type we
claim (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and for Llama (llama.cpp's Q/K row
interleave undone), Qwen2 (QKV biases, not interleaved) and Qwen3 (QK norms); untied heads and tied ones. A start
from a converted folder reads the tensors through the index the conversion recorded, without the gguf reader: the
same tensors, bit for bit."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.models.config import ModelLoadError
from engine.models.gguf import GGUFCheckpoint, dequantizable_types, indexed_tensors, unpermute_rows
from engine.models.loader import load_model
from tests.helpers import write_gguf

CASES = [("llama", t, True) for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                      "Q4_K", "Q5_K", "Q6_K")]
CASES += [("llama", "Q8_0", False), ("qwen2", "Q8_0", False), ("qwen3", "Q4_1", True)]


def _ours_unfused(model, cfg) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Our model's weights under transformers' names (our fused qkv and gate_up split back)."""
    out = {}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, p in model.state_dict().items():
        if "qkv_proj" in name:
            stem, kind = name.rsplit(".qkv_proj.", 1)
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.split([q, kv, kv])):
                out[f"model.{stem}.{part}.{kind}"] = t
        elif "gate_up_proj" in name:
            stem, kind = name.rsplit(".gate_up_proj.", 1)
            for part, t in zip(("gate_proj", "up_proj"), p.chunk(2)):
                out[f"model.{stem}.{part}.{kind}"] = t
        elif name.startswith("lm_head") or name.startswith("rope"):
            out[name] = p
        else:
            out[f"model.{name}"] = p
    return out


@pytest.mark.parametrize("arch, qtype, tie", CASES, ids=[f"{a}-{q}-{'tied' if t else 'untied'}" for a, q, t in CASES])
def test_weights_equal_transformers_gguf_loader(tmp_path: Path, arch: str, qtype: str, tie: bool) -> None:
    from transformers import AutoModelForCausalLM
    path = write_gguf(tmp_path / f"m-{qtype}.gguf", arch, qtype, tie=tie)
    ckpt = GGUFCheckpoint(path)
    (tmp_path / "config.json").write_text(json.dumps(ckpt.hf_config()))
    model, cfg, dtype = load_model(tmp_path, "auto", torch.device("cpu"), "off", gguf=path)
    assert dtype == torch.float32 and cfg.tie_word_embeddings == tie and cfg.architecture.lower().startswith(arch)
    ours = _ours_unfused(model, cfg)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).state_dict()
    if tie:
        ref.pop("lm_head.weight", None)
    assert set(ours) - {"rope.inv_freq"} <= set(ref) and not set(ref) - set(ours), sorted(set(ref) ^ set(ours))
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), f"{name} differs from transformers' load"


def test_unpermute_inverts_llama_cpps_interleave() -> None:
    """llama.cpp stores each head's rows as pairs (row i of the first half next to row i of the second)."""
    heads, dim = 3, 8
    w = torch.arange(heads * dim * 2, dtype=torch.float32).reshape(heads * dim, 2)
    stored = w.reshape(heads, 2, dim // 2, 2).swapaxes(1, 2).reshape(w.shape)  # the converter's permute
    assert torch.equal(unpermute_rows(stored, heads), w)


def test_every_claimed_type_is_dequantizable() -> None:
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"} <= set(dequantizable_types())


@pytest.mark.parametrize("arch, qtype, tie", CASES, ids=[f"{a}-{q}-{'tied' if t else 'untied'}" for a, q, t in CASES])
def test_the_recorded_index_reads_the_tensors_the_reader_reads(tmp_path: Path, arch: str, qtype: str,
                                                              tie: bool) -> None:
    path = write_gguf(tmp_path / f"m-{qtype}.gguf", arch, qtype, tie=tie)
    ckpt = GGUFCheckpoint(path)
    ref = dict(ckpt.tensors())
    ours = dict(indexed_tensors(path, json.loads(json.dumps(ckpt.tensor_index()))))  # as written to and read from disk
    assert list(ours) == list(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), f"{name} differs"


def test_a_file_shorter_than_its_index_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", "Q4_1")
    index = GGUFCheckpoint(path).tensor_index()
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="shorter .* than its recorded tensors"):
        next(indexed_tensors(path, index))
