"""A model folder we cannot serve fails at start with a message naming what is wrong."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models import ModelLoadError, load_arch_config
from engine.models.loader import load_model
from tests.helpers import REPO


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
    assert proc.returncode != 0 and "no config.json" in proc.stderr
