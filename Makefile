# The README's commands. Every target sets up .venv first, so a fresh clone needs nothing else.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True
export TOKENIZERS_PARALLELISM := false

.PHONY: up test test-slow lint bench contracts clean browser

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

test: $(STAMP) browser
	$(BIN)/python -m pytest

# Tests longer than a few minutes (the three-node NATS cluster under failures).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# The console's browser tests drive Debian's chromium (Playwright cannot download its own
# here). As root it is installed when missing; otherwise those tests skip and say why.
browser:
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium for the browser tests"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } || \
	      echo "chromium could not be installed: the browser tests will say so"; \
	  else \
	    echo "chromium is missing (not root: run 'apt-get install -y chromium'); browser tests skip"; \
	  fi; \
	fi

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
