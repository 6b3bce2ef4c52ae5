"""Load a Llama/Qwen2/Qwen3 checkpoint: a local Hugging Face folder (single or sharded safetensors), or a GGUF file
(models/gguf.py) whose converted config sits in ``model_dir`` (models/source.py)."""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.mem.huge_pages import libc, move_weights_to_huge_pages
from engine.models.config import ArchConfig, ModelLoadError, load_arch_config
from engine.models.cpu_gemm import can_prepack
from engine.models.linear import (lanes_without_onednn, packs_float32_for_lanes, prepack_linears, should_prepack,
                                  use_few_rows_kernel)
from engine.models.llama import CausalLM

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_STACKED = {  # HF module name -> (our fused module, position in the fused weight)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    dtype = DTYPES.get(checkpoint_dtype.replace("torch.", ""), torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        log.info("float16 checkpoint on CPU: running in float32 (pass --dtype float16 to force)")
        return torch.float32
    if device.type == "cpu" and dtype == torch.bfloat16 and not can_prepack(device, dtype):
        # no bfloat16 GEMM in hardware here (oneDNN's needs AVX-512 or AVX-NE-CONVERT): on an AVX2-only host a
        # bfloat16 SmolLM2 prefill of 512 tokens took 11.1 s against 2.4 s in float32; through the few-rows
        # kernel's float32 tiles (which widen the weights) 2.7 s, and a batch-1 decode step ~20 against ~28 ms, but
        # the checkpoint's bfloat16 is then a choice of speed over float32's accuracy, left to --dtype bfloat16
        log.info("bfloat16 checkpoint on a CPU without a bfloat16 GEMM: running in float32 (pass --dtype bfloat16 "
                 "to force)")
        return torch.float32
    return dtype


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"{model_dir} has no model.safetensors or model.safetensors.index.json (only safetensors checkpoints load)")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _checkpoint_tensors(model_dir: Path, gguf: Path | None) -> Iterator[tuple[str, torch.Tensor]]:
    if gguf is None:
        return _iter_tensors(_weight_files(model_dir))
    from engine.models.gguf import GGUFCheckpoint, indexed_tensors, read_index
    index = read_index(model_dir)  # model_dir: the GGUF's converted folder (source.py)
    return indexed_tensors(gguf, index) if index is not None else GGUFCheckpoint(gguf).tensors()


def _return_freed_heap() -> None:
    """Hands the heap's free pages back to the system (glibc's malloc_trim). Loading leaves hundreds of MB there
    that free() keeps: dequantized and cast temporaries, and the originals of weights moved into huge pages.
    SmolLM2 from its GGUF, in process after load: RSS 1,505 -> 812 MB in bfloat16, 1,384 -> 1,070 MB in float32,
    with or without huge pages."""
    c = libc()
    if c is not None and hasattr(c, "malloc_trim"):  # glibc's
        c.malloc_trim(0)


def load_model(model_dir: Path, dtype: str, device: torch.device, prepack: str,
               gguf: Path | None = None, huge_pages: bool = True) -> tuple[CausalLM, ArchConfig, torch.dtype]:
    """``prepack``: auto/on/off, whether to reorder the linear weights for the CPU GEMM (models/linear.py);
    ``gguf``: read the weights from this GGUF file (dequantized) instead of ``model_dir``'s safetensors;
    ``huge_pages``: on CPU, move the large weights into transparent huge pages (mem/huge_pages.py)."""
    start = time.monotonic()
    cfg = load_arch_config(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg.torch_dtype, device)
    tensors = _checkpoint_tensors(model_dir, gguf)
    with torch.device("meta"):
        model = CausalLM(cfg)
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        if "rotary_emb" in name:
            continue
        key = name[len("model."):] if name.startswith("model.") and not name.startswith("model.layers.") else name
        m = _LAYER.match(name)
        if m:
            layer, rest = m.groups()
            stem, _, kind = rest.rpartition(".")
            if stem in _STACKED:
                target, idx = _STACKED[stem]
                full = f"layers.{layer}.{target}.{kind}"
                pieces.setdefault(full, {})[idx] = tensor
                continue
            key = f"layers.{layer}.{rest}"
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key not in params:
            log.warning("ignoring checkpoint tensor %s (no matching parameter)", name)
            continue
        loaded[key] = tensor
    for full, parts in pieces.items():
        expected = 3 if ".qkv_proj." in full else 2
        if len(parts) != expected:
            raise ModelLoadError(f"checkpoint is missing parts of {full} (found shards {sorted(parts)})")
        loaded[full] = torch.cat([parts[i] for i in range(expected)], dim=0)
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ModelLoadError(f"checkpoint in {model_dir} lacks tensors: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    for key, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(params[key].shape):
            raise ModelLoadError(f"tensor {key} has shape {tuple(tensor.shape)}, config implies "
                                 f"{tuple(params[key].shape)}")
    model.load_state_dict({k: v.to(torch_dtype) for k, v in loaded.items()}, strict=False, assign=True)
    loaded.clear()
    pieces.clear()
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if huge_pages and device.type == "cpu":
        move_weights_to_huge_pages(model)
    if device.type == "cpu":
        _return_freed_heap()
    tied = model.embed_tokens.weight if cfg.tie_word_embeddings else None
    if should_prepack(prepack, device, torch_dtype) or packs_float32_for_lanes(prepack, model, device, torch_dtype):
        prepack_linears(model, tied)
    elif (route := lanes_without_onednn(prepack, model, device, torch_dtype)) is not None:
        prepack_linears(model, tied, route)
    elif device.type == "cpu":
        use_few_rows_kernel(model, tied, packed=prepack != "off", dtype=torch_dtype)
    log.info("loaded %s weights from %s as %s in %.1f s", cfg.architecture, gguf or model_dir,
             str(torch_dtype).replace("torch.", ""), time.monotonic() - start)
    return model, cfg, torch_dtype
