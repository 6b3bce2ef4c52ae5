#!/usr/bin/env bash
# One command: set up everything (scripts/setup.sh), then run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/engine -k radix
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV="${SPLITSERVE_VENV:-.venv}"
# Rust unit tests of the router workspace (prefix tree, policies, breaker, limits, ...).
# Set SPLITSERVE_SKIP_CARGO_TEST=1 to run only pytest.
if [ "${SPLITSERVE_SKIP_CARGO_TEST:-0}" != "1" ]; then
  cargo test --locked -j 2 --workspace --exclude splitserve-router-py
fi
exec "$VENV/bin/python" -m pytest "$@"
