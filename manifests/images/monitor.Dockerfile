# syntax=docker/dockerfile:1
# tailguard shadow-traffic monitor: `tailguard monitor serve` (FastAPI ingest on :8080; /healthz, /readyz, /metrics
# also on the probe port :8082, a server of their own).
#   docker build -f manifests/images/monitor.Dockerfile -t ghcr.io/tailguard/tailguard-monitor:0.1.0 .
# Base pinned by version tag; add @sha256:<digest> when you build (not knowable offline).
FROM python:3.11.13-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TAILGUARD_HOME=/tmp/tailguard \
    DO_NOT_TRACK=1

WORKDIR /opt/tailguard

# Every distribution pinned with its sha256 hashes (generated from requirements.lock by scripts/image_locks.py).
COPY manifests/images/requirements-monitor.lock /opt/tailguard/requirements/
RUN pip install --no-cache-dir --require-hashes --no-deps -r /opt/tailguard/requirements/requirements-monitor.lock

COPY pyproject.toml README.md /opt/tailguard/
COPY pipelines/ /opt/tailguard/pipelines/
COPY components/ /opt/tailguard/components/
COPY monitoring/ /opt/tailguard/monitoring/
# --no-deps: the monitor's own, slimmer, pinned set above (no torch, KFP or Great Expectations);
# --no-build-isolation: the build backend (setuptools) is the hashed one above.
RUN pip install --no-cache-dir --no-deps --no-build-isolation /opt/tailguard \
    && python -c "import tailguard.monitoring" \
    && groupadd --gid 10001 tailguard \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp/tailguard --shell /usr/sbin/nologin tailguard

USER 10001:10001
EXPOSE 8080 8082
ENTRYPOINT ["tailguard", "monitor", "serve"]
