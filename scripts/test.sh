#!/usr/bin/env bash
# One command: set up everything (scripts/setup.sh), then run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/engine -k radix
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV="${SPLITSERVE_VENV:-.venv}"
# helm for the chart tests (tests/deploy): built once from the Go module proxy into ~/.cache/splitserve/tools.
deploy/helm/install-helm.sh >/dev/null
# guidellm and aiperf for tests/api/test_load_generators_run_clean_through_pd.py: each from PyPI into its own
# virtualenv in the same cache, once per version.
./scripts/install-load-tools.sh >/dev/null
# Rust unit tests of the router workspace (prefix tree, policies, breaker, limits, ...).
# Set SPLITSERVE_SKIP_CARGO_TEST=1 to run only pytest.
if [ "${SPLITSERVE_SKIP_CARGO_TEST:-0}" != "1" ]; then
  cargo test --locked -j 2 --workspace --exclude splitserve-router-py
fi
exec "$VENV/bin/python" -m pytest "$@"
