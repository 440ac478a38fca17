"""Shared fixtures.

Without CUDA, the Triton kernels run under Triton's interpreter. It must be
switched on before ``triton`` itself is first imported (Triton builds its
language module at import), so it is set here, before any test module loads.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def seed() -> int:
    """Seeds torch's global generator so a test's random tensors repeat; returns the seed."""
    torch.manual_seed(0)
    return 0
