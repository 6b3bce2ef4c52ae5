#!/usr/bin/env bash
# Install the third-party load generators the tests drive against a cluster, each from PyPI into its own
# virtualenv in the user's cache (their pins clash with ours: aiperf wants pandas 2 and an older transformers),
# once per version, and print the path of each CLI, one a line:
#   scripts/install-load-tools.sh   -> ~/.cache/splitserve/tools/guidellm-0.8.1/bin/guidellm
#                                      ~/.cache/splitserve/tools/aiperf-0.13.0/bin/aiperf
# GUIDELLM_VERSION / AIPERF_VERSION pick other releases (their CLIs change between releases: guidellm 0.8 took
# `run --backend kind=...` over 0.7's `benchmark --target`); SPLITSERVE_CACHE / XDG_CACHE_HOME move the cache like
# the rest of SplitServe; PYTHON picks the interpreter (3.10 or later). Nothing is fetched once both are installed.
set -euo pipefail

GUIDELLM_VERSION="${GUIDELLM_VERSION:-0.8.1}"
AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
PYTHON="${PYTHON:-python3}"
CACHE="${SPLITSERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/splitserve}"
mkdir -p "$CACHE/tools"

install_tool() {  # NAME VERSION: a virtualenv at its final path (scripts in a venv name it), marked when whole
  local name="$1" version="$2" dir="$CACHE/tools/$1-$2"
  (
    flock 9  # one installer at a time per tool; the others wait, then find it installed
    if [ ! -f "$dir/.installed" ]; then
      rm -rf "$dir"
      echo "install-load-tools: installing $name $version into $dir (first time only)" >&2
      "$PYTHON" -m venv "$dir"
      "$dir/bin/python" -m pip install -q --upgrade pip >&2
      "$dir/bin/python" -m pip install -q "$name==$version" >&2
      touch "$dir/.installed"
    fi
  ) 9>"$CACHE/tools/.$name-$version.lock"
  echo "$dir/bin/$name"
}

install_tool guidellm "$GUIDELLM_VERSION"
install_tool aiperf "$AIPERF_VERSION"
