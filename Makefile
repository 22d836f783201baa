# The two commands of the README. Both create .venv and install the project's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

demo: $(STAMP)
	$(BIN)/python -m tpkit demo --steps 20 --warmup 3 --out tpkit_report

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests

setup: $(STAMP)

# torch is installed first and pinned, so pip takes the CPU wheel instead of a CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) tpkit_report tpkit_runs
