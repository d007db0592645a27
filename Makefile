# ManyLoRA developer commands. `make` alone lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_REPOSITORY ?= model_repository
DEMO_TINY := models/demo-tiny
DEMO_BASE := models/demo-base
DEMO_ADAPTERS := models/demo-tiny-adapters
# make serve CHECKPOINT=/path/to/gliner2-checkpoint [ADAPTER_DIR=/path/to/adapters]
# (default: the tiny demo checkpoint and its demo adapters)
CHECKPOINT ?=
ADAPTER_DIR ?=
# make test PYTEST_ARGS="-k launcher -x"
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup demo serve test check bench bench-gpu bench-server

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: ## create .venv and install torch + manylora[serve,test,kernels] (idempotent)
	@VENV=$(VENV) bash scripts/setup.sh

demo: setup ## build the trained tiny demo and its adapters (about 4 minutes on 2 cores) and the base-size demo under models/
	$(PY) -m manylora.demo --size tiny --train --replace-outdated --out $(DEMO_TINY)
	$(PY) -m manylora.lora.demo_adapters --checkpoint $(DEMO_TINY) --out $(DEMO_ADAPTERS)
	$(PY) -m manylora.demo --size base --out $(DEMO_BASE)

serve: setup ## run tritonserver on model_repository (CHECKPOINT=dir serves another checkpoint)
ifeq ($(CHECKPOINT),)
	@$(PY) -m manylora.demo --size tiny --train --replace-outdated --out $(DEMO_TINY) >/dev/null
	@$(PY) -m manylora.lora.demo_adapters --checkpoint $(DEMO_TINY) --out $(DEMO_ADAPTERS) >/dev/null
	$(PY) -m manylora.tritonserver --model-repository $(MODEL_REPOSITORY)
else
	@mkdir -p models/no-adapters
	$(PY) -m manylora.tritonserver --model-repository $(MODEL_REPOSITORY) \
		--parameter gliner2:checkpoint=$(abspath $(CHECKPOINT)) \
		--parameter gliner2_core:checkpoint=$(abspath $(CHECKPOINT)) \
		--parameter gliner2_core:adapter_dir=$(abspath $(or $(ADAPTER_DIR),models/no-adapters))
endif

# the fault-injection soak runs in every `make test`, bounded to this many seconds
SOAK_SECONDS ?= 30

test: setup ## run the test suite (real tritonserver and a 30 s fault-injection soak included)
	PATH="$(abspath $(VENV))/bin:$$PATH" MANYLORA_SOAK_SECONDS=$(SOAK_SECONDS) $(VENV)/bin/pytest -q $(PYTEST_ARGS)

check: setup ## ruff format --check, ruff check, then the tests
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	@$(MAKE) --no-print-directory test

bench: setup ## CPU smoke run of the engine benchmark (tiny model, a few minutes at most), its chart and table
	mkdir -p perf/results
	rm -f perf/results/engine-smoke.jsonl
	$(PY) perf/bench_engine.py --smoke --out perf/results/engine-smoke.jsonl
	$(PY) perf/plot.py perf/results/engine-smoke.jsonl --png perf/results/engine-smoke.png --md perf/results/engine-smoke.md

bench-gpu: ## the H200 run (engine + server); on a GPU host after `source .gpu-bundle/activate.sh`
	bash perf/run_h200.sh

bench-server: setup ## perf_analyzer against a running server (URL=localhost:8001 ADAPTERS=models/demo-tiny-adapters)
	mkdir -p perf/results
	$(PY) perf/bench_server.py --url $(or $(URL),localhost:8001) --adapters $(or $(ADAPTERS),$(DEMO_ADAPTERS)) \
		--out perf/results/server.jsonl
