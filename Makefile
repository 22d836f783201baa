# The two commands of the README. Both create .venv and install the project's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean notebooks docs-image lint typecheck gpu-check bench

demo: $(STAMP)
	$(BIN)/python -m tpkit demo --steps 20 --warmup 3 --out tpkit_report

# pytest's own script, not `python -m pytest`: the repo root on sys.path would let the top-level
# datasets/ and kernels/ folders shadow PyPI's datasets and kernels (transformers imports them).
test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/pytest -q tests

setup: $(STAMP)

# Hygiene, run by .ci/run: ruff (pyflakes, bugbear, import order, docstrings on public names),
# the layer contract (import-linter, docs/ARCHITECTURE.md) and mypy on tpkit/.
lint: $(STAMP)
	$(BIN)/ruff check tpkit kernels datasets tests benchmarks
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# One prepared GPU check (benchmarks/gpu_check.py): <= 8 minutes on one H200; writes
# benchmarks/results/gpu_check/ and the reference runs in datasets/reference_runs/.
# DRY=1 runs its CPU half (CI does, in tests/test_gpu_check.py). GPU_PY: a Python whose torch is a
# CUDA build (on a GPU image without .venv: make gpu-check GPU_PY=python3).
GPU_PY ?= $(BIN)/python
gpu-check: $(if $(DRY),$(STAMP))
	$(GPU_PY) benchmarks/gpu_check.py $(if $(DRY),--dry)

# Every CPU speed claim of the README's table, one script after another (over half an hour on 2
# cores; run it on an otherwise idle machine): each prints its table with the named peer's
# ratio and writes benchmarks/results/<script>.csv and the printed output to <script>_run.txt,
# headed by the command and the time. BENCHES=... runs a subset. The GPU's are gpu-check's.
BENCHES ?= overhead comm_probe floors counting_allocator step_faults memory_probe_parts memory_overhead memory_walk clocks_overhead h2d_wrappers collate loader loader_refill loader_dispatch loader_write loader_read loader_answer loader_cpu_split skeleton_pickle offload ranks_scale render
bench: SHELL := /bin/bash
bench: $(STAMP)
	@set -eo pipefail; for b in $(BENCHES); do \
	  out=benchmarks/results/$${b}_run.txt; echo "== benchmarks/$$b.py -> $$out"; \
	  { echo "# python benchmarks/$$b.py (defaults, via make bench), $$(date -u '+%Y-%m-%d %H:%M') UTC; printed output"; \
	    $(BIN)/python benchmarks/$$b.py 2>&1; } | tee $$out.part; \
	  mv $$out.part $$out; \
	done

# The tutorials, executed with outputs into notebooks/executed/ (gitignored; git keeps them clean).
notebooks: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python notebooks/nbtool.py run

# The README's picture of the dashboard, rendered offline by vl-convert.
docs-image: $(STAMP)
	$(BIN)/python docs/make_image.py

# torch is installed first and pinned, so pip takes the CPU wheel instead of a CUDA build.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,integrations,bench]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) tpkit_report tpkit_runs
