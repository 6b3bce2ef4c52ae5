"""Write a benchmark model (SmolLM2's GGUF by default) as a Hugging Face safetensors folder, for peers that read
only those (vLLM's CPU build), or an early-exit draft of it: its first N decoder layers with its own final norm and
LM head (config.json says num_hidden_layers = N), which shares the model's tokenizer by construction. No smaller
model with SmolLM2's tokenizer ships here; the early-exit draft is the cheapest draft of it there is. Untrained
for exit at layer N, it agrees with the full model far less often than a distilled draft would (bench_spec
measures how often).

    python -m benchmarks.export_checkpoint --out /tmp/smollm2-hf
    python -m benchmarks.export_checkpoint --layers 8 --out /tmp/smollm2-8l
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common import model_dir
from engine.models.loader import _checkpoint_tensors
from engine.models.source import resolve_model_path

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def export(model: str, out: Path, layers: int | None = None) -> Path:
    source = resolve_model_path(str(model_dir(model)))
    config = json.loads((source.folder / "config.json").read_text())
    layers = config["num_hidden_layers"] if layers is None else layers
    if not 0 < layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be from 1 to {config['num_hidden_layers']}")
    out.mkdir(parents=True, exist_ok=True)
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in _checkpoint_tensors(source.folder, source.gguf):
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < layers:
            kept[name] = tensor.to(torch.float32).contiguous()
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.update(num_hidden_layers=layers, torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in source.folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (default: all)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(export(args.model, args.out, args.layers))


if __name__ == "__main__":
    main()
