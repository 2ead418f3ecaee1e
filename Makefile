# The README's commands. Every target sets up .venv first, so a fresh clone needs nothing else.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True
export TOKENIZERS_PARALLELISM := false

.PHONY: up test test-slow lint bench contracts clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

# torch goes in first and pinned: it takes the local CPU wheel instead of a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

up: $(STAMP)
	$(BIN)/kbmesh up

test: $(STAMP)
	$(BIN)/python -m pytest

# Tests longer than a few minutes (the three-node NATS cluster under failures).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

lint: $(STAMP)
	$(BIN)/ruff check services tests benchmarks
	$(BIN)/ruff format --check services tests benchmarks
	$(BIN)/mypy services

bench: $(STAMP)
	$(BIN)/python -m benchmarks.embedding_throughput

contracts: $(STAMP)
	$(BIN)/kbmesh contracts export

clean:
	rm -rf $(VENV) .kbmesh
