"""Fixtures shared by the model's tests."""

from __future__ import annotations

import pytest

from kvtier.model.packed import load_kernels


@pytest.fixture(scope="module")
def kernels():
    """The packed linears' compiled kernels (skips where no C compiler builds them)."""
    k = load_kernels()
    if k is None:
        pytest.skip("no C compiler builds the packed kernels here")
    return k
