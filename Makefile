# The README's commands. `make demo` and `make test` build a virtual environment in $(VENV)
# from this repository's own files first (torch: $(TORCH), the CPU wheel on CPU-only machines;
# pass TORCH=torch, or SYSTEM_SITE=1 to reuse an installed CUDA torch).
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
SYSTEM_SITE ?= 0
VPY := $(VENV)/bin/python
OUT ?= runs/demo
# pytest-xdist processes for `make test` (the interpreted kernels are CPU-bound; 0: one process).
TEST_WORKERS ?= $(shell $(PY) -c "import os; print(min(8, os.cpu_count() or 1))")

.PHONY: setup test demo bench bench-smoke gpu-test lint clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(if $(filter 1,$(SYSTEM_SITE)),--system-site-packages) $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[test,example,bench]"
	touch $@

setup: $(VENV)/.installed

# CPU: the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
test: setup
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

# The main job: a short GPT training on the Python standard library's sources.
demo: setup
	$(VPY) examples/train_gpt.py --preset tiny --steps 300 --out $(OUT)

# GPU machines: run with the Python that has CUDA torch and triton (no venv, no network needed).
gpu-test:
	PYTHONPATH=$(CURDIR) bash scripts/gpu_test.sh gpu-results

bench:
	PYTHONPATH=$(CURDIR) $(PY) -u bench/bench.py --quick --out bench/results/auto

bench-smoke: setup
	$(VPY) bench/bench.py --smoke --out /tmp/fused_norm-bench-smoke

lint: setup
	$(VPY) -m pip install -q ruff
	$(VPY) -m ruff check fused_norm tests examples bench scripts
	$(VPY) -m ruff format --check fused_norm tests examples bench scripts

clean:
	rm -rf $(VENV) .ci-venv runs gpu-results .pytest_cache .hypothesis
