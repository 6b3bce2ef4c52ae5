"""The served OpenAPI document matches what the server accepts and answers: schemathesis (PyPI) generates
requests from it, valid and invalid, against a colocated server and the router in front of it, and fails on any
5xx, an undocumented status, a content type the document does not list, or a body that breaks its schema.
Bounded: a few examples per operation, a 128-token context so every generated request is short."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from tests.helpers import ServerProcess

CHECKS_OFF = ("positive_data_acceptance",)  # a schema-valid body may still be refused (a model name, the context)


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerProcess]:
    srv = ServerProcess("engine", ["--model-path", "tiny", "--max-total-tokens", "4096", "--context-length",
                                   "128"]).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def front(small_server: ServerProcess) -> Iterator[ServerProcess]:
    r = ServerProcess("router.launch_router", ["--worker-urls", small_server.url]).wait_ready(path="/readiness")
    yield r
    r.stop()


@pytest.fixture(scope="module", params=["worker", "router"])
def api_schema(request: pytest.FixtureRequest, small_server: ServerProcess):  # noqa: ANN201
    base = small_server.url if request.param == "worker" else request.getfixturevalue("front").url
    return schemathesis.openapi.from_url(base + "/openapi.json")


def test_every_operation_answers_as_documented(api_schema) -> None:  # noqa: ANN001
    from hypothesis import given
    from schemathesis.specs.openapi import checks
    excluded = [getattr(checks, name) for name in CHECKS_OFF if hasattr(checks, name)]
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert len(operations) >= 13
    for op in operations:
        @settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case) -> None:  # noqa: ANN001
            case.call_and_validate(timeout=60, excluded_checks=excluded)
        check()
