"""The Helm chart under test, driven through the real ``helm`` binary, and strict offline validation of what it
renders: built-in kinds against the Kubernetes API schemas that kubernetes-validate ships, the ServiceMonitor CRD
against tests/deploy/schemas. Nothing is fetched: helm comes from the cache deploy/helm/install-helm.sh fills."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml

from tests.helpers import REPO

CHART = REPO / "deploy" / "helm" / "splitserve"
EXAMPLES = sorted((CHART / "ci").glob("*-values.yaml"))
HELM_VERSION = "v3.22.0"
# The chart's lowest supported Kubernetes (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
SCHEMAS = Path(__file__).parent / "schemas"


def helm() -> str:
    """The helm binary: $SPLITSERVE_HELM, the install script's cache, or PATH. Missing helm fails the test with
    the command that installs it (scripts/test.sh runs that command)."""
    cache_root = Path(os.environ.get("SPLITSERVE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME")
                                                                  or Path.home() / ".cache") / "splitserve")
    for candidate in (os.environ.get("SPLITSERVE_HELM"), cache_root / "tools" / f"helm-{HELM_VERSION}" / "helm",
                      shutil.which("helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail("helm is not installed: run deploy/helm/install-helm.sh (scripts/test.sh does)")


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)
    if check and res.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({res.returncode}):\n{res.stderr}{res.stdout}")
    return res


def values_args(values: Path | None, sets: tuple[str, ...] = ()) -> list[str]:
    out = ["-f", str(values)] if values else []
    for s in sets:
        out += ["--set", s]
    return out


def lint(values: Path | None) -> subprocess.CompletedProcess:
    return run_helm("lint", "--strict", "--kube-version", KUBE_VERSIONS[0], str(CHART), *values_args(values))


def template(values: Path | None = None, *sets: str, release: str = "rel", namespace: str = "serving",
             check: bool = True) -> subprocess.CompletedProcess:
    return run_helm("template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSIONS[-1],
                    *values_args(values, sets), check=check)


@cache
def render(values: Path | None = None, *sets: str) -> tuple[dict, ...]:
    return tuple(d for d in yaml.safe_load_all(template(values, *sets).stdout) if d)


def find(docs: tuple[dict, ...], kind: str, name_suffix: str = "") -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(hits) == 1, f"expected one {kind} named *{name_suffix}, got {[d['metadata']['name'] for d in hits]}"
    return hits[0]


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


@cache
def _crd_validator(kind: str, version: str) -> jsonschema.Validator:
    schema = json.loads((SCHEMAS / f"{kind.lower()}-monitoring-v1.json").read_text())
    defs_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local-strict"
    defs = json.loads((defs_dir / "_definitions.json").read_text())
    registry = referencing.Registry().with_resource(
        "https://kubernetes.io/api/_definitions.json", referencing.Resource.from_contents(defs))
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_strict(doc: dict[str, Any], version: str) -> None:
    """Raises jsonschema.ValidationError (or SchemaNotFoundError for a kind with no schema here)."""
    if doc.get("apiVersion") == "monitoring.coreos.com/v1":
        exact = next(v for v in kubernetes_validate.utils.all_versions() if v.startswith(version.rsplit(".", 1)[0]))
        _crd_validator(doc["kind"], exact).validate(doc)
        return
    kubernetes_validate.validate(doc, version, strict=True)
