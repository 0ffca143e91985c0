"""Test-session settings shared by every test file."""

from __future__ import annotations

import os

import pytest
import torch

# The tests run many tiny tensor ops; one intra-op thread is faster for those and keeps the
# suite steady when other processes share the two cores (``make test`` runs two pytest
# workers, one per core). For the same reason the processes the tests start (benchmarks'
# timing children, scripts under ``gradtap watch``) take one thread too, and torch.compile's
# inductor compiles its kernels in this process instead of starting a pool of compile workers
# (both read from the environment: at a process's start, and when inductor is imported).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

#: Why the CUDA parameter of ``device`` is skipped here (only ever because there is no GPU).
NO_CUDA = "no CUDA GPU: torch.cuda.is_available() is false (run pytest -m cuda on a GPU machine)"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)])])
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device a numerical test runs on: CPU, and CUDA when a GPU is present."""
    return torch.device(request.param)


@pytest.fixture
def float64_seeded():
    """float64 as the default dtype (float64 oracles) and a fixed seed, for one test."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(old)
