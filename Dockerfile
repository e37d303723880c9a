# syntax=docker/dockerfile:1.7
# tensorgate images. Two targets:
#   docker build -t tensorgate:gpu .               (default: CUDA 13.0, libraries from pip)
#   docker build -t tensorgate:cpu --target cpu .  (slim Python, no CUDA)
# Versions are pinned here and checked again by the server at start (TG_EXPECT_*): see
# docs/deploy.md for the CUDA / torch / onnxruntime matrix.
# Both images carry the bundled demo models at /models (no VOLUME: a rebuild serves the
# rebuilt models). Serve your own by mounting a repository read-only over /models, or point
# TG_MODEL_REPOSITORY elsewhere. Labels: --build-arg VERSION=… REVISION=$(git rev-parse HEAD)
# SOURCE=<your repository's URL>.
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown

# ---------------------------------------------------------------------------------------------
# build: install the locked export/test environment and build the bundled models' artifacts.
FROM python:3.11.14-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# model.pt2 (AOTInductor) is compiled C++: this stage needs a compiler, the runtime stages do not
# (loading a package compiles nothing; tests/integration/test_pt2.py serves with none on PATH).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
 && rm -rf /var/lib/apt/lists/*
COPY requirements/ requirements/
# The CPU build of torch (the lock pins 2.13.0; PyPI's default wheel is the multi-GB CUDA one).
RUN python -m venv /opt/build \
 && /opt/build/bin/pip install --extra-index-url https://download.pytorch.org/whl/cpu \
      -r requirements/dev.txt
COPY pyproject.toml README.md ./
COPY preprocessing/ preprocessing/
COPY service/ service/
COPY models/ models/
RUN /opt/build/bin/pip install --no-deps . \
 && /opt/build/bin/python models/efficientnet_lite0/build.py \
 && /opt/build/bin/python models/digits/build.py \
 && /opt/build/bin/python models/minilm/build.py \
 && /opt/build/bin/python models/wine/build.py \
 && /opt/build/bin/python models/faces/build.py \
 && rm -rf models/faces/.weights \
 && find models -name build.py -delete

# ---------------------------------------------------------------------------------------------
# cpu: the server alone, on slim Python, from the CPU lock.
FROM python:3.11.14-slim-bookworm AS cpu
ARG VERSION REVISION SOURCE
LABEL org.opencontainers.image.title="tensorgate" \
      org.opencontainers.image.description="Open Inference Protocol server for PyTorch-trained models" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
COPY requirements/cpu.txt /tmp/cpu.txt
COPY pyproject.toml README.md /src/
COPY preprocessing/ /src/preprocessing/
COPY service/ /src/service/
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --extra-index-url https://download.pytorch.org/whl/cpu \
      -r /tmp/cpu.txt \
 && /opt/venv/bin/pip install --no-deps /src \
 && rm -rf /src /tmp/cpu.txt \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tensorgate
COPY --from=build --chown=10001:10001 /src/models /models
ENV TG_HOST=0.0.0.0 TG_PORT=8000 TG_GRPC_PORT=8001 TG_MODEL_REPOSITORY=/models \
    TG_EXPECT_TORCH=2.13.0+cpu TG_EXPECT_ONNXRUNTIME=1.32.0 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache
USER 10001:10001
EXPOSE 8000 8001
STOPSIGNAL SIGTERM
# `tensorgate health` reads the same TG_* settings as the server (port, API token or its file),
# so the check still passes when TG_PROTECT_HEALTH_AND_METRICS asks for the token.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["tensorgate", "health", "ready"]
ENTRYPOINT ["tensorgate"]
CMD ["serve"]

# ---------------------------------------------------------------------------------------------
# gpu (default): torch 2.13.0 as PyPI builds it (CUDA 13.0) and onnxruntime-gpu for CUDA 13.
# CUDA, cuDNN, cuBLAS... come once, as the nvidia-* wheels the GPU lock pins (torch needs them
# anyway); the base image is CUDA's *base* flavour, which adds only the driver-compatibility
# pieces, so no library ships twice (a cudnn-runtime base would add ~3 GB of duplicates).
FROM nvidia/cuda:13.0.2-base-ubuntu22.04 AS gpu
ARG VERSION REVISION SOURCE
LABEL org.opencontainers.image.title="tensorgate" \
      org.opencontainers.image.description="Open Inference Protocol server for PyTorch-trained models" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
# Packages from the distribution and the deadsnakes PPA float within their release: the image
# is pinned by its base tag, torch and onnxruntime by the lock.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && apt-get purge -y software-properties-common gpg-agent \
 && apt-get autoremove -y \
 && rm -rf /var/lib/apt/lists/*
COPY requirements/gpu.txt /tmp/gpu.txt
COPY pyproject.toml README.md /src/
COPY preprocessing/ /src/preprocessing/
COPY service/ /src/service/
RUN python3.11 -m venv /opt/venv \
 && /opt/venv/bin/pip install --only-binary=:all: -r /tmp/gpu.txt \
 && /opt/venv/bin/pip install --no-deps /src \
 && rm -rf /src /tmp/gpu.txt \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tensorgate
COPY --from=build --chown=10001:10001 /src/models /models
ENV TG_HOST=0.0.0.0 TG_PORT=8000 TG_GRPC_PORT=8001 TG_MODEL_REPOSITORY=/models \
    TG_EXPECT_TORCH=2.13.0 TG_EXPECT_ONNXRUNTIME=1.31.1 TG_EXPECT_CUDA=13.0 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache
USER 10001:10001
EXPOSE 8000 8001
STOPSIGNAL SIGTERM
# `tensorgate health` reads the same TG_* settings as the server (port, API token or its file),
# so the check still passes when TG_PROTECT_HEALTH_AND_METRICS asks for the token.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["tensorgate", "health", "ready"]
ENTRYPOINT ["tensorgate"]
CMD ["serve"]
