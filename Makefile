# tailguard: two commands on a fresh machine, `make demo` and `make test`. Both start from `make .venv`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian packages: wordnet-base (the demo's real text), prometheus (promtool for alert-rule tests).
DEB_PACKAGES := wordnet-base prometheus

.PHONY: demo test lint test-fast test-latest lock image-locks deb-deps tools benchmark schema golden manifests-spec clean \
	example-ocr

# The lock: every package of tailguard[dev] (which includes [demo]) pinned with its sha256 hashes, for CPython 3.11
# on linux x86_64 (torch==2.13.0 is the machine's CPU build, +cpu). `make lock` refreshes it; pyproject.toml keeps
# the compatible ranges for people who install tailguard into their own environment.
LOCK := requirements.lock
PIP_TOOLS := pip-tools==7.6.2

# The virtual environment, installed from the lock only (--require-hashes: a package whose hash differs is refused).
$(VENV): pyproject.toml $(LOCK)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $(VENV)

# Re-resolve the newest versions pyproject.toml allows and rewrite the lock (10.5 minutes measured here: every file
# is downloaded once to be hashed; 2 minutes with pip-tools' hash cache warm). Run `make test-latest` first.
# `make lock LOCK_UPGRADE=` keeps every pin already in the lock and only adds what pyproject.toml gained (a new
# dependency, e.g. rapidfuzz for issue 38), so no other package moves.
LOCK_UPGRADE ?= --upgrade
lock:
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q $(PIP_TOOLS)
	.lock-venv/bin/pip-compile -q $(LOCK_UPGRADE) --generate-hashes --allow-unsafe --strip-extras --extra dev --extra demo \
	  --no-emit-index-url --no-emit-find-links -o $(LOCK) pyproject.toml
	# dev's self-reference (tailguard[demo]) comes out as an unhashable `tailguard @ file://` entry: drop it
	sed -i '/^# WARNING: pip install will require the following package to be hashed/,/^    # via tailguard (pyproject.toml)$$/d' $(LOCK)
	rm -rf .lock-venv
	@echo "now: make image-locks (the images' hashed requirements follow the new lock)"

# The container images' hashed requirement files (manifests/images/requirements-<image>.lock): each image's
# dependency closure with the pins and sha256 hashes of $(LOCK). tests/integration/test_images.py fails while they are stale.
image-locks: $(VENV)
	$(BIN)/python scripts/image_locks.py

# The test suite on the newest releases the ranges in pyproject.toml allow, in a throwaway venv (not the lock):
# run it before `make lock`, and when a dependency publishes a release, to learn of a break before users do.
test-latest: tools
	@d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && \
	$(PYTHON) -m venv "$$d/venv" && "$$d/venv/bin/pip" install -q --upgrade pip && \
	"$$d/venv/bin/pip" install -q --upgrade --upgrade-strategy eager -e '.[dev]' && \
	"$$d/venv/bin/pip" freeze --exclude-editable | grep -iE '^(onnxruntime|onnx|torch|mlflow|kfp|numpy|scipy)==' && \
	"$$d/venv/bin/pytest" -q -p no:cacheprovider

deb-deps:
	@missing=""; \
	[ -f /usr/share/wordnet/data.noun ] || missing="$$missing wordnet-base"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi

tools: $(VENV) deb-deps
	@[ ! -x scripts/install_tools.sh ] || scripts/install_tools.sh

demo: $(VENV) deb-deps
	$(BIN)/tailguard demo

test: $(VENV) tools lint
	$(BIN)/pytest -q -p no:cacheprovider

# ruff: lint and import order ([tool.ruff] in pyproject.toml); `$(BIN)/ruff check --fix .` repairs what it can.
lint: $(VENV)
	$(BIN)/ruff check .

test-fast: $(VENV)
	$(BIN)/pytest -q -m "not slow and not integration"

benchmark: $(VENV) deb-deps
	$(BIN)/python benchmarks/bench_minilm.py --out benchmarks/results/minilm.json

# The OCR example (issue 38, examples/ocr/README.md): the PP-OCRv4 recognizer from the rapidocr-onnxruntime 1.4.4 wheel
# (pip download --no-deps, sha256 pinned in prepare.py; rapidocr is not installed), 600 text lines rendered with
# Debian's DejaVu fonts (fonts-dejavu-core), then register, spec check, run (exit 3, no variant passed, is a result
# here, not an error) and the report in examples/ocr/data/. State in $$TAILGUARD_HOME (default ./.tailguard).
example-ocr: $(VENV)
	$(BIN)/python examples/ocr/prepare.py
	$(BIN)/tailguard register ppocr-rec examples/ocr/data/ppocr_rec.onnx --spec examples/ocr/spec.yaml
	$(BIN)/tailguard spec check examples/ocr/spec.yaml
	$(BIN)/tailguard run examples/ocr/spec.yaml --summary-json examples/ocr/data/summary.json || [ $$? -eq 3 ]
	$(BIN)/tailguard report latest -o examples/ocr/data/report.html

schema: $(VENV)
	$(BIN)/tailguard spec schema --out docs/spec.schema.json

clean:
	rm -rf .tailguard .pytest_cache

golden: $(VENV)
	for s in minilm:examples/minilm/spec.yaml tiny:tests/data/tiny_spec.yaml targets:tests/data/targets_spec.yaml; do \
	  $(BIN)/tailguard compile $${s#*:} -o tests/golden/$${s%%:*}.pipeline.yaml && \
	  sed -i 's|$(CURDIR)|@REPO@|g' tests/golden/$${s%%:*}.pipeline.yaml; done

# The cluster copy of the example spec: identical but for s3:// data URIs (tests/integration/test_manifests.py checks it).
manifests-spec:
	{ head -2 manifests/base/specs/minilm-embedder.yaml; sed -e 's#uri: data/#uri: s3://tailguard-data/minilm/#' examples/minilm/spec.yaml; } > manifests/base/specs/.tmp && mv manifests/base/specs/.tmp manifests/base/specs/minilm-embedder.yaml
