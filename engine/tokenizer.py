"""Tokenizer and chat template, loaded with transformers from the model folder.

``fewest_tokens(chars)`` is a lower bound on how many tokens a text of ``chars`` characters becomes: no
token stands for more characters than its longest vocabulary piece (byte-level BPE writes one character per byte,
SentencePiece one per character), halved to leave room for normalizers that shorten text. A server uses it to
refuse a prompt that cannot fit the context before spending seconds tokenizing megabytes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.models.config import ModelLoadError
from engine.sampling_params import InvalidRequestError


# tokenizer_config.json's classes that are transformers' tokenizers-backed tokenizer itself
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _load_hf(model_dir: Path) -> Any:
    """transformers' tokenizer of the folder. Where tokenizer_config.json names the generic tokenizers-backed class
    (converted GGUFs, the tiny model) that class loads it directly: it is what AutoTokenizer would build, and
    importing AutoTokenizer builds transformers' registry of every model (~2 s of a ~10 s start-up on a 2-core
    AVX2 host)."""
    config = model_dir / "tokenizer_config.json"
    meta = json.loads(config.read_text()) if config.is_file() else {}
    if (model_dir / "tokenizer.json").is_file() and meta.get("tokenizer_class") in _GENERIC_CLASSES \
            and "auto_map" not in meta:
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer.model").is_file():
            raise ModelLoadError(f"{model_dir} has no tokenizer.json (or tokenizer.model)")
        self.hf = _load_hf(model_dir)
        self._fast = getattr(self.hf, "_tokenizer", None)  # the Rust tokenizer, for quick decodes
        self.vocab_size = len(self.hf)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        eos = self.hf.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if isinstance(eos, int) else ()
        self.max_piece_chars = max((len(p) for p in self.hf.get_vocab()), default=1)

    def fewest_tokens(self, chars: int) -> int:
        """A lower bound on len(encode(text)) for a text of ``chars`` characters (see the module docstring)."""
        return chars // (2 * self.max_piece_chars)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)

    @property
    def renders_tools(self) -> bool:
        """The chat template renders a ``tools`` list itself."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if not self.has_chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions",
                                      param="messages")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **({"tools": tools} if tools else {}))
        except Exception as e:  # jinja errors from user-controlled content are client errors
            raise InvalidRequestError(f"chat template failed: {e}", param="messages") from e
        return text
