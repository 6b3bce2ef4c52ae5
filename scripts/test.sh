#!/usr/bin/env bash
# One command: set up everything (scripts/setup.sh), then run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/engine -k radix
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV="${SPLITSERVE_VENV:-.venv}"
exec "$VENV/bin/python" -m pytest "$@"
