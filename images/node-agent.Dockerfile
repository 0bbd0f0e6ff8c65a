# syntax=docker/dockerfile:1.7
# The Kareus node agent (`kareus-node`): authorised GPU clock control and GPU metrics, installed with
# the `node` extra only. The image carries no NVIDIA driver: NVML (libnvidia-ml.so) comes from the
# host driver, injected by the NVIDIA container runtime because of NVIDIA_DRIVER_CAPABILITIES below.
# Build from the repository root:  docker build -f images/node-agent.Dockerfile -t localhost/kareus/node-agent:0.1.0 .
ARG PYTHON_VERSION=3.11
ARG DEBIAN_RELEASE=bookworm
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE}

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
COPY kareus ./kareus
COPY operator ./operator
COPY node_daemon ./node_daemon
RUN python -m venv /opt/kareus \
    && /opt/kareus/bin/pip install --no-compile ".[node]" \
    && /opt/kareus/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
    && /opt/kareus/bin/kareus-node --help >/dev/null

FROM ${BASE_IMAGE}
ARG KAREUS_VERSION=0.1.0
LABEL org.opencontainers.image.title="kareus-node-agent" \
      org.opencontainers.image.description="Kareus node agent: authorised GPU clock control and GPU metrics" \
      org.opencontainers.image.version="${KAREUS_VERSION}" \
      org.opencontainers.image.source="https://github.com/kareus-dev/kareus" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kareus /opt/kareus
ENV PATH=/opt/kareus/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
# Root on purpose: locking SM clocks through NVML needs CAP_SYS_ADMIN as uid 0, and the agent owns
# the hostPath socket and journal directories. It is the only Kareus image that runs as root; the
# chart confines it to its own privileged namespace.
USER 0:0
ENTRYPOINT ["kareus-node"]
