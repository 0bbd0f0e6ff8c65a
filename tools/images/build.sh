#!/usr/bin/env bash
# `make images`: builds Kareus's images from images/*.Dockerfile (and the dev cluster's CoreDNS image)
# without a Docker engine, and prints one line per image: "<reference> <docker-archive path>".
#
# - The Dockerfiles are the ones a user builds with `docker build`; only the build-arg BASE_IMAGE points
#   them at a Debian base made here with mmdebstrap from Debian's packages (no registry image can be
#   pulled on the project's machines).
# - buildah (daemonless, `--isolation chroot`) builds them; `--layers` keeps the runtime image's torch
#   layer between builds of new code.
# - Every archive is cached by the content hash of its inputs (the Dockerfile, the files it copies, the
#   base) in $KAREUS_IMAGE_CACHE (default ~/.cache/kareus/images), outside the work tree, and rebuilt only
#   when an input changes.
# - The images are tagged with the names the chart and examples/ use (localhost/kareus/<name>:<version>).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cache="${KAREUS_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kareus/images}"
storage="${KAREUS_BUILDAH_DRIVER:-overlay}"
version="$(awk -F'"' '/^version = / {print $2; exit}' "$root/pyproject.toml")"
mkdir -p "$cache"
log() { echo "images: $*" >&2; }
# One build at a time per cache: two would write the same archive and race on buildah's layer cache.
exec 9>"$cache/.build.lock"
flock 9

need() {
	local missing=()
	for tool in mmdebstrap buildah; do command -v "$tool" >/dev/null || missing+=("$tool"); done
	if ((${#missing[@]})); then
		[[ $(id -u) == 0 ]] || { log "needs ${missing[*]} (Debian packages; run as root to install them)"; exit 1; }
		log "installing ${missing[*]} from Debian's packages"
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap buildah >&2
	fi
}

bah() { buildah --storage-driver "$storage" "$@"; }

hash_of() { # the content hash of the given files and strings
	{ for item in "$@"; do if [[ -f "$item" ]]; then printf '%s\n' "${item#"$root"/}"; cat "$item"; else printf '%s\n' "$item"; fi; done; } \
		| sha256sum | cut -c1-16
}

# 1. The base: Debian bookworm minbase with Python, as python:3.11-slim-bookworm offers it (python, venv, CA
#    certificates), without documentation.
base_recipe="mmdebstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates bookworm nodoc"
base_hash="$(hash_of "$base_recipe")"
base_ref="localhost/kareus/base:bookworm-$base_hash"
base_tar="$cache/base-$base_hash.tar"
need
if [[ ! -s "$base_tar" ]]; then
	log "building the Debian base (about a minute)"
	mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
		--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
		--dpkgopt='path-exclude=/usr/share/locale/*' bookworm "$cache/base-$base_hash.partial.tar" >&2
	mv "$cache/base-$base_hash.partial.tar" "$base_tar"
fi
if ! bah inspect --type image "$base_ref" >/dev/null 2>&1; then
	c="$(bah from scratch)"
	bah add "$c" "$base_tar" / >/dev/null
	bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd python3 "$c"
	bah commit -q --rm "$c" "$base_ref" >/dev/null
fi

# A machine behind a TLS-inspecting proxy trusts its CA in the host bundle: RUN steps that reach PyPI get
# the host's bundle mounted (read-only, never copied into an image).
mounts=()
host_bundle=/etc/ssl/certs/ca-certificates.crt
[[ -f "$host_bundle" ]] && mounts+=(--volume "$host_bundle:$host_bundle:ro")

# build NAME DOCKERFILE CONTEXT FILE... : the archive of one image, built unless cached.
build() {
	local name="$1" dockerfile="$2" context="$3"; shift 3
	local ref="localhost/kareus/$name:$version"
	local h; h="$(hash_of "$dockerfile" "$base_hash" "$version" "$@")"
	local tar="$cache/$name-$h.tar"
	if [[ ! -s "$tar" ]]; then
		log "building $ref from ${dockerfile#"$root"/}"
		local start; start=$(date +%s)
		bah bud --quiet --layers --isolation chroot "${mounts[@]}" --build-arg "BASE_IMAGE=$base_ref" \
			--build-arg "KAREUS_VERSION=$version" -f "$dockerfile" -t "$ref" "$context" >&2
		rm -f "$tar.partial"
		bah push -q "$ref" "docker-archive:$tar.partial:$ref" >&2
		mv "$tar.partial" "$tar"
		# older archives of this image are never used again, nor are the layers only its older builds had
		# (untagged images without a child: the layer cache the current builds stand on stays)
		find "$cache" -maxdepth 1 -name "$name-*.tar" ! -name "$name-$h.tar" -delete
		bah rmi --prune >/dev/null 2>&1 || true
		log "built $ref in $(( $(date +%s) - start )) s ($(du -h "$tar" | cut -f1))"
	fi
	echo "$ref $tar"
}

mapfile -t sources < <(cd "$root" && git ls-files --cached --others --exclude-standard -- \
	pyproject.toml README.md requirements kareus operator node_daemon | grep -v -e '__pycache__' -e '\.pyc$' | sort | sed "s#^#$root/#")
names=("${@:-operator node-agent runtime coredns pause}")
for name in ${names[@]}; do
	case "$name" in
	coredns)
		bin="$(bash "$root/tools/coredns/build.sh")"
		ctx="$cache/coredns-context"; rm -rf "$ctx"; mkdir -p "$ctx"
		cp "$bin" "$ctx/coredns"; cp "$root/devcluster/images/coredns.Dockerfile" "$ctx/Dockerfile"
		build coredns "$ctx/Dockerfile" "$ctx" "$ctx/coredns" ;;
	pause)
		# upstream's pause.c, from the Kubernetes module tools/kube pins (go mod download is cached)
		src="$(cd "$root/tools/kube" && GOFLAGS=-mod=mod go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
		ctx="$cache/pause-context"; rm -rf "$ctx"; mkdir -p "$ctx"
		cp "$src" "$ctx/pause.c"
		gcc -Os -static -Wall -DVERSION=kareus-dev -o "$ctx/pause" "$ctx/pause.c"
		cp "$root/devcluster/images/pause.Dockerfile" "$ctx/Dockerfile"
		build pause "$ctx/Dockerfile" "$ctx" "$ctx/pause.c" ;;
	operator | node-agent | runtime)
		build "$name" "$root/images/$name.Dockerfile" "$root" "${sources[@]}" ;;
	*) log "unknown image $name (operator, node-agent, runtime, coredns, pause)"; exit 2 ;;
	esac
done
