# Everything runs inside .venv, created (or refreshed) when missing or older than pyproject.toml.
# On these CPU machines torch comes from the CPU wheel on disk. On a GPU machine:
#   make train TORCH=torch==2.13.0                 (PyPI's Linux wheel is the CUDA build)
#   make train TORCH= VENV_ARGS=--system-site-packages   (keep the torch you already have)
PY        ?= python3
VENV      ?= .venv
VENV_ARGS ?=
TORCH     ?= torch==2.13.0
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
ARGS      ?=

.PHONY: install test test-slow train compare bench sweeps report lint clean-venv

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV_ARGS) $(VENV)
	@if [ -n "$(TORCH)" ]; then $(BIN)/pip install -q "$(TORCH)"; fi
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

install: $(STAMP)

test: $(STAMP)           ## the suite CI runs (well under 30 min on 2 cores)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)      ## the long tests (full training runs, multi-process)
	$(BIN)/python -m pytest -q -m slow

train: $(STAMP)          ## the default run: SST-2, custom encoder (make train ARGS="heads=8")
	$(BIN)/python train.py $(ARGS)

compare: $(STAMP)        ## ours vs PyTorch's, weights copied; exit 1 if a diff > 1e-5 (ARGS=tol=...)
	$(BIN)/python scripts/compare_with_official.py $(ARGS)

bench: $(STAMP)          ## speed and memory vs the official modules (make bench ARGS="quick=true")
	$(BIN)/python scripts/bench.py $(ARGS)

SWEEPS ?= heads head_dim ff_ratio dropout dim
sweeps: $(STAMP)         ## the CPU sweep presets into multirun/<preset>; reports copied to results/sweeps/
	@for s in $(SWEEPS); do \
	  $(BIN)/python train.py sweep=$$s hydra.sweep.dir=multirun/$$s $(ARGS) || exit 1; \
	  mkdir -p results/sweeps/$$s && cp multirun/$$s/report.md multirun/$$s/results.csv multirun/$$s/*.png results/sweeps/$$s/; \
	done

report: $(STAMP)         ## make report DIR=multirun/<sweep>
	$(BIN)/python scripts/report.py $(DIR)

lint: $(STAMP)
	$(BIN)/ruff check src scripts tests train.py

clean-venv:
	rm -rf $(VENV)

.PHONY: gpu-bundle gpu-check
gpu-bundle: $(STAMP)     ## here: .gpu/ (wheels the bare GPU machine lacks, SST-2 copy, manifest); carry [".gpu"]
	$(BIN)/python scripts/gpu_bundle.py $(ARGS)

gpu-check:               ## on the lent GPU machine (no venv there: plain $(PY)); ARGS=--cpu for the dry run here
	$(PY) scripts/gpu_check.py $(ARGS)
