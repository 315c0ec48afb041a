# syntax=docker/dockerfile:1
# The prefect-pretrain image: the Prefect flow-run pod (orchestrator) and the training pods
# (`python -m trainer.launch`, started by the Kubernetes backend) run the same image.
#
#   docker build -t prefect-pretrain:cpu .                                # CPU torch
#   docker build --build-arg TORCH_VARIANT=cu126 -t prefect-pretrain:cu126 .   # CUDA 12.6 torch
#
# Dependencies are installed under constraints.txt (the pins the test suite runs with); torch
# comes from the PyTorch index of TORCH_VARIANT (cpu, cu126, cu128, …: a wheel of the pinned
# version must exist there). CUDA runtime libraries come with the torch wheels; GPU nodes need
# only the NVIDIA driver and device plugin.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false

# git: Prefect's git_clone pull step (prefect.yaml's kubernetes deployment)
RUN apt-get update \
    && apt-get install -y --no-install-recommends git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/prefect-pretrain

# torch first, alone: the largest layer, rebuilt only when the pin or the variant changes
COPY constraints.txt ./
RUN pip install -c constraints.txt --index-url "${TORCH_INDEX}" torch

# then the project and its other dependencies, under the same constraints
COPY pyproject.toml README.md ./
COPY pretrain ./pretrain
COPY trainer ./trainer
COPY flows ./flows
COPY tasks ./tasks
COPY blocks ./blocks
COPY deployments ./deployments
RUN pip install -c constraints.txt --extra-index-url "${TORCH_INDEX}" . \
    && python -c "import trainer.launch, pretrain.cli.app, flows.campaign"

# never root: campaign workdirs on shared volumes are written as this user (uid 10001; give the
# volume fsGroup 10001 or matching permissions)
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin pretrain
USER 10001:10001
WORKDIR /home/pretrain

# training pods override the command with the node agent (python -m trainer.launch …);
# Prefect's Kubernetes worker overrides it with the flow run
CMD ["python", "-m", "trainer.launch", "--help"]
