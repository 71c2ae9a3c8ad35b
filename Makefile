# batchstring: `make demo` and `make test` work from a fresh clone with only python3 installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
VERSION_DIR := model_repository/llm/1
EXPORTED := $(VERSION_DIR)/runtime.json
MODEL_SOURCES := $(wildcard export/default_model/*) $(wildcard export/*.py)

.PHONY: install export test demo serve lint loadtest bench genai-perf gpu-check clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml client/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ./client -e '.[dev,cpu]'
	@touch $@

# Exported files are build products: re-export when the checkpoint or the exporter changes.
export: $(EXPORTED)

$(EXPORTED): $(INSTALLED) $(MODEL_SOURCES)
	$(BIN)/batchstring export

test: $(EXPORTED)
	$(BIN)/ruff check .
	$(BIN)/pytest

demo: $(EXPORTED)
	$(BIN)/batchstring demo

serve: $(EXPORTED)
	$(BIN)/batchstring serve --config cpu

loadtest: $(EXPORTED)
	$(BIN)/batchstring loadtest

bench: $(EXPORTED)
	$(BIN)/batchstring bench

# On a machine with an NVIDIA GPU, from a plain checkout: torch, transformers, tokenizers, safetensors
# and numpy, no install, no index (report in results/gpu-check/). Tier 2 (ONNX Runtime CUDA and
# tritonserver) after `make install` with the gpu extra: .venv/bin/python -m batchstring.cli gpu-check --full
gpu-check:
	$(PYTHON) -m batchstring.cli gpu-check

genai-perf: $(EXPORTED)
	$(BIN)/batchstring genai-perf

lint: $(INSTALLED)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .venv-genai-perf results tests/logs $(addprefix $(VERSION_DIR)/,model.onnx model.onnx.data model.small.onnx model.small.onnx.data model.pt tokenizer.json runtime.json)
