# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing
# and install through constraints.txt, which pins the CPU build of torch.
SHELL  := /bin/bash
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c constraints.txt
STAMP  := $(VENV)/.installed
# `make demo` installs only what the demo needs (torch, gradtap, the demo extra); `make test`
# installs everything else on top. pip reuses its cache (~/.cache/pip) for both.
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: setup test test-compat gpu-check demo lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	@! $(PY) -m pip list 2>/dev/null | grep -i '^nvidia-' || (echo "nvidia-* packages found in .venv" && false)
	touch $(STAMP) $(DEMO_STAMP)

# The demo's own install, in one pip run; a .venv that has everything (the stamp above) has it
# too. --no-compile: Python compiles the modules the demo imports when it imports them, not
# every file of torch up front.
$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --no-compile torch==2.13.0 -e ".[demo]"
	@! $(PY) -m pip list 2>/dev/null | grep -i '^nvidia-' || (echo "nvidia-* packages found in .venv" && false)
	touch $(DEMO_STAMP)

# Two pytest workers (pytest-xdist), one per core of the project machines; a worker that runs
# out of tests takes some from the other's queue. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST_XDIST := -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_XDIST)

# The compatibility job: the whole suite on the newest torch this machine has (with
# torchvision, whose vision-model tests run only there) and on the declared floor. Each venv
# installs the test extras through constraints.txt with only its torch line changed. The
# property-based per-sample suite draws its long profile here.
COMPAT       ?= 2.14.1 2.9.1
VISION_2.14.1 := torchvision==0.29.1

.venvs/torch-%/.installed: pyproject.toml constraints.txt
	test -x .venvs/torch-$*/bin/python || $(PYTHON) -m venv .venvs/torch-$*
	sed 's/^torch==.*/torch==$*/' constraints.txt > .venvs/torch-$*/constraints.txt
	.venvs/torch-$*/bin/python -m pip install -q -c .venvs/torch-$*/constraints.txt torch==$* $(VISION_$*)
	.venvs/torch-$*/bin/python -m pip install -q -c .venvs/torch-$*/constraints.txt -e ".[test]"
	touch $@

# One torch at a time: install, test, and with COMPAT_CLEAN=1 (what .ci/run sets) remove the
# venv before the next one is built, so the job needs the disk of one CUDA build, not of both.
COMPAT_CLEAN ?= 0

test-compat:
	@for v in $(COMPAT); do \
	  echo "== torch $$v ($$(df -h --output=avail . | tail -1 | tr -d ' ') free on disk)"; start=$$(date +%s); \
	  $(MAKE) --no-print-directory .venvs/torch-$$v/.installed || exit 1; \
	  GRADTAP_HYPOTHESIS_PROFILE=long .venvs/torch-$$v/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_XDIST) || exit 1; \
	  echo "== torch $$v: $$(( $$(date +%s) - start )) s"; \
	  if [ "$(COMPAT_CLEAN)" = 1 ]; then rm -rf .venvs/torch-$$v; fi; \
	done

# On a machine with an NVIDIA GPU: the CUDA cases of the suite and every benchmark, in a venv
# of its own with torch's CUDA build (from the registry); what they print lands in $(GPU_OUT).
GPU_TORCH ?= 2.14.1
GPU_OUT   ?= gpu-results

gpu-check:
	test -x .venvs/cuda/bin/python || $(PYTHON) -m venv .venvs/cuda
	sed 's/^torch==.*/torch==$(GPU_TORCH)/' constraints.txt > .venvs/cuda/constraints.txt
	.venvs/cuda/bin/python -m pip install -q -c .venvs/cuda/constraints.txt torch==$(GPU_TORCH)
	.venvs/cuda/bin/python -m pip install -q -c .venvs/cuda/constraints.txt -e ".[test,bench]"
	.venvs/cuda/bin/python -m pip install -q --no-deps backpack-for-pytorch
	.venvs/cuda/bin/python -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
	mkdir -p $(GPU_OUT)
	.venvs/cuda/bin/python -m pytest -q -m "cuda or gpu" -p no:cacheprovider 2>&1 | tee $(GPU_OUT)/cuda-tests.txt; exit $${PIPESTATUS[0]}
	.venvs/cuda/bin/python benchmarks/run_all.py --no-docs 2>&1 | tee $(GPU_OUT)/benchmarks.txt; exit $${PIPESTATUS[0]}

demo: $(DEMO_STAMP)
	$(VENV)/bin/gradtap demo --inject-nan 150

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy src/gradtap

bench: $(STAMP)
	$(PIP) -e ".[bench]"
	$(PIP) --no-deps backpack-for-pytorch
	@! $(PY) -m pip list 2>/dev/null | grep -i -E '^(nvidia-|torchvision )' || (echo "CUDA/torchvision packages in .venv" && false)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .venvs build *.egg-info src/*.egg-info .pytest_cache .hypothesis
