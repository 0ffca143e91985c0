# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing
# and install through constraints.txt, which pins the CPU build of torch.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c constraints.txt
STAMP  := $(VENV)/.installed

.PHONY: setup test demo lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	@! $(PY) -m pip list 2>/dev/null | grep -i '^nvidia-' || (echo "nvidia-* packages found in .venv" && false)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
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
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
