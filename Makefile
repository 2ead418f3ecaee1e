# The README's commands. Every target sets up .venv first, so a fresh clone needs nothing else.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TS_CLIENT := tests/mcp_ts
OIDC := tests/oidc
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True
export TOKENIZERS_PARALLELISM := false

.PHONY: up test test-slow lint bench contracts clean browser pydoc

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

# Line coverage of services/ is printed, and the run fails under the floor.
test: $(STAMP) browser pydoc $(TS_CLIENT)/node_modules/.installed $(OIDC)/node_modules/.installed
	$(BIN)/python -m pytest --cov=services --cov-report=term:skip-covered --cov-fail-under=85

# The official TypeScript MCP SDK, for the strict-client tests; without node and npm (or the
# npm registry) those tests are skipped and say why.
$(TS_CLIENT)/node_modules/.installed: $(TS_CLIENT)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		npm ci --prefix $(TS_CLIENT) --no-audit --no-fund && touch $@ \
		|| echo "npm ci failed: the TypeScript MCP client tests will be skipped"; \
	else echo "npm not found: the TypeScript MCP client tests will be skipped"; fi

# A real OpenID provider (oidc-provider) for the sign-in tests; skipped, saying why, without
# node 20+ and npm.
$(OIDC)/node_modules/.installed: $(OIDC)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		npm ci --prefix $(OIDC) --no-audit --no-fund && touch $@ \
		|| echo "npm ci failed: the identity provider sign-in tests will be skipped"; \
	else echo "npm not found: the identity provider sign-in tests will be skipped"; fi

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

# Debian's HTML Python documentation, a real docs site for the web source tests and benchmarks:
# downloaded as a package and unpacked into .cache/ without installing it (no root needed).
# Without apt-get or the archive, those tests skip and say why.
PYDOC := .cache/python-doc
pydoc:
	@if [ ! -d $(PYDOC)/usr/share/doc/python3.11/html ]; then \
	  if command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then \
	    mkdir -p $(PYDOC)/deb && cd $(PYDOC)/deb && \
	    { apt-get download -q python3.11-doc >/dev/null 2>&1 && \
	      dpkg -x python3.11-doc_*.deb .. && echo "python3.11-doc unpacked into $(PYDOC)"; } || \
	    echo "python3.11-doc could not be downloaded: the docs-site tests will skip"; \
	  else echo "apt-get/dpkg not found: the docs-site tests will skip"; fi; \
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
