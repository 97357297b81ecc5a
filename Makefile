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

.PHONY: install test test-slow train compare bench sweeps report lint clean-venv docs

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV_ARGS) $(VENV)
	@if [ -n "$(TORCH)" ]; then $(BIN)/pip install -q "$(TORCH)"; fi
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

install: $(STAMP)

# The suite runs one test file per worker (the README's commands run in order, in one file), the longest files first
# (tests/conftest.py: LONGEST_FIRST, hence --no-loadscope-reorder), a worker per core
# with one thread each: two threads per process on a 2-core machine shared by two workers only spin-wait.
TEST_WORKERS ?= 2

test: $(STAMP)           ## the suite CI runs (make test TEST_WORKERS=0: in one process, in file order)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-slow: $(STAMP)      ## the long tests (full training runs, multi-process)
	$(BIN)/python -m pytest -q -m slow

train: $(STAMP)          ## the default run: SST-2, custom encoder (make train ARGS="heads=8")
	$(BIN)/python train.py $(ARGS)

compare: $(STAMP)        ## ours vs PyTorch's, weights copied; exit 1 if a diff > 1e-5 (ARGS=tol=...)
	$(BIN)/python scripts/compare_with_official.py $(ARGS)

bench: $(STAMP)          ## speed and memory vs the official modules (make bench ARGS="quick=true")
	$(BIN)/python scripts/bench.py $(ARGS)

SWEEPS ?= heads head_dim dim dropout ff_ratio
DATA ?= trec
sweeps: $(STAMP)         ## make sweeps DATA=trec: the CPU presets into multirun/<data>/<preset>, reports to results/sweeps/<data>/<preset>/, then the claims table
	@for s in $(SWEEPS); do \
	  $(BIN)/python train.py sweep=$$s data=$(DATA) hydra.sweep.dir=multirun/$(DATA)/$$s $(ARGS) || exit 1; \
	  mkdir -p results/sweeps/$(DATA)/$$s && \
	  cp multirun/$(DATA)/$$s/report.md multirun/$(DATA)/$$s/results.csv multirun/$(DATA)/$$s/verdicts.json \
	     multirun/$(DATA)/$$s/*.png results/sweeps/$(DATA)/$$s/; \
	done
	$(BIN)/mhalab-claims results/sweeps out=results/sweeps/README.md

report: $(STAMP)         ## make report DIR=multirun/<sweep>
	$(BIN)/python scripts/report.py $(DIR)

docs: $(STAMP)           ## the documentation site into site/ (mkdocs.yml; strict: a warning fails, as in CI)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check src scripts tests train.py docs/hooks

clean-venv:
	rm -rf $(VENV)

.PHONY: gpu-bundle gpu-check
gpu-bundle: $(STAMP)     ## here: .gpu/ (wheels the bare GPU machine lacks, SST-2 copy, manifest); carry [".gpu"]
	$(BIN)/python scripts/gpu_bundle.py $(ARGS)

gpu-check:               ## on the lent GPU machine (no venv there: plain $(PY)); ARGS=--cpu for the dry run here
	$(PY) scripts/gpu_check.py $(ARGS)
