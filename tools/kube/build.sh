#!/usr/bin/env bash
# Builds the pinned control plane into a cache outside the work tree, once per version:
#   $KAREUS_KUBE_CACHE/<kubernetes version>/bin/{etcd,kube-apiserver,kube-controller-manager,kube-scheduler,kubectl}
# Prints the bin directory. A prebuilt set is used instead when KAREUS_KUBE_BIN (or
# envtest's KUBEBUILDER_ASSETS) names a directory holding all five binaries.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)

have_all() {
	local dir="$1" name
	for name in "${binaries[@]}"; do [[ -x "$dir/$name" ]] || return 1; done
}

for prebuilt in "${KAREUS_KUBE_BIN:-}" "${KUBEBUILDER_ASSETS:-}"; do
	if [[ -n "$prebuilt" ]]; then
		if have_all "$prebuilt"; then echo "$prebuilt"; exit 0; fi
		echo "kube: $prebuilt lacks one of ${binaries[*]}" >&2; exit 1
	fi
done

command -v go >/dev/null || { echo "kube: the Go toolchain is needed to build the control plane (go not on PATH)" >&2; exit 1; }
version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2}' "$here/go.mod")"
[[ -n "$version" ]] || { echo "kube: no k8s.io/kubernetes version in $here/go.mod" >&2; exit 1; }
cache="${KAREUS_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kareus/kube}"
bin="$cache/$version/bin"
if have_all "$bin"; then echo "$bin"; exit 0; fi

mkdir -p "$bin.partial"
# Keep what an earlier build of the same version made (a cache from before kubelet and kube-proxy
# were added builds only those two).
[[ -d "$bin" ]] && cp -n "$bin"/* "$bin.partial/" 2>/dev/null || true
major="${version#v}"; minor="${major#*.}"; major="${major%%.*}"; minor="${minor%%.*}"
# Version stamps as the upstream release build sets them, so kubectl and the
# version-skew checks see a real release and not v0.0.0-master.
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	stamp+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
	stamp+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
echo "kube: building $version into $bin (first time only; about 10 min on 2 cores)" >&2
cd "$here"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod"
start=$(date +%s)
[[ -x "$bin.partial/etcd" ]] || go build -trimpath -ldflags "-s -w$stamp" -o "$bin.partial/etcd" go.etcd.io/etcd/server/v3
for name in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do
	[[ -x "$bin.partial/$name" ]] && continue
	go build -trimpath -ldflags "-s -w$stamp" -o "$bin.partial/$name" "k8s.io/kubernetes/cmd/$name"
done
rm -rf "$bin" && mv "$bin.partial" "$bin"
echo "kube: built in $(( $(date +%s) - start )) s" >&2
echo "$bin"
