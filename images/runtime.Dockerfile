# syntax=docker/dockerfile:1.7
# The Kareus training runtime: the profile, optimize and train pods (`kareus profile|optimize|train`
# wrapped by `kareus-operator publish`). Python from the base image, then exactly the torch the project
# pins (requirements/torch.txt, PyPI's CUDA build: on a GPU node the NVIDIA container runtime injects
# the driver), then the `train` extra constrained to that torch. The build checks itself: the
# entrypoint starts, torch is the pinned one, and `new_group` takes `device_id` (torch >= 2.6), which
# the runtime's communicators need.
# Build from the repository root:  docker build -f images/runtime.Dockerfile -t localhost/kareus/runtime:0.1.0 .
ARG PYTHON_VERSION=3.11
ARG DEBIAN_RELEASE=bookworm
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE}

FROM ${BASE_IMAGE}
ARG KAREUS_VERSION=0.1.0
LABEL org.opencontainers.image.title="kareus-runtime" \
      org.opencontainers.image.description="Kareus training runtime: profiling, optimisation and nanobatched training" \
      org.opencontainers.image.version="${KAREUS_VERSION}" \
      org.opencontainers.image.source="https://github.com/kareus-dev/kareus" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/kareus/src
# torch first, in a layer of its own: it is most of the image, and changes far less often than the code.
COPY requirements/torch.txt ./requirements/torch.txt
RUN python -m venv /opt/kareus \
    && /opt/kareus/bin/pip install --no-compile -r requirements/torch.txt
# Then the `train` extra's dependencies, in a layer that changes only with pyproject.toml (a stand-in
# package lets pip resolve them), and last the code itself.
COPY pyproject.toml ./
RUN mkdir kareus && touch kareus/__init__.py \
    && /opt/kareus/bin/pip install --no-compile -c requirements/torch.txt ".[train]" \
    && /opt/kareus/bin/pip uninstall -y kareus && rm -rf kareus build
COPY kareus ./kareus
COPY operator ./operator
COPY node_daemon ./node_daemon
RUN /opt/kareus/bin/pip install --no-compile --no-deps . \
    && /opt/kareus/bin/pip check \
    && /opt/kareus/bin/kareus --help >/dev/null \
    && /opt/kareus/bin/python -c "import inspect, sys, torch, torch.distributed as dist; \
pin = open('requirements/torch.txt').read().split('torch==')[1].split()[0]; \
sys.exit(f'torch {torch.__version__} is not the pinned {pin}' if torch.__version__.split('+')[0] != pin else \
'torch.distributed.new_group takes no device_id' if 'device_id' not in inspect.signature(dist.new_group).parameters else 0)" \
    && cd / && rm -rf /opt/kareus/src
ENV PATH=/opt/kareus/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /workspace
# Non-root: training needs no privileges; clock requests go through the node agent's socket.
# A named user: getpass, kopf's peering identity and pip look the uid up in /etc/passwd.
RUN echo "kareus:x:65532:65532:kareus:/tmp:/usr/sbin/nologin" >> /etc/passwd \
    && echo "kareus:x:65532:" >> /etc/group
USER 65532:65532
CMD ["kareus", "--help"]
