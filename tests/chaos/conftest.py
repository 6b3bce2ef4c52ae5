"""Abuse and fault tests (issue "Hardening"): bounded, loopback only. Cluster fixtures come from tests/pd."""
from __future__ import annotations

from tests.pd.conftest import cluster, tiny_model_dir  # noqa: F401  (fixtures)
