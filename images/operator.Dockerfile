# syntax=docker/dockerfile:1.7
# The Kareus operator: the kopf controller and the pure core (numpy, scipy, pymoo, lowtime,
# xgboost for re-selecting plans), installed with the `operator` extra only: no torch, no NVML.
# Build from the repository root:  docker build -f images/operator.Dockerfile -t localhost/kareus/operator:0.1.0 .
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
    && /opt/kareus/bin/pip install --no-compile ".[operator]" \
    && /opt/kareus/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
    && /opt/kareus/bin/kareus-operator --help >/dev/null

FROM ${BASE_IMAGE}
ARG KAREUS_VERSION=0.1.0
LABEL org.opencontainers.image.title="kareus-operator" \
      org.opencontainers.image.description="Kareus operator: energy-optimal training jobs on Kubernetes" \
      org.opencontainers.image.version="${KAREUS_VERSION}" \
      org.opencontainers.image.source="https://github.com/kareus-dev/kareus" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kareus /opt/kareus
# The chart mounts a read-only root filesystem: no bytecode writes, caches under the /tmp emptyDir.
ENV PATH=/opt/kareus/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
# Non-root, numeric so runAsNonRoot can verify it.
# A named user: getpass, kopf's peering identity and pip look the uid up in /etc/passwd.
RUN echo "kareus:x:65532:65532:kareus:/tmp:/usr/sbin/nologin" >> /etc/passwd \
    && echo "kareus:x:65532:" >> /etc/group
USER 65532:65532
ENTRYPOINT ["kareus-operator"]
CMD ["run"]
