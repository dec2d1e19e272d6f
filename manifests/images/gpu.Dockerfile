# syntax=docker/dockerfile:1
# tailguard GPU component image: the CPU image's steps plus TensorRT engines and onnxruntime-gpu, for the steps
# that KFP schedules on the GPU node pool (spec kubeflow.gpu_image).
#   docker build -f manifests/images/gpu.Dockerfile -t ghcr.io/tailguard/tailguard-gpu:0.1.0 .
# Base: NGC TensorRT 25.01 (TensorRT 10.8, CUDA 12.8, cuDNN 9, Ubuntu 24.04, Python 3.12; its release notes list
# the driver it needs). Pinned by tag; add @sha256:<digest> when you build (not knowable offline).
FROM nvcr.io/nvidia/tensorrt:25.01-py3

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    TAILGUARD_HOME=/tmp/tailguard \
    MLFLOW_DISABLE_TELEMETRY=true \
    GX_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1

WORKDIR /opt/tailguard

# First every common distribution with its sha256 hashes (generated from requirements.lock by
# scripts/image_locks.py for this base's Python 3.12); then the CUDA layer, pinned by version only: torch (CUDA
# build), onnxruntime-gpu and the nvidia-* wheels they pull are not in requirements.lock, which is resolved on CPU
# (docs/deploy.md, "Images"). pip check fails the build if the second step moved anything the first pinned.
# The last check fails the build when what tailguard's GPU steps need is not there: TensorRT 10.x from the base
# (components/build/builders/tensorrt.py builds with the FP16/INT8 flags and the entropy calibrator TensorRT 11
# removed) and onnxruntime-gpu's CUDA and TensorRT execution providers. Whether those providers load with this
# base's CUDA/cuDNN/TensorRT is only known on a GPU node: the runner refuses a session without them
# (tailguard.core.runtime.require_active_provider).
COPY manifests/images/requirements-common.txt manifests/images/requirements-gpu.txt \
     manifests/images/requirements-gpu.lock /opt/tailguard/requirements/
RUN python3 -m pip install --no-cache-dir --require-hashes --no-deps -r /opt/tailguard/requirements/requirements-gpu.lock \
    && python3 -m pip install --no-cache-dir -r /opt/tailguard/requirements/requirements-gpu.txt \
    && python3 -m pip check \
    && python3 -c "import tensorrt, onnxruntime as ort; \
v = tensorrt.__version__; p = ort.get_available_providers(); print('tensorrt', v, 'providers', p); \
assert v.split('.')[0] == '10', 'TensorRT 10.x expected, got ' + v; \
assert {'TensorrtExecutionProvider', 'CUDAExecutionProvider'} <= set(p), 'onnxruntime-gpu providers missing: ' + str(p)"

COPY pyproject.toml README.md /opt/tailguard/
COPY pipelines/ /opt/tailguard/pipelines/
COPY components/ /opt/tailguard/components/
COPY monitoring/ /opt/tailguard/monitoring/
RUN python3 -m pip install --no-cache-dir --no-deps --no-build-isolation /opt/tailguard \
    && python3 -c "import tailguard.components, tailguard.monitoring" \
    && groupadd --gid 10001 tailguard \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp/tailguard --shell /usr/sbin/nologin tailguard

USER 10001:10001
ENTRYPOINT ["tailguard"]
CMD ["--help"]
