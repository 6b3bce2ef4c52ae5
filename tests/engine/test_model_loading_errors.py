"""A model folder we cannot serve fails at start with a message naming what is wrong."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models import ModelLoadError, load_arch_config
from engine.models.loader import load_model
from engine.models.source import resolve_model_path
from tests.helpers import REPO, write_gguf


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_arch_config(d)


def test_missing_files_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_arch_config(tmp_path)
    d = copy_model(tiny_model_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(d, "auto", __import__("torch").device("cpu"), "auto")


def test_missing_tensor_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    d = copy_model(tiny_model_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.1.mlp.down_proj.weight"):
        load_model(d, "auto", __import__("torch").device("cpu"), "auto")


def test_server_exits_nonzero_with_the_message(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "engine", "--model-path", str(tmp_path), "--port", "1"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "no config.json" in proc.stderr and "Traceback" not in proc.stderr


def _gguf_variants(tmp: Path) -> dict[str, tuple[Path, str]]:
    """GGUFs we cannot serve, each with the words its error must contain."""
    import numpy as np
    from gguf import GGMLQuantizationType
    bad_arch = write_gguf(tmp / "gpt2.gguf", "gpt2")
    no_tok = write_gguf(tmp / "notok.gguf", tokenizer=False)
    whole = write_gguf(tmp / "whole.gguf").read_bytes()
    truncated = tmp / "truncated.gguf"
    truncated.write_bytes(whole[:len(whole) // 3])
    bad_type = tmp / "q8k.gguf"
    from gguf import GGUFWriter
    w = GGUFWriter(str(bad_type), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 292), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"architecture": (bad_arch, "GGUF architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"),
            "tokenizer": (no_tok, "has no tokenizer (no tokenizer.ggml.tokens"),
            "truncated": (truncated, "is not a readable GGUF file (truncated or corrupt?)"),
            "quantization": (bad_type, "tensors of type Q8_K, which the gguf package cannot dequantize; "
                                       "supported: ")}


def test_unservable_gguf_files_are_named(tmp_path: Path) -> None:
    for kind, (path, message) in _gguf_variants(tmp_path).items():
        with pytest.raises(ModelLoadError, match=re.escape(message)):
            resolve_model_path(str(path), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("gguf/*")), "a failed conversion left a folder in the cache"


def test_ambiguous_or_wrong_paths_are_named(tmp_path: Path) -> None:
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tmp_path / "two" / name)
    with pytest.raises(ModelLoadError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\); pass the one"):
        resolve_model_path(str(tmp_path / "two"), cache_dir=tmp_path / "cache")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="is a file but not a .gguf"):
        resolve_model_path(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("module", ["engine", "prefill_worker", "decode_worker"])
def test_every_server_exits_2_naming_what_is_wrong_with_a_gguf(tmp_path: Path, module: str) -> None:
    kinds = _gguf_variants(tmp_path)
    for kind in (["architecture", "tokenizer", "truncated", "quantization"] if module == "engine" else ["tokenizer"]):
        path, message = kinds[kind]
        proc = subprocess.run([sys.executable, "-m", module, "--model-path", str(path), "--port", "1"],
                              capture_output=True, text=True, timeout=120, cwd=REPO,
                              env={**os.environ, "SPLITSERVE_CACHE": str(tmp_path / "cache")})
        assert proc.returncode == 2, (kind, proc.returncode, proc.stderr[-2000:])
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"python -m {module}: error: ") and message in last, (kind, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
