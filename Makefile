# Two commands matter: `make run` (the quickstart job end to end) and `make test` (the test suite).
# Both create .venv on a fresh machine and install everything they need into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The pinned torch (requirements/torch.txt, the one source of its version: the runtime image reads it
# too); on machines that ship it on disk pip takes that file.
TORCH_PIN := requirements/torch.txt

.PHONY: install kube kueue packages prometheus images test-deps test test-token-rotation golden run lint bench clean

# uv installs from its cache (~/.cache/uv) by hard links: a fresh clone's .venv (torch included, 5.4 GB)
# takes about 35 s once the cache holds the wheels, against about 2 min for pip. It compiles bytecode at
# install: machines that set PYTHONDONTWRITEBYTECODE would otherwise compile every import in every process
# (every torch rank), about 200 s more of `make test`. PIP_FIND_LINKS (a wheel directory some machines
# ship) is uv's too.
UV_VERSION := 0.13.9
UV := $(BIN)/uv
UV_INSTALL = $(UV) pip install --compile-bytecode --python $(BIN)/python $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

$(STAMP): pyproject.toml Makefile $(TORCH_PIN)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install uv==$(UV_VERSION)
	$(UV_INSTALL) --upgrade pip setuptools wheel
	$(UV_INSTALL) -r $(TORCH_PIN) -e ".[operator,node,train,dev]"
	touch $(STAMP)

install: $(STAMP)

# The pinned Kubernetes release (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
# and the nodes' kubelet and kube-proxy), built from the Go module proxy once into
# ~/.cache/kareus/kube/<version>/bin and reused; KAREUS_KUBE_BIN or KUBEBUILDER_ASSETS name prebuilt
# binaries instead. About 10 min cold on 2 cores.
kube:
	bash tools/kube/build.sh

# Debian's packages the tests run: Prometheus and promtool (2.42: the dev cluster's Prometheus, the live
# dashboard tests, `promtool test rules`), and the nodes' container stack (containerd, runc, the CNI
# plugins, iptables, conntrack) with the image builders (buildah, mmdebstrap). One apt run: two at once
# would fight over dpkg's lock.
DEB_PACKAGES := prometheus containerd runc containernetworking-plugins buildah mmdebstrap iptables conntrack iproute2
packages:
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
		--no-install-recommends $$missing; fi

prometheus: packages

# The Kueue controller (sigs.k8s.io/kueue, pinned in tools/kueue/go.mod) with its CRDs and webhook
# list, built once into ~/.cache/kareus/kueue/<version>; about 12 min cold on 2 cores.
kueue:
	bash tools/kueue/build.sh

# Kareus's images (images/*.Dockerfile) and the dev cluster's CoreDNS and pause images, built without a
# Docker engine (buildah on a Debian base made by mmdebstrap; Debian's containerd and runc run them), each
# cached by the content hash of its inputs in ~/.cache/kareus/images and rebuilt only when they change;
# then the store the dev cluster's nodes start from. About 15 min cold (the runtime image carries the
# pinned torch), 2-5 min after a change of code, seconds when nothing changed.
images: $(STAMP) packages
	$(BIN)/python -m kareus_devcluster.images

# What the tests need, built side by side (the Go builds use the CPUs, the images mostly the network
# and the disk), then the suite.
test-deps: $(STAMP) kube kueue packages images

# Three pytest-xdist workers, each module whole on one of them (tests/conftest.py's scheduler): the first
# two run the cluster modules, slowest first, each on a control plane and dev cluster of its own, which
# they stop when they move on to the CPU-bound modules; the third runs CPU-bound modules only, on the
# CPU the cluster modules leave idle while they wait on pods. The 30 slowest tests are listed at the end.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(MAKE) -j3 --output-sync=target test-deps
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --durations=30

# Opt-in, ~13 min of real time: the kubelet rotating a training pod's node-agent token (600 s, the
# API server's floor) under a held clock lease. Not part of `test`, whose budget it does not fit.
test-token-rotation: $(STAMP)
	$(MAKE) -j3 --output-sync=target test-deps
	KAREUS_TOKEN_ROTATION=1 $(BIN)/python -m pytest -q -p no:cacheprovider -s tests/test_token_rotation.py

# Regenerate the golden loss files (tests/data/golden) after a change meant to move the loss curves;
# say why in the commit. `make golden CASES="tp1_pp1"` regenerates some of them.
golden: $(STAMP)
	$(BIN)/python tests/golden_losses.py $(CASES)

run: $(STAMP)
	$(BIN)/kareus run examples/quickstart.yaml --out out/quickstart

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/yamllint -s crds examples

clean:
	rm -rf $(VENV) out .pytest_cache
