# The few verbs people type. Everything runs from .venv, which this Makefile creates.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NATIVE_SRC := setup.py $(wildcard csrc/*.h csrc/*.cpp csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*)
NVCC := $(shell command -v nvcc 2>/dev/null)

.PHONY: all demo test bench lint format nvcc-check clean

all: $(VENV)/.built

$(VENV)/.deps: requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# Editable install once (metadata), then incremental ninja rebuilds of the extension.
$(VENV)/.built: $(VENV)/.deps $(NATIVE_SRC) pyproject.toml
	test -f $(VENV)/.installed || { $(PY) -m pip install -q --no-build-isolation --no-deps -e . && touch $(VENV)/.installed; }
	MAX_JOBS=2 $(PY) setup.py -q build_ext --inplace
	$(PY) -c "import ddpcomm, json; print('ddpcomm', json.dumps(ddpcomm.build_info()))"
	touch $@

demo: all
	$(PY) -m ddpcomm.bench demo

test: all nvcc-check
	$(PY) -m pytest -q tests

bench: all
	$(PY) -m ddpcomm.bench kernels

# Compile-checks every CUDA kernel file with plain nvcc (no torch headers, no GPU needed).
nvcc-check:
ifneq ($(NVCC),)
	@set -e; for f in $(wildcard csrc/cuda/*_kernels.cu); do \
	  echo "nvcc -c $$f"; nvcc -std=c++17 --fmad=false -arch=sm_80 -Icsrc -c $$f -o /tmp/ddpcomm_nvcc_check.o; \
	done
else
	@echo "nvcc not found: CUDA kernels not compile-checked"
endif

lint: $(VENV)/.deps
	$(VENV)/bin/ruff check ddpcomm tests benchmarks
	$(VENV)/bin/ruff format --check ddpcomm tests benchmarks
	$(VENV)/bin/clang-format --dry-run --Werror $(wildcard csrc/*.h csrc/*.cpp csrc/cpu/*.cpp csrc/cuda/*)

format: $(VENV)/.deps
	$(VENV)/bin/ruff format ddpcomm tests benchmarks
	$(VENV)/bin/clang-format -i $(wildcard csrc/*.h csrc/*.cpp csrc/cpu/*.cpp csrc/cuda/*)

clean:
	rm -rf build ddpcomm/*.so $(VENV)/.built

# Collectives sweep and end-to-end training over shaped 1 Gbit/s links between network
# namespaces (needs root; falls back to loopback with a warning). benchmarks/RESULTS.md
# has the results of these exact commands on the development machine.
.PHONY: bench-net
bench-net: all
	$(PY) -m ddpcomm.bench collectives --link 1gbit --iters 3 --json benchmarks/collectives_1gbit.json
	$(PY) -m ddpcomm.bench train --link 1gbit --json benchmarks/train_1gbit.json --plot benchmarks/train_1gbit.png
