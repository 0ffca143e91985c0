"""Test-session settings shared by every test file."""

from __future__ import annotations

import torch

# The tests run many tiny tensor ops; one intra-op thread is faster for those and keeps the
# suite steady when other processes share the two cores.
torch.set_num_threads(1)
