# syntax=docker/dockerfile:1
# The teacher server on CUDA GPUs. Build from the repository root (the context is the repo):
#
#   docker build -f deploy/docker/teacher.Dockerfile -t teacher-service/teacher:0.1.0 .
#
# Python packages come from the project's own pins (requirements/ci.txt as constraints),
# except that torch is the CUDA build from TORCH_INDEX_URL, at the version ci.txt pins:
# ci.txt's torch line is the CPU wheel only where the installer's index serves that.
# The CUDA runtime, cuDNN and NCCL come with the torch wheel (nvidia-* packages), so the
# base image only needs the driver hooks: keep CUDA_IMAGE's CUDA version and the
# TORCH_INDEX_URL's (cu128 here) in step, and the host's driver new enough for both.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

# ---- build: a virtual environment with the project and its pinned dependencies ----------
FROM ${CUDA_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The Ubuntu release is pinned by the base image's tag; its archive keeps only the latest
# build of each package, so pinning apt versions would only break rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements/ci.txt requirements/ci.txt
# torch first, as its own layer (GBs): the CUDA build of exactly the version ci.txt pins
# (hadolint cannot see that the pin comes from the file).
# hadolint ignore=DL3013
RUN torch_pin="$(grep -E '^torch==' requirements/ci.txt)" \
    && pip install --index-url "${TORCH_INDEX_URL}" "${torch_pin}"
# README* matches nothing in a checkout without README.md; pyproject.toml keeps COPY valid.
COPY pyproject.toml README* ./
COPY distill_common distill_common
COPY teacher_server teacher_server
COPY student_trainer student_trainer
COPY distill_demo distill_demo
# The installed torch (x.y.z+cu128) satisfies ci.txt's torch==x.y.z, so pip keeps it.
RUN pip install --constraint requirements/ci.txt . \
    && python -c "import torch, teacher_server; assert torch.version.cuda, 'expected a CUDA build of torch'"

# ---- runtime ---------------------------------------------------------------------------
FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group teacher \
    && mkdir -p /cache \
    && chown teacher:teacher /cache
COPY --from=build /opt/venv /opt/venv
# HF_HOME: model downloads go to /cache (mount a volume there to keep them across restarts).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface
USER 10001:10001
WORKDIR /home/teacher
# gRPC control plane (session groups form through it too), HTTP (health, metrics, status).
# NCCL's data plane also uses ephemeral ports between teacher and student: see deploy/README.md.
EXPOSE 50051 8000
# Liveness on the default --http-port. The model loads before the HTTP server starts,
# hence the long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
ENTRYPOINT ["teacher-server"]
CMD ["--model", "builtin:tiny", "--device", "cuda"]
