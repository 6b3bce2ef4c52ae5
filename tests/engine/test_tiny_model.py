"""The built-in tiny model: same seed, same bytes; transformers loads it; its chat template renders."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.tiny_model import write_tiny_model
from splitserve.cli import main as splitserve_main

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def test_same_seed_gives_same_bytes_and_other_seed_differs(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a")
    splitserve_main(["tiny-model", "--out", str(tmp_path / "b")])
    c = write_tiny_model(tmp_path / "c", seed=1)
    for name in FILES:
        assert (a / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_transformers_loads_it_and_output_is_varied(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n_params < 20_000_000
    ids = tok("The quick brown fox")["input_ids"]
    assert tok.decode(ids) == "The quick brown fox"
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert len(set(out)) > 4, "greedy output should not be one token repeated"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
