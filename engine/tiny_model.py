"""The built-in tiny model: a Llama-architecture checkpoint with seeded random weights and a byte-level BPE
tokenizer trained locally on text that ships with Python (the interpreter's own documentation topics and a few
stdlib sources). It is written as a normal Hugging Face folder that transformers also loads. Same seed and
same Python version give the same bytes."""
from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_MODEL_VERSION = "v1"
DEFAULT_SEED = 0
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 4096
ARCH = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
# A wide initializer keeps the random model's output varied and prompt-dependent, so token-identity tests bite.
INIT_STD = 0.1
_CORPUS = ("pydoc_data/topics.py", "textwrap.py", "string.py", "argparse.py", "json/__init__.py", "this.py")


def default_cache_dir() -> Path:
    root = os.environ.get("SPLITSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "splitserve")
    return Path(root)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in _CORPUS]


def train_tokenizer(out: Path) -> int:
    """Train the byte-level BPE tokenizer and write tokenizer.json; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok.get_vocab_size()


def _weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                         "lm_head.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shapes[name])
        else:
            out[name] = torch.randn(shapes[name], generator=gen) * INIT_STD
    return out


def write_tiny_model(out: Path, seed: int = DEFAULT_SEED) -> Path:
    """Write the tiny model into ``out`` (created if needed) and return it."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out)
    bos, eos, im_end, pad = (SPECIAL_TOKENS.index(t) for t in
                             ("<|begin_of_text|>", "<|end_of_text|>", "<|im_end|>", "<|pad|>"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        **ARCH, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": bos, "eos_token_id": [eos, im_end], "pad_token_id": pad, "torch_dtype": "float32",
        "initializer_range": INIT_STD,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": [eos, im_end], "pad_token_id": pad}, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[bos],
        "eos_token": SPECIAL_TOKENS[im_end], "pad_token": SPECIAL_TOKENS[pad], "add_bos_token": False,
        "model_max_length": ARCH["max_position_embeddings"], "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": SPECIAL_TOKENS[bos], "eos_token": SPECIAL_TOKENS[im_end], "pad_token": SPECIAL_TOKENS[pad],
    }, indent=2, sort_keys=True) + "\n")
    save_file(_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Return the cached tiny model folder, generating it once (atomically, safe across processes)."""
    target = (cache_dir or default_cache_dir()) / f"tiny-model-{TINY_MODEL_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=target.parent))
    try:
        write_tiny_model(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
