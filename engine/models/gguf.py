"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package (the llama.cpp project's own
reader).

What a GGUF holds and where it goes:
- architecture metadata (``{arch}.block_count``, ``.embedding_length``, ...) -> a Hugging Face ``config.json``
  dict, which the engine's ``load_arch_config`` reads like any other folder's;
- tensors (named ``blk.N.attn_q.weight`` ...) -> dequantized once at load into float32 with ``gguf``'s own
  dequantizer (F32, F16, BF16, Q5_0/1, the K-quants, the IQ types: whatever it implements; Q4_0, Q4_1 and Q8_0 with
  the same arithmetic in whole-tensor torch ops, ``_dequantize_blocks``), renamed
  to the Hugging Face names, and for Llama-family files with llama.cpp's Q/K row interleaving undone (its
  converter permutes the rows of q_proj and k_proj so its RoPE can rotate adjacent pairs; ours rotates halves);
- tokenizer metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``) -> converted by transformers' own GGUF
  tokenizer conversion (source.py caches the result), so we encode exactly as transformers does for the file.

A tied LM head is what the file says: no ``output.weight`` tensor.
Measured here (SmolLM2-135M Q4_1, 272 tensors): opening the file 1.6 s (parsing 49k token strings), dequantizing
every tensor 0.8 s; transformers' tokenizer conversion 5.8 s, which is why source.py caches it. On an AVX2 Zen 1
host opening the file took ~6 s of a 17.5 s start-up, so the conversion also records what loading needs
(``tensor_index``: the architecture, head counts, each tensor's type, dims and bytes) and a start with that record
memory-maps the file and reads the tensors without parsing the metadata (``indexed_tensors``).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.config import ModelLoadError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_QK_PERMUTED = frozenset({"llama"})  # llama.cpp's converter interleaves Q/K rows only for the Llama family
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_MISSING = object()
INDEX_FILE = "gguf_tensors.json"  # tensor_index(), written beside the converted config (source.py)


def dequantizable_types() -> list[str]:
    """The tensor types the installed ``gguf`` package can dequantize."""
    from gguf import GGMLQuantizationType, quants
    names = {"F32", "F16"} | {t.name for t in getattr(quants, "_type_traits", {})}
    return sorted(names, key=lambda n: GGMLQuantizationType[n].value)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave: rows (h, j, i) back to (h, i, j), with i the half and j the pair."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file, opened and checked: every problem that would stop serving is raised here, as a
    ModelLoadError naming what is missing and what is supported."""

    def __init__(self, path: Path) -> None:
        try:
            from gguf import GGUFReader
        except ImportError as e:
            raise ModelLoadError("reading a .gguf file needs the gguf package: pip install gguf") from e
        self.path = path
        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad bytes
            raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                                 f"{type(e).__name__}: {e}") from e
        self.arch = str(self.value("general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"{path}: GGUF architecture {self.arch!r} is not supported; supported: "
                                 f"{', '.join(ARCHITECTURES)}")
        if "tokenizer.ggml.tokens" not in self.reader.fields:
            raise ModelLoadError(f"{path} has no tokenizer (no tokenizer.ggml.tokens in its metadata); a GGUF we "
                                 "serve must carry its tokenizer")
        self.tensor_names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in self.tensor_names:
            raise ModelLoadError(f"{path} has per-dimension RoPE frequencies (rope_freqs.weight, Llama 3.1 style), "
                                 "which we do not read from GGUF; use the model's Hugging Face folder")
        supported = set(dequantizable_types())
        bad = sorted({t.tensor_type.name for t in self.reader.tensors if t.tensor_type.name not in supported})
        if bad:
            raise ModelLoadError(f"{path} has tensors of type {', '.join(bad)}, which the gguf package cannot "
                                 f"dequantize; supported: {', '.join(sorted(supported))}")

    def value(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path} lacks the metadata key {key} (a {self.arch} GGUF needs it)")
            return default
        return field.contents()

    def _arch_value(self, key: str, default: Any = _MISSING) -> Any:
        value = self.value(f"{self.arch}.{key}", default)
        if isinstance(value, list):
            raise ModelLoadError(f"{self.path}: {self.arch}.{key} varies by layer ({value[:4]}...), which is not "
                                 "supported")
        return value

    @property
    def type_counts(self) -> dict[str, int]:
        return dict(Counter(t.tensor_type.name for t in self.reader.tensors))

    def hf_config(self) -> dict[str, Any]:
        """The file's architecture metadata as a Hugging Face config.json dict."""
        from gguf import LlamaFileType
        heads = int(self._arch_value("attention.head_count"))
        hidden = int(self._arch_value("embedding_length"))
        embed = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        vocab = self._arch_value("vocab_size", None) or len(self.reader.fields["tokenizer.ggml.tokens"].data)
        if embed is not None:
            vocab = int(embed.shape[-1])  # ggml order: [hidden, vocab]
        file_type = int(self.value("general.file_type", -1))
        dtype = {LlamaFileType.MOSTLY_BF16: "bfloat16", LlamaFileType.MOSTLY_F16: "float16"}.get(file_type, "float32")
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_value("feed_forward_length")),
            "num_hidden_layers": int(self._arch_value("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch_value("attention.head_count_kv", heads)),
            "head_dim": int(self._arch_value("attention.key_length", 0) or hidden // heads),
            "rms_norm_eps": float(self._arch_value("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self._arch_value("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_value("context_length")),
            "vocab_size": int(vocab),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_names,
            "hidden_act": "silu",
            "torch_dtype": dtype,
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.value("tokenizer.ggml.eos_token_id", None),
        }
        scaling = self._arch_value("rope.scaling.type", None)
        if scaling not in (None, "none"):
            cfg["rope_scaling"] = {"rope_type": str(scaling),
                                   "factor": float(self._arch_value("rope.scaling.factor", 1.0))}
        return cfg

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, dequantized to float32, under its Hugging Face name (Q/K rows un-permuted)."""
        heads = int(self._arch_value("attention.head_count"))
        kv_heads = int(self._arch_value("attention.head_count_kv", heads))
        for t in self.reader.tensors:
            yield _hf_tensor(self.arch, heads, kv_heads, t.name, t.data, int(t.tensor_type), t.shape.tolist())

    def tensor_index(self) -> dict[str, Any]:
        """What loading the tensors needs, as JSON (indexed_tensors reads the file with it)."""
        heads = int(self._arch_value("attention.head_count"))
        return {"arch": self.arch, "heads": heads,
                "kv_heads": int(self._arch_value("attention.head_count_kv", heads)),
                "tensors": [{"name": t.name, "type": int(t.tensor_type), "dims": [int(d) for d in t.shape],
                             "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in self.reader.tensors]}

    @staticmethod
    def hf_name(name: str) -> str:
        """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; unknown names pass through
        (the loader warns about tensors with no matching parameter)."""
        m = _BLOCK_NAME.match(name)
        if m and m.group(2) in _BLOCK:
            return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
        stem, _, kind = name.rpartition(".")
        return f"{_GLOBAL[stem]}.{kind}" if stem in _GLOBAL else name


def _hf_tensor(arch: str, heads: int, kv_heads: int, name: str, data: np.ndarray, qtype: int,
               dims: list[int]) -> tuple[str, torch.Tensor]:
    """One tensor as the reader lays it out (float32/float16 elements, or the bytes of quantized rows; ``dims`` in
    ggml's order, fastest first) -> its Hugging Face name and float32 values (Q/K rows un-permuted)."""
    from gguf import GGMLQuantizationType, quants
    hf = GGUFCheckpoint.hf_name(name)
    shape = tuple(int(d) for d in reversed(dims))
    qt = GGMLQuantizationType(qtype)
    if qt.name in _BLOCK_BYTES:
        tensor = _dequantize_blocks(data, qt).reshape(shape)
    else:
        tensor = torch.from_numpy(np.array(quants.dequantize(data, qt), dtype=np.float32, copy=True).reshape(shape))
    if arch in _QK_PERMUTED and hf.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        tensor = unpermute_rows(tensor, heads)
    elif arch in _QK_PERMUTED and hf.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        tensor = unpermute_rows(tensor, kv_heads)
    return hf, tensor


_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # 32 values a block: a float16 scale (Q4_1: and minimum), codes


def _dequantize_blocks(data: np.ndarray, qtype: Any) -> torch.Tensor:
    """Q4_0, Q4_1 and Q8_0 data (the default model's types) as float32 values, flat: the gguf package's arithmetic
    (scale x code, Q4_1 plus its minimum; the low nibbles of a block's 16 bytes are its first 16 codes, the high
    ones the next 16), in whole-tensor torch ops instead of its numpy over groups of rows (2 s of a 7.6 s start-up
    on a 2-core AVX2 host). Bit for bit the same: tests compare the weights with transformers' GGUF load."""
    size = _BLOCK_BYTES[qtype.name]
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True).reshape(-1, size))
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if qtype.name == "Q8_0":
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * scale).reshape(-1)
    codes = blocks[:, 4:] if qtype.name == "Q4_1" else blocks[:, 2:]
    q = torch.cat((codes & 0x0F, codes >> 4), dim=1)
    if qtype.name == "Q4_0":
        return (scale * (q.to(torch.int8) - 8).float()).reshape(-1)
    return (scale * q.float() + blocks[:, 2:4].contiguous().view(torch.float16).float()).reshape(-1)


def indexed_tensors(path: Path, index: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """GGUFCheckpoint.tensors() of ``path`` from its ``tensor_index()`` record: the file memory-mapped, each
    tensor's bytes laid out as the gguf reader lays them out, no metadata parsed."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    end = max((t["offset"] + t["nbytes"] for t in index["tensors"]), default=0)
    if buf.shape[0] < end:
        raise ModelLoadError(f"{path} is shorter ({buf.shape[0]} bytes) than its recorded tensors ({end} bytes): "
                             f"truncated since it was converted? Remove its folder under the cache to convert anew")
    elements = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    for t in index["tensors"]:
        qtype = GGMLQuantizationType(t["type"])
        np_dims = tuple(reversed(t["dims"]))
        raw = buf[t["offset"]:t["offset"] + t["nbytes"]]
        data = (raw.view(elements[qtype]).reshape(np_dims) if qtype in elements
                else raw.reshape(quant_shape_to_byte_shape(np_dims, qtype)))
        yield _hf_tensor(index["arch"], index["heads"], index["kv_heads"], t["name"], data, t["type"], t["dims"])


def read_index(folder: Path) -> dict[str, Any] | None:
    """The tensor index source.py recorded in a converted folder, or None (converted before it was recorded)."""
    path = folder / INDEX_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def convert_tokenizer(path: Path, out: Path) -> None:
    """Write the GGUF's tokenizer (and chat template) as Hugging Face tokenizer files, converted by transformers."""
    import logging as _logging

    from transformers import AutoTokenizer
    quiet = _logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(_logging.ERROR)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"transformers could not build a tokenizer from {path}'s tokenizer.ggml.* metadata: "
                             f"{type(e).__name__}: {e}") from e
    finally:
        quiet.setLevel(level)
    tok.save_pretrained(str(out))
