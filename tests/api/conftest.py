"""A PD cluster on the real model (SmolLM2-135M-Instruct: prefill and decode workers over shared memory, the Rust
router in front) and the real ``openai`` client pointed at the router."""
from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from engine.models.source import default_model_file
from tests.pd.conftest import Cluster, run_cluster


@pytest.fixture(scope="package")
def pd() -> Iterator[Cluster]:
    yield from run_cluster(default_model_file())


@pytest.fixture(scope="package")
def client(pd: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd.router.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
