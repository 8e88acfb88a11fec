# The few verbs people type. Everything runs from .venv, which this Makefile creates.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NATIVE_SRC := setup.py $(wildcard csrc/*.h csrc/*.cpp csrc/cpu/*.cpp csrc/cpu/*.h csrc/cpu/avx2/*.cpp csrc/cuda/*)
NVCC := $(shell command -v nvcc 2>/dev/null)
CXX_FILES := $(filter-out setup.py,$(NATIVE_SRC)) $(wildcard tests/cuda_emu/*.cpp tests/cuda_emu/include/*.h)

.PHONY: all demo test bench lint format nvcc-check clean

all: $(VENV)/.built

$(VENV)/.deps: requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# One compile: the editable install (the package for `python -m ddpcomm.run` and the
# ddpcomm-run script) builds the extension in place, keeping ninja's objects in build/
# (setup.py), so .built then only relinks, and after an edit recompiles what changed.
$(VENV)/.installed: $(VENV)/.deps pyproject.toml
	MAX_JOBS=2 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

$(VENV)/.built: $(VENV)/.installed $(NATIVE_SRC)
	MAX_JOBS=2 $(PY) setup.py -q build_ext --inplace
	$(PY) -c "import ddpcomm, json; print('ddpcomm', json.dumps(ddpcomm.build_info()))"
	touch $@

demo: all
	$(PY) -m ddpcomm.bench demo

test: all nvcc-check
	$(PY) -m pytest -q tests

# Regenerates benchmarks/results/kernels/cpu.json (benchmarks/README.md lists every result
# and its command; each command prints its table).
bench: all
	$(PY) -m ddpcomm.bench kernels --sizes 64 --out benchmarks/results/kernels/cpu.json

# The user guide and API reference (docs/) into docs/_build/html, warnings as errors;
# tests/test_docs.py runs the same build in `make test`.
.PHONY: docs
docs: all
	$(PY) -m sphinx -W --keep-going -q -b html -c docs . docs/_build/html
	@echo "open docs/_build/html/index.html"

# On a machine with a GPU: builds in place for its card, runs the CUDA tests, compute-sanitizer
# (memcheck, racecheck, synccheck) and the kernels bench, and writes benchmarks/results/gpu/<card>.txt.
# It uses the machine's own python3 (no venv, no installs); without a GPU it skips those steps.
# Where a command may run 10 minutes at most: GPU_CHECK="--only build", then "--only tests,sanitize",
# then "--only bench" (the report keeps every step's last outcome).
GPU_PYTHON ?= python3
.PHONY: gpu-check
gpu-check:
	$(GPU_PYTHON) .ci/gpu_check.py $(GPU_CHECK)

# Compiles every CUDA kernel file with plain nvcc (no torch headers, no GPU needed), and
# syntax-checks every CUDA torch binding against the CPU wheel's headers (see below).
nvcc-check: cuda-check

lint: $(VENV)/.deps
	$(VENV)/bin/ruff check ddpcomm tests benchmarks .ci
	$(VENV)/bin/ruff format --check ddpcomm tests benchmarks .ci
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_FILES)

format: $(VENV)/.deps
	$(VENV)/bin/ruff format ddpcomm tests benchmarks
	$(VENV)/bin/clang-format -i $(CXX_FILES)

clean:
	rm -rf build ddpcomm/*.so $(VENV)/.built

# --- CUDA compile checks (issue 5) ----------------------------------------------------
# Kernels: `nvcc -c` for sm_80 and sm_90 with the flags torch's CUDAExtension adds
# (no implicit half/bf16 conversions) plus ours (--fmad=false keeps GPU and CPU bits
# equal); warnings are errors. Bindings: `g++ -fsyntax-only` against .venv's torch headers
# (the CPU wheel ships c10/cuda and ATen/cuda) and the toolkit's; the CPU wheel lacks the
# generated c10/cuda/impl/cuda_cmake_macros.h, which C10_CUDA_NO_CMAKE_CONFIGURE_FILE
# skips. One stamp per file, so only edited files are checked again.
CUDA_CHECK_DIR := build/cuda-check
# The toolkit's include dir as nvcc itself reports it (nvcc may be a wrapper script).
CUDA_INC := $(if $(NVCC),$(shell $(NVCC) --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | \
  sed -n 's/^#\$$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -n 1))
TORCH_INC = $(wildcard $(VENV)/lib/python3*/site-packages/torch/include)
CUDA_HDRS := csrc/numerics.h csrc/checks.h csrc/flatten.h $(wildcard csrc/cuda/*.h csrc/cuda/*.cuh)
CUDA_KERNEL_OBJS := $(patsubst csrc/cuda/%.cu,$(CUDA_CHECK_DIR)/%.o,$(wildcard csrc/cuda/*_kernels.cu))
CUDA_BINDING_STAMPS := $(patsubst csrc/cuda/%.cpp,$(CUDA_CHECK_DIR)/%.syntax,$(wildcard csrc/cuda/*.cpp))
NVCC_CHECK_FLAGS := -std=c++17 -O3 --fmad=false -Icsrc -Werror all-warnings \
  -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr

.PHONY: cuda-check
ifneq ($(NVCC),)
cuda-check: $(CUDA_KERNEL_OBJS) $(CUDA_BINDING_STAMPS)
else
cuda-check:
	@echo "nvcc not found: CUDA kernels and bindings not compile-checked"
endif

$(CUDA_CHECK_DIR)/%.o: csrc/cuda/%.cu $(CUDA_HDRS)
	@mkdir -p $(CUDA_CHECK_DIR)
	@echo "nvcc -c $< (sm_80, sm_90)"
	@$(NVCC) $(NVCC_CHECK_FLAGS) -c $< -o $@

$(CUDA_CHECK_DIR)/%.syntax: csrc/cuda/%.cpp $(CUDA_HDRS) $(VENV)/.deps
	@mkdir -p $(CUDA_CHECK_DIR)
	@echo "g++ -fsyntax-only $<"
	@g++ -fsyntax-only -std=c++20 -Wall -Wextra -Werror -DDDPCOMM_WITH_CUDA \
	  -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -Icsrc -isystem $(TORCH_INC) \
	  -isystem $(TORCH_INC)/torch/csrc/api/include -isystem $(CUDA_INC) $<
	@touch $@

# The results over shaped 1 and 10 Gbit/s links between network namespaces (needs root;
# without it the runs fall back to loopback, say so, and should not be committed).
# Regenerates benchmarks/results/{collectives,train,fsdp}/, as its README lists.
.PHONY: bench-net
bench-net: all
	$(PY) -m ddpcomm.bench collectives --link 1gbit --world 2 --sizes 64 --methods allreduce,q8,q4,q2,q1.5,q1,topk:0.01,randk:0.01 --iters 9 --out benchmarks/results/collectives/1gbit_2ranks.json
	$(PY) -m ddpcomm.bench collectives --link 1gbit --world 4 --sizes 64 --methods allreduce,torch-fp16,torch-qpt,q8 --iters 5 --out benchmarks/results/collectives/1gbit_4ranks.json
	$(PY) -m ddpcomm.bench collectives --link 10gbit --world 2 --sizes 16,64 --methods allreduce,torch-fp16,powersgd-r4,q8,q4,q1 --iters 5 --out benchmarks/results/collectives/10gbit_2ranks.json
	$(PY) -m ddpcomm.bench train --link 1gbit --methods nocomm,ddp,q8,q4 --out benchmarks/results/train/1gbit_2ranks.json
	$(PY) -m ddpcomm.bench train --link 1gbit --world 4 --steps 60 --methods nocomm,ddp,q8,q4 --out benchmarks/results/train/1gbit_4ranks.json
	$(PY) -m ddpcomm.bench fsdp --link 1gbit --out benchmarks/results/fsdp/1gbit.json
	$(PY) benchmarks/plots.py

# Adaptive pass-through against plain and each fixed method: loopback, 10 and 1 Gbit/s
# (needs root), 2 and 4 ranks, 1/16/64 MiB; then training with q8 and q8,adaptive (the
# warm-up covers adaptive's first two rounds). A ',adaptive' joins the method before it.
ADAPTIVE_METHODS = allreduce,q8,q8,adaptive,q4,q4,adaptive,q2,q2,adaptive,q1,q1,adaptive,topk:0.01,topk:0.01,adaptive,randk:0.01,randk:0.01,adaptive
.PHONY: bench-adaptive
bench-adaptive: all
	$(PY) -m ddpcomm.bench collectives --world 2,4 --sizes 1,16,64 --methods $(ADAPTIVE_METHODS) --iters 15 --out benchmarks/results/adaptive/collectives_loopback.json
	$(PY) -m ddpcomm.bench collectives --link 10gbit --world 2,4 --sizes 1,16,64 --methods $(ADAPTIVE_METHODS) --iters 15 --out benchmarks/results/adaptive/collectives_10gbit.json
	$(PY) -m ddpcomm.bench collectives --link 1gbit --world 2,4 --sizes 1,16,64 --methods $(ADAPTIVE_METHODS) --iters 15 --out benchmarks/results/adaptive/collectives_1gbit.json
	$(PY) -m ddpcomm.bench train --warmup-steps 40 --methods ddp,q8,q8,adaptive --out benchmarks/results/adaptive/train_loopback.json
	$(PY) -m ddpcomm.bench train --link 1gbit --warmup-steps 40 --methods ddp,q8,q8,adaptive --out benchmarks/results/adaptive/train_1gbit.json
	$(PY) benchmarks/plots.py

# Multi-node: 2 nodes of 2 ranks, a network namespace each (a node's ranks talk over its
# loopback), joined by a shaped 1 or 10 Gbit/s link (needs root): plain and each method
# flat and two-level, 64 MiB; then GPT training with DDP's default and q8, q4 flat and
# two-level at 1 Gbit/s. Regenerates benchmarks/results/nodes/.
NODES = --nodes 2 --ranks-per-node 2
.PHONY: bench-nodes
bench-nodes: all
	mkdir -p benchmarks/results/nodes
	$(PY) -m ddpcomm.bench collectives $(NODES) --link 1gbit --sizes 64 --iters 9 --out benchmarks/results/nodes/collectives_1gbit.json
	$(PY) -m ddpcomm.bench collectives $(NODES) --link 10gbit --sizes 64 --iters 9 --out benchmarks/results/nodes/collectives_10gbit.json
	$(PY) -m ddpcomm.bench train $(NODES) --link 1gbit --steps 60 --methods nocomm,ddp,q8,q8,hierarchy=2,q4,q4,hierarchy=2 --out benchmarks/results/nodes/train_1gbit.json

# Joins one run per seed into a study file: $(STUDY) NAME OUT RUN.json ...
STUDY = $(PY) -c 'import json, sys; json.dump({"command": "train", "study": sys.argv[1], "runs": [json.load(open(p)) for p in sys.argv[3:]]}, open(sys.argv[2], "w"))'

# Low-bit fidelity: each method at its defaults (schedules written out, so that rows keep
# their meaning when a default changes) and without its schedule, on the 600-step AdamW +
# gradient-accumulation GPT (loopback: losses do not depend on the link), seeds 0-3, on
# the synthetic language and on English text. One study file per corpus holds every
# seed's run (the bench writes one run per file; the last line of the loop joins them).
# The committed study predates the normalize option: its q2 and q1 rows are normalize=0;
# run again, they measure q2 and q1 with their current default (normalize=64).
FIDELITY_METHODS = ddp,q8,q4,q4,error_feedback,q2,start_iter=100,ramp=200,q1,start_iter=100,ramp=200,topk:0.01,start_iter=200,ramp=200,randk:0.01,start_iter=200,ramp=200,q2,start_iter=0,ramp=0,q1,start_iter=0,ramp=0,topk:0.01,start_iter=0,ramp=0,randk:0.01,start_iter=0,ramp=0
FIDELITY_MODEL = --steps 600 --d-model 128 --heads 4 --batch 2 --accum 4 --lr-decay cosine --lr 2e-3 --timeout 900
FIDELITY_DATA = markov:--vocab=1024 text:--eval-batch=256
.PHONY: bench-fidelity
bench-fidelity: all
	mkdir -p bench-out/fidelity
	set -e; for d in $(FIDELITY_DATA); do c=$${d%%:*}; for s in 0 1 2 3; do \
	  $(PY) -m ddpcomm.bench train --data $$c $${d#*:} --seed $$s --methods $(FIDELITY_METHODS) $(FIDELITY_MODEL) --out bench-out/fidelity/$$c-$$s.json; done; \
	  $(STUDY) fidelity_$$c benchmarks/results/fidelity/$$c.json bench-out/fidelity/$$c-?.json; done
	$(MAKE) bench-fidelity-normalized

# q2 and q1 at their current default (normalize=64), and q1.5 at its own (normalize=128), on
# the same runs, with DDP beside them.
.PHONY: bench-fidelity-normalized
bench-fidelity-normalized: all
	mkdir -p bench-out/fidelity
	set -e; for q in q1:$(Q1_N64) q2:$(Q2_N64) q15:q1.5; do for d in $(FIDELITY_DATA); do c=$${d%%:*}; for s in 0 1 2 3; do \
	  $(PY) -m ddpcomm.bench train --data $$c $${d#*:} --seed $$s --methods ddp,$${q#*:} $(FIDELITY_MODEL) --out bench-out/fidelity/$${q%%:*}n-$$c-$$s.json; done; \
	  $(STUDY) $${q%%:*}_normalize_$$c benchmarks/results/fidelity/$${q%%:*}_normalize_$$c.json bench-out/fidelity/$${q%%:*}n-$$c-?.json; done; done
	$(PY) benchmarks/tables.py benchmarks/results/fidelity/markov.json benchmarks/results/fidelity/text.json
	$(PY) benchmarks/plots.py

# Steady state: where q2, q1 and top-k lose accuracy with AdamW once past their warm-up.
# The fidelity GPT on English text for 1200 steps, seeds 0-1: each method's gap and how
# far each parameter kind's weights end from DDP's; one run that compares each bucket's
# reduced gradient with the exact mean every 50 steps, by parameter kind; runs whose
# AdamW takes the exact mean in one of its moments (--adam-exact m, v); q2 with and
# without normalize, seeds 0-3; q1 with one parameter kind's gradients exact; q1.5 at its
# defaults, seeds 0-7; and LocalSteps at its defaults (q2 every 4 steps) and with q4 every
# 8 steps, seeds 0-7 (against
# the DDP runs of q2's and q1.5's studies: the same seeds give the same DDP run).
Q1_N0 = q1,start_iter=100,ramp=200,normalize=0
Q1_N64 = q1,start_iter=100,ramp=200,normalize=64
Q2_N0 = q2,start_iter=100,ramp=200,normalize=0
Q2_N64 = q2,start_iter=100,ramp=200,normalize=64
# --exact-params: the token embedding, the head, the attention and the MLP weights exact
EXACT_PARAMS = '^tok[.]' '^head[.]' '[.](qkv|proj)[.]' '[.](fc|out)[.]'
TOPK_DEFAULT = topk:0.01,start_iter=200,ramp=200
STEADY_METHODS = ddp,q8,q4,$(Q1_N0),$(Q1_N64),$(TOPK_DEFAULT),q1,start_iter=0,ramp=0,normalize=0
STEADY_MODEL = --data text --eval-batch=256 --steps 1200 --d-model 128 --heads 4 --batch 2 --accum 4 --lr-decay cosine --lr 2e-3 --timeout 1800
.PHONY: bench-steady
bench-steady: all
	mkdir -p bench-out/steady benchmarks/results/steady_state
	set -e; for s in 0 1; do $(PY) -m ddpcomm.bench train $(STEADY_MODEL) --seed $$s --methods $(STEADY_METHODS) --out bench-out/steady/text-$$s.json; done
	$(STUDY) steady_text benchmarks/results/steady_state/text_1200.json bench-out/steady/text-?.json
	$(PY) -m ddpcomm.bench train $(STEADY_MODEL) --seed 0 --probe-every 50 --methods ddp,q8,$(Q1_N0),$(Q1_N64),$(TOPK_DEFAULT) --out benchmarks/results/steady_state/probe.json
	set -e; for m in m v; do $(PY) -m ddpcomm.bench train $(STEADY_MODEL) --seed 0 --adam-exact $$m --methods ddp,$(Q1_N0),$(Q1_N64),$(TOPK_DEFAULT) --out bench-out/steady/exact-$$m.json; done
	$(STUDY) adam_exact benchmarks/results/steady_state/adam_exact.json bench-out/steady/exact-?.json
	set -e; for s in 0 1 2 3; do $(PY) -m ddpcomm.bench train $(STEADY_MODEL) --seed $$s --methods ddp,$(Q2_N0),$(Q2_N64) --out bench-out/steady/q2-$$s.json; done
	$(STUDY) steady_q2 benchmarks/results/steady_state/q2_1200.json bench-out/steady/q2-?.json
	set -e; for s in 0 1 2 3; do $(PY) -m ddpcomm.bench train $(STEADY_MODEL) --seed $$s --methods ddp,topk:0.01,topk:0.0133,value_dtype=bfloat16 --out bench-out/steady/topk-$$s.json; done
	$(STUDY) steady_topk benchmarks/results/steady_state/topk_bf16_1200.json bench-out/steady/topk-?.json
	set -e; for s in 0 1 2 3 4 5 6 7; do $(PY) -m ddpcomm.bench train $(STEADY_MODEL) --seed $$s --methods ddp,q1.5 --out bench-out/steady/q15-$$s.json; done
	$(STUDY) steady_q15 benchmarks/results/steady_state/q15_1200.json bench-out/steady/q15-?.json
	set -e; for s in 0 1 2 3 4 5 6 7; do $(PY) -m ddpcomm.bench train $(STEADY_MODEL) --seed $$s --methods local:4,compression=q2,local:8,compression=q4 --out bench-out/steady/local-$$s.json; done
	$(STUDY) steady_local benchmarks/results/steady_state/local_1200.json bench-out/steady/local-?.json
	set -e; i=0; for p in $(EXACT_PARAMS); do i=$$((i + 1)); $(PY) -m ddpcomm.bench train $(STEADY_MODEL) --seed 0 --exact-params "$$p" --methods ddp,$(Q1_N64) --out bench-out/steady/params-$$i.json; done
	$(STUDY) exact_params benchmarks/results/steady_state/exact_params.json bench-out/steady/params-?.json
	$(PY) benchmarks/plots.py
