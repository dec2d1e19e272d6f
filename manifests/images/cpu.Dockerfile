# syntax=docker/dockerfile:1
# tailguard CPU component image: every pipeline step (KFP components use it as base_image with
# install_kfp_package=False), the CLI and the webhook trigger.
#   docker build -f manifests/images/cpu.Dockerfile -t ghcr.io/tailguard/tailguard:0.1.0 .
# Base pinned by version tag. Pin it by digest too (FROM python:3.11.13-slim-bookworm@sha256:...) when you build:
# the digest cannot be looked up offline, where this file was written.
FROM python:3.11.13-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TAILGUARD_HOME=/tmp/tailguard \
    MLFLOW_DISABLE_TELEMETRY=true \
    GX_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1

WORKDIR /opt/tailguard

# Every distribution pinned with its sha256 hashes (generated from requirements.lock by scripts/image_locks.py):
# pip refuses a file whose hash differs, and --no-deps installs nothing the lock does not list.
COPY manifests/images/requirements-cpu.lock /opt/tailguard/requirements/
RUN pip install --no-cache-dir --require-hashes --no-deps -r /opt/tailguard/requirements/requirements-cpu.lock

COPY pyproject.toml README.md /opt/tailguard/
COPY pipelines/ /opt/tailguard/pipelines/
COPY components/ /opt/tailguard/components/
COPY monitoring/ /opt/tailguard/monitoring/
# --no-build-isolation: the build backend (setuptools) is the hashed one above, not a fresh download
RUN pip install --no-cache-dir --no-deps --no-build-isolation /opt/tailguard \
    && pip check \
    && python -c "import tailguard.trigger, tailguard.components, tailguard.monitoring" \
    && groupadd --gid 10001 tailguard \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp/tailguard --shell /usr/sbin/nologin tailguard

USER 10001:10001
ENTRYPOINT ["tailguard"]
CMD ["--help"]
