# Two commands matter: `make run` (the quickstart job end to end) and `make test` (the test suite).
# Both create .venv on a fresh machine and install everything they need into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The pinned torch (requirements/torch.txt, the one source of its version: the runtime image reads it
# too); on machines that ship it on disk pip takes that file.
TORCH_PIN := requirements/torch.txt

.PHONY: install kube kueue prometheus images test run lint bench clean

$(STAMP): pyproject.toml Makefile $(TORCH_PIN)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install -r $(TORCH_PIN)
	$(BIN)/pip install -e ".[operator,node,train,dev]"
	touch $(STAMP)

install: $(STAMP)

# The pinned Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl), built from the Go module proxy once into ~/.cache/kareus/kube/<version>/bin and reused;
# KAREUS_KUBE_BIN or KUBEBUILDER_ASSETS name prebuilt binaries instead. About 10 min cold on 2 cores.
kube:
	bash tools/kube/build.sh

# Prometheus and promtool (Debian's `prometheus` package, 2.42): the dev cluster's Prometheus, the
# live dashboard tests and `promtool test rules` on the chart's alerts. A distribution package
# installs in seconds, where building Prometheus from the Go module proxy would take many minutes.
prometheus:
	command -v prometheus >/dev/null && command -v promtool >/dev/null || \
		(apt-get update && apt-get install -y --no-install-recommends prometheus)

# The Kueue controller (sigs.k8s.io/kueue, pinned in tools/kueue/go.mod) with its CRDs and webhook
# list, built once into ~/.cache/kareus/kueue/<version>; about 8 min cold on 2 cores.
kueue:
	bash tools/kueue/build.sh

# Kareus's images (images/*.Dockerfile) and the dev cluster's CoreDNS and pause images, built without a
# Docker engine (buildah on a Debian base made by mmdebstrap; Debian's containerd and runc run them), each
# cached by the content hash of its inputs in ~/.cache/kareus/images and rebuilt only when they change;
# then the store the dev cluster's nodes start from. About 15 min cold (the runtime image carries the
# pinned torch), seconds when nothing changed.
images: $(STAMP) kube
	command -v containerd >/dev/null && command -v runc >/dev/null && command -v buildah >/dev/null && \
		command -v mmdebstrap >/dev/null && command -v iptables >/dev/null && command -v conntrack >/dev/null && \
		test -x /usr/lib/cni/bridge || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
		--no-install-recommends containerd runc containernetworking-plugins buildah mmdebstrap iptables \
		conntrack iproute2)
	$(BIN)/python -m kareus_devcluster.images

test: $(STAMP) kube kueue prometheus images
	$(BIN)/python -m pytest -q -p no:cacheprovider

run: $(STAMP)
	$(BIN)/kareus run examples/quickstart.yaml --out out/quickstart

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/yamllint -s crds examples

clean:
	rm -rf $(VENV) out .pytest_cache
