# ManyLoRA developer commands. `make` alone lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_REPOSITORY ?= model_repository
DEMO_TINY := models/demo-tiny
DEMO_BASE := models/demo-base
# make serve CHECKPOINT=/path/to/gliner2-checkpoint  (default: the tiny demo checkpoint)
CHECKPOINT ?=
# make test PYTEST_ARGS="-k launcher -x"
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup demo serve test check

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-7s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: ## create .venv and install torch + manylora[serve,test,kernels] (idempotent)
	@VENV=$(VENV) bash scripts/setup.sh

demo: setup ## build the tiny and base demo checkpoints under models/
	$(PY) -m manylora.demo --size tiny --out $(DEMO_TINY)
	$(PY) -m manylora.demo --size base --out $(DEMO_BASE)

serve: setup ## run tritonserver on model_repository (CHECKPOINT=dir serves another checkpoint)
ifeq ($(CHECKPOINT),)
	@test -d $(DEMO_TINY) || $(PY) -m manylora.demo --size tiny --out $(DEMO_TINY)
	$(PY) -m manylora.tritonserver --model-repository $(MODEL_REPOSITORY)
else
	$(PY) -m manylora.tritonserver --model-repository $(MODEL_REPOSITORY) \
		--parameter gliner2:checkpoint=$(abspath $(CHECKPOINT))
endif

test: setup ## run the test suite (real tritonserver included)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/pytest -q $(PYTEST_ARGS)

check: setup ## ruff format --check, ruff check, then the tests
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	@$(MAKE) --no-print-directory test
