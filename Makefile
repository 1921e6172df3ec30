# The README's commands. `make demo` and `make test` first build a virtual environment in
# $(VENV) from this repository's own files: torch ($(TORCH), if the venv has none; pass
# TORCH=... for another build, or SYSTEM_SITE=1 to reuse the torch of the system Python), then
# this package in editable mode with its extras (test, example, bench, hf), and on a GPU
# machine the C++ fast path (python -m fused_norm.build).
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
SYSTEM_SITE ?= 0
VPY := $(VENV)/bin/python
OUT ?= runs/demo
EXTRAS ?= test,example,bench,hf
# pytest-xdist processes for `make test` (the interpreted kernels are CPU-bound; 0: one process).
TEST_WORKERS ?= $(shell $(PY) -c "import os; print(min(8, os.cpu_count() or 1))")
SAY := @echo "fused_norm:"

.PHONY: setup test demo bench bench-smoke gpu-test lint clean

$(VENV)/.installed: pyproject.toml
	$(SAY) "creating $(VENV) with $(PY)$(if $(filter 1,$(SYSTEM_SITE)), (system site-packages visible))"
	$(PY) -m venv $(if $(filter 1,$(SYSTEM_SITE)),--system-site-packages) $(VENV)
	$(SAY) "upgrading pip in $(VENV)"
	$(VPY) -m pip install -q --upgrade pip
	@if $(VPY) -c "import torch" 2>/dev/null; then \
		echo "fused_norm: using the torch already there: $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "fused_norm: installing $(TORCH) into $(VENV): a large download, this takes about a minute or more"; \
		$(VPY) -m pip install "$(TORCH)"; \
	fi
	$(SAY) "installing fused_norm (editable) with the extras [$(EXTRAS)]: triton (Linux), einops, pytest, pytest-xdist, hypothesis, numpy, tqdm, matplotlib, transformers"
	$(VPY) -m pip install -e ".[$(EXTRAS)]"
	$(SAY) "building the C++ fast path of eager CUDA calls (skipped without a GPU)"
	$(VPY) -m fused_norm.build
	touch $@
	$(SAY) "$(VENV) is ready"

setup: $(VENV)/.installed

# CPU: the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) and
# the tests marked gpu / multigpu are deselected (one line at the end says how many).
test: setup
	$(SAY) "running the test suite $(if $(filter-out 0 1,$(TEST_WORKERS)),in $(TEST_WORKERS) pytest-xdist processes,in one process) (on CPU: several minutes)"
	$(VPY) -m pytest -q $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal) tests

# The main job: a short GPT training on the Python standard library's sources.
demo: setup
	$(SAY) "training the tiny GPT example for 300 steps (outputs in $(OUT))"
	$(VPY) examples/train_gpt.py --preset tiny --steps 300 --out $(OUT)

# GPU machines: run with the Python that has CUDA torch and triton (no venv, no network needed).
gpu-test:
	PYTHONPATH=$(CURDIR) bash scripts/gpu_test.sh gpu-results

bench:
	PYTHONPATH=$(CURDIR) $(PY) -u bench/bench.py --quick --out bench/results/auto

bench-smoke: setup
	$(VPY) bench/bench.py --smoke --out /tmp/fused_norm-bench-smoke

lint: setup
	$(SAY) "installing ruff into $(VENV)"
	$(VPY) -m pip install -q ruff
	$(VPY) -m ruff check fused_norm tests examples bench scripts
	$(VPY) -m ruff format --check fused_norm tests examples bench scripts

clean:
	rm -rf $(VENV) .ci-venv runs gpu-results .pytest_cache .hypothesis
