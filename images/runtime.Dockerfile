# syntax=docker/dockerfile:1.7
# The Kareus training runtime: the profile, optimize and train pods (`kareus profile|optimize|train`
# wrapped by `kareus-operator publish`). Starts from a CUDA build of PyTorch and adds the `train`
# extra only; the build fails if pip replaced the CUDA torch with another build.
# Build from the repository root:  docker build -f images/runtime.Dockerfile -t kareus-runtime .
ARG TORCH_VERSION=2.5.1
ARG CUDA_VERSION=12.4
ARG CUDNN_VERSION=9
ARG BASE_IMAGE=pytorch/pytorch:${TORCH_VERSION}-cuda${CUDA_VERSION}-cudnn${CUDNN_VERSION}-runtime

FROM ${BASE_IMAGE}
ARG KAREUS_VERSION=0.1.0
LABEL org.opencontainers.image.title="kareus-runtime" \
      org.opencontainers.image.description="Kareus training runtime: profiling, optimisation and nanobatched training" \
      org.opencontainers.image.version="${KAREUS_VERSION}" \
      org.opencontainers.image.source="https://github.com/kareus-dev/kareus" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/kareus/src
COPY pyproject.toml ./
COPY kareus ./kareus
COPY operator ./operator
COPY node_daemon ./node_daemon
RUN python -c "import torch; print(torch.__version__, torch.version.cuda)" > /tmp/torch-before \
    && pip install ".[train]" \
    && python -c "import torch; print(torch.__version__, torch.version.cuda)" > /tmp/torch-after \
    && cmp /tmp/torch-before /tmp/torch-after \
    && python -c "import torch, sys; sys.exit(torch.version.cuda is None)" \
    && rm /tmp/torch-before /tmp/torch-after
ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /workspace
# Non-root: training needs no privileges; clock requests go through the node agent's socket.
USER 1000:1000
CMD ["kareus", "--help"]
