"""The chart passes the real ``helm lint --strict`` and ``helm template`` on its default values and on every example
in deploy/helm/splitserve/ci (PD at scale with RDMA, autoscaling, hostPath, a created PVC), and every manifest it
renders validates strictly (no unknown field) against the Kubernetes API schemas, offline, for the oldest and newest
Kubernetes versions it supports. The YAML manifests in docs/deploy.md are held to the same standard."""
from __future__ import annotations

import copy
import re

import jsonschema
import pytest
import yaml

from tests.deploy.chart import EXAMPLES, KUBE_VERSIONS, lint, render, validate_strict
from tests.helpers import REPO

VALUE_SETS = [None, *EXAMPLES]
IDS = ["default", *[p.stem for p in EXAMPLES]]


@pytest.mark.parametrize("values", VALUE_SETS, ids=IDS)
def test_lint_passes_and_every_rendered_manifest_is_strictly_valid(values) -> None:
    res = lint(values)
    assert "0 chart(s) failed" in res.stdout, res.stdout
    docs = render(values)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Role", "RoleBinding"} <= kinds
    for doc in docs:
        for version in KUBE_VERSIONS:
            try:
                validate_strict(doc, version)
            except jsonschema.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version} at "
                            f"{'.'.join(map(str, e.absolute_path))}: {e.message}")


def test_the_examples_cover_every_optional_kind() -> None:
    kinds = {d["kind"] for values in VALUE_SETS for d in render(values)}
    assert {"ServiceAccount", "Secret", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor",
            "PersistentVolumeClaim"} <= kinds


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d["spec"].__setitem__("replica", 3), "unknown field"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("ports", [{"containerPort": "http"}]),
     "wrong type"),
], ids=["unknown-field", "wrong-type"])
def test_the_validation_bites(mutate, where) -> None:
    """A check that cannot fail proves nothing: a broken Deployment must be refused."""
    deployment = copy.deepcopy(next(d for d in render(None) if d["kind"] == "Deployment"))
    mutate(deployment)
    with pytest.raises(jsonschema.ValidationError):
        validate_strict(deployment, KUBE_VERSIONS[-1])
    monitor = copy.deepcopy(next(d for d in render(EXAMPLES[0]) if d["kind"] == "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate_strict(monitor, KUBE_VERSIONS[-1])


def test_manifests_in_the_deployment_guide_are_strictly_valid() -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "apiVersion:" in b]
    assert blocks, "docs/deploy.md has no manifest"
    for block in blocks:
        for doc in (d for d in yaml.safe_load_all(block) if d):
            for version in KUBE_VERSIONS:
                validate_strict(doc, version)
