# tailguard: two commands on a fresh machine, `make demo` and `make test`. Both start from `make .venv`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian packages: wordnet-base (the demo's real text), prometheus (promtool for alert-rule tests).
DEB_PACKAGES := wordnet-base prometheus

.PHONY: demo test test-fast deb-deps tools benchmark schema golden manifests-spec clean

# The virtual environment with tailguard and its dev extras (torch==2.13.0 is the machine's CPU build).
$(VENV): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q -e '.[dev]'
	touch $(VENV)

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

test: $(VENV) tools
	$(BIN)/pytest -q -p no:cacheprovider

test-fast: $(VENV)
	$(BIN)/pytest -q -m "not slow and not integration"

benchmark: $(VENV) deb-deps
	$(BIN)/python benchmarks/bench_minilm.py --out benchmarks/results/minilm.json

schema: $(VENV)
	$(BIN)/tailguard spec schema --out docs/spec.schema.json

clean:
	rm -rf .tailguard .pytest_cache

golden: $(VENV)
	for s in minilm:examples/minilm/spec.yaml tiny:tests/data/tiny_spec.yaml; do \
	  $(BIN)/tailguard compile $${s#*:} -o tests/golden/$${s%%:*}.pipeline.yaml; done

# The cluster copy of the example spec: identical but for s3:// data URIs (tests/test_manifests.py checks it).
manifests-spec:
	{ head -2 manifests/base/specs/minilm-embedder.yaml; sed -e 's#uri: data/#uri: s3://tailguard-data/minilm/#' examples/minilm/spec.yaml; } > manifests/base/specs/.tmp && mv manifests/base/specs/.tmp manifests/base/specs/minilm-embedder.yaml
