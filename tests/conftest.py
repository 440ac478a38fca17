"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def seed() -> int:
    """Seeds torch's global generator so a test's random tensors repeat; returns the seed."""
    torch.manual_seed(0)
    return 0
