#!/usr/bin/env bash
# Build the helm CLI from the Go module proxy into the user's cache, once per version, and print its path.
#   deploy/helm/install-helm.sh            -> ~/.cache/splitserve/tools/helm-v3.22.0/helm
# HELM_VERSION picks another release; SPLITSERVE_CACHE / XDG_CACHE_HOME move the cache like the rest of SplitServe.
# The chart tests (tests/deploy) find helm there, or at $SPLITSERVE_HELM. The first build takes a few minutes
# (Go's module and build caches make later ones fast); nothing is fetched once the binary is cached.
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CACHE="${SPLITSERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/splitserve}"
DIR="$CACHE/tools/helm-$HELM_VERSION"

if [ ! -x "$DIR/helm" ]; then
  if ! command -v go >/dev/null 2>&1; then
    echo "install-helm: the Go toolchain is needed to build helm (apt-get install golang-go, or https://go.dev/dl)" >&2
    exit 1
  fi
  mkdir -p "$CACHE/tools"
  tmp="$(mktemp -d "$CACHE/tools/.helm-$HELM_VERSION.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  echo "install-helm: building helm $HELM_VERSION with 'go install' into $DIR (first time only)" >&2
  GOBIN="$tmp" CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath" go install \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
  # Publish atomically: a concurrent run either sees no binary or a whole one.
  mkdir -p "$tmp/out" && mv "$tmp/helm" "$tmp/out/helm"
  if ! mv -T "$tmp/out" "$DIR" 2>/dev/null && [ ! -x "$DIR/helm" ]; then
    echo "install-helm: could not move the built helm into $DIR" >&2
    exit 1
  fi
fi
echo "$DIR/helm"
