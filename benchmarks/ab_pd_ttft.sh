#!/usr/bin/env bash
# Interleaved A/B of PD time to first token: `splitserve up` (default model) at REV against the working tree,
# each driven by `splitserve bench` (random prompts, concurrency 1). Rounds alternate old/new.
#   benchmarks/ab_pd_ttft.sh REV [ROUNDS]        e.g. benchmarks/ab_pd_ttft.sh c9a5ccc 2
set -euo pipefail
rev=$1; rounds=${2:-2}
repo=$(cd "$(dirname "$0")/.." && pwd); py=$repo/.venv/bin/python
old=$(mktemp -d /tmp/splitserve-ab-XXXX); out=$(mktemp -d /tmp/splitserve-ab-out-XXXX)
git -C "$repo" worktree add -q "$old/tree" "$rev"
cp "$repo"/router/_router*.so "$old/tree/router/"  # the router extension is a build output
trap 'git -C "$repo" worktree remove --force "$old/tree"' EXIT
for round in $(seq 1 "$rounds"); do
  for side in old new; do
    dir=$repo; [ "$side" = old ] && dir=$old/tree
    tag=$side-$round
    (cd "$dir" && exec "$py" -m splitserve up --port 0 --run-dir "$out/$tag") > "$out/$tag.up" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do grep -q "SplitServe is ready" "$out/$tag.up" && break; sleep 1; done
    url=$(grep -o "router at http://[0-9.:]*" "$out/$tag.up" | head -1 | cut -d' ' -f3)
    "$py" -m benchmarks.bench_serving --base-url "$url" --workload random --num-prompts 24 --input-len 256 \
      --output-len 32 --max-concurrency 1 --output "$out/$tag.json" > "$out/$tag.bench" 2>&1
    kill -INT "$pid"; wait "$pid" || true
    echo "$tag $(grep -E 'TTFT p50|ITL p50' "$out/$tag.bench" | tr -s ' |' ' ' | tr '\n' ' ')"
  done
done
