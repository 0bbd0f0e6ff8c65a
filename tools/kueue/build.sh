#!/usr/bin/env bash
# Builds the pinned Kueue controller into a cache outside the work tree, once per version:
#   $KAREUS_KUEUE_CACHE/<kueue version>/{bin/kueue, crds/*.yaml, webhooks.yaml, rbac/*.yaml}
# The CRDs, the webhook list and the controller's ClusterRole are copied from the same module
# version, so the dev cluster installs exactly what that controller expects. Prints the directory.
# KAREUS_KUEUE_DIR names a prebuilt directory of that layout instead.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

have_all() { [[ -x "$1/bin/kueue" && -f "$1/webhooks.yaml" && -f "$1/rbac/role.yaml" && -f "$1/rbac/manager_secrets_role.yaml" && -d "$1/crds" ]]; }

if [[ -n "${KAREUS_KUEUE_DIR:-}" ]]; then
	if have_all "$KAREUS_KUEUE_DIR"; then echo "$KAREUS_KUEUE_DIR"; exit 0; fi
	echo "kueue: $KAREUS_KUEUE_DIR lacks bin/kueue, crds/, webhooks.yaml or rbac/role.yaml" >&2; exit 1
fi
command -v go >/dev/null || { echo "kueue: the Go toolchain is needed to build Kueue (go not on PATH)" >&2; exit 1; }
version="$(awk '$1 == "sigs.k8s.io/kueue" && $2 ~ /^v/ {print $2} $1 == "require" && $2 == "sigs.k8s.io/kueue" {print $3}' "$here/go.mod")"
[[ -n "$version" ]] || { echo "kueue: no sigs.k8s.io/kueue version in $here/go.mod" >&2; exit 1; }
cache="${KAREUS_KUEUE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kareus/kueue}"
out="$cache/$version"
if have_all "$out"; then echo "$out"; exit 0; fi
if [[ -n "${KAREUS_KUEUE_NO_BUILD:-}" ]]; then echo "kueue: $out is not built" >&2; exit 1; fi

echo "kueue: building $version into $out (first time only; about 8 min on 2 cores)" >&2
cd "$here"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod"
start=$(date +%s)
rm -rf "$out.partial" && mkdir -p "$out.partial/bin" "$out.partial/crds" "$out.partial/rbac"
go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$version" \
	-o "$out.partial/bin/kueue" sigs.k8s.io/kueue/cmd/kueue
src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
cp "$src"/config/components/crd/bases/*.yaml "$out.partial/crds/"
cp "$src/config/components/webhook/manifests.yaml" "$out.partial/webhooks.yaml"
cp "$src/config/components/rbac/role.yaml" "$src/config/components/rbac/manager_secrets_role.yaml" "$out.partial/rbac/"
chmod -R u+w "$out.partial"
rm -rf "$out" && mv "$out.partial" "$out"
echo "kueue: built in $(( $(date +%s) - start )) s" >&2
echo "$out"
