"""values.schema.json makes a wrong value fail at install time: ``helm template`` (which checks the schema the same
way ``helm install`` does) refuses each of these with a message that points at the value."""
from __future__ import annotations

import pytest

from tests.deploy.chart import template

BAD = [
    (["prefill.replicas=four"], "prefill"),
    (["decode.replica=2"], "replica"),
    (["transfer.protocol=roce"], "protocol"),
    (["transfer.protocol=rdma"], "enabled"),  # RDMA without the devices
    (["model.source=s3"], "source"),
    (["model.source=pvc"], "path"),  # a model volume without a folder in it
    (["router.service.type=ExternalName"], "type"),
    (["router.policy=least_loaded"], "policy"),
    (["workerPort=70000"], "workerPort"),
    (["prefill.gpus=-1"], "gpus"),
    (["metrics.serviceMonitor.interval=soon"], "interval"),
]


@pytest.mark.parametrize("sets, mentions", BAD, ids=[s[0] for s, _ in BAD])
def test_bad_value_is_refused(sets: list[str], mentions: str) -> None:
    res = template(None, *sets, check=False)
    assert res.returncode != 0, f"--set {sets} was accepted"
    assert "values don't meet the specifications of the schema" in res.stderr, res.stderr
    assert mentions in res.stderr, res.stderr


def test_good_overrides_are_accepted() -> None:
    res = template(None, "prefill.replicas=3", "decode.gpus=2", "router.service.type=LoadBalancer",
                   "transfer.protocol=rdma", "transfer.rdma.enabled=true", check=False)
    assert res.returncode == 0, res.stderr
