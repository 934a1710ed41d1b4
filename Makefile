# Everything runs from a local virtualenv that the targets create and fill.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install demo test test-fast lint format bench clean

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

install: $(STAMP) ## Create .venv and install the package with test and dev tools

demo: $(STAMP) ## Run Envoy + extproc + 2 simulated workers on localhost:8000 (Ctrl-C stops)
	$(PY) -m extproc.devstack $(ARGS)

test: $(STAMP) ## Run the whole test suite (unit + integration through the real Envoy)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP) ## ruff (lint + format check) and mypy
	$(VENV)/bin/ruff check extproc tests loadtest
	$(VENV)/bin/ruff format --check extproc tests loadtest
	$(VENV)/bin/mypy

format: $(STAMP) ## Apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix extproc tests loadtest
	$(VENV)/bin/ruff format extproc tests loadtest

bench: $(STAMP) ## Side-by-side latency/throughput benchmark (needs wrk: apt-get install wrk)
	@command -v wrk >/dev/null || { echo "wrk not found: apt-get install wrk"; exit 2; }
	$(PY) loadtest/bench.py $(ARGS)

clean: ## Remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache run
