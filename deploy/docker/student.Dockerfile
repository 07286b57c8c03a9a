# syntax=docker/dockerfile:1
# The student trainer on CUDA GPUs (with the lora extra). Build from the repository root:
#
#   docker build -f deploy/docker/student.Dockerfile -t teacher-service/student:0.1.0 .
#
# Same recipe as teacher.Dockerfile: the project's pins (requirements/ci.txt) as
# constraints, torch as the CUDA build of the pinned version from TORCH_INDEX_URL.
# Run it under torchrun (the Kubernetes Job and student.sbatch in deploy/ do):
#
#   docker run --gpus all --entrypoint torchrun teacher-service/student:0.1.0 \
#       --standalone --nproc-per-node gpu -m student_trainer train --teacher HOST:50051 ...

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

# ---- build ------------------------------------------------------------------------------
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
# torch first, as its own layer: the CUDA build of exactly the version ci.txt pins
# (hadolint cannot see that the pin comes from the file).
# hadolint ignore=DL3013
RUN torch_pin="$(grep -E '^torch==' requirements/ci.txt)" \
    && pip install --index-url "${TORCH_INDEX_URL}" "${torch_pin}"
COPY pyproject.toml README* ./
COPY distill_common distill_common
COPY teacher_server teacher_server
COPY student_trainer student_trainer
COPY distill_demo distill_demo
RUN pip install --constraint requirements/ci.txt ".[lora]" \
    && python -c "import torch, student_trainer; assert torch.version.cuda, 'expected a CUDA build of torch'"

# ---- runtime ---------------------------------------------------------------------------
FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group student \
    && mkdir -p /cache /runs \
    && chown student:student /cache /runs
COPY --from=build /opt/venv /opt/venv
# HF_HOME: downloads of the student model/tokenizer; /runs: --output-dir (mount volumes).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface
USER 10001:10001
WORKDIR /home/student
# A training job: nothing to probe from outside. Its own torchrun rendezvous (29500) and
# NCCL's ephemeral ports to the teacher are not fixed services, so nothing is EXPOSEd.
HEALTHCHECK NONE
ENTRYPOINT ["student-trainer"]
CMD ["train", "--help"]
