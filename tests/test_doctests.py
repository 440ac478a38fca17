"""The runnable examples in the docstrings of the paged serving path run and print what they say
(modules whose examples need no model; a docstring edit that breaks one fails here)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["kvtier.kernels.paged", "kvtier.caches.paged_shared", "kvtier.serve.graphs", "kvtier.serve.prefix",
           "kvtier.serve.scheduler", "kvtier.prefill", "kvtier.kernels.reference", "kvtier.devices"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example to run"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"
