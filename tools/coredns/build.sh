#!/usr/bin/env bash
# Builds the pinned CoreDNS (tools/coredns/go.mod) once into $KAREUS_KUBE_CACHE/../coredns/<version>/coredns
# and prints the binary's path. About 3 min cold on 2 cores.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v go >/dev/null || { echo "coredns: the Go toolchain is needed (go not on PATH)" >&2; exit 1; }
version="$(awk '$1 == "require" && $2 == "github.com/coredns/coredns" {print $3} $1 == "github.com/coredns/coredns" {print $2}' "$here/go.mod" | head -1)"
cache="${KAREUS_COREDNS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kareus/coredns}"
bin="$cache/$version/coredns"
if [[ -x "$bin" ]]; then echo "$bin"; exit 0; fi
echo "coredns: building $version (first time only)" >&2
mkdir -p "$cache/$version"
cd "$here"
CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod" go build -trimpath -ldflags "-s -w" -o "$bin.partial" github.com/coredns/coredns
mv "$bin.partial" "$bin"
echo "$bin"
