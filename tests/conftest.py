"""Shared fixtures.

Without CUDA, the Triton kernels run under Triton's interpreter. It must be
switched on before ``triton`` itself is first imported (Triton builds its
language module at import), so it is set here, before any test module loads.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.register_assert_rewrite("triton_support")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Under pytest-xdist (``make test`` runs one worker a core), each worker takes its share of
    # the cores for torch's threads, so that two workers do not fight over one core's work.
    # (On a GPU machine the workers keep torch's default: benchmarks/gpu_run.sh's GPU tests
    # encode long rows on the host and were timed that way.)
    _WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _WORKERS > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // _WORKERS))


@pytest.fixture
def seed() -> int:
    """Seeds torch's global generator so a test's random tensors repeat; returns the seed."""
    torch.manual_seed(0)
    return 0


@pytest.fixture(scope="module")
def lm():
    """The default model and tokenizer on the CPU in float32, loaded once per module."""
    from kvtier.model import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_generate.py
    yield load_model(device="cpu", dtype=torch.float32, progress=False)
    torch.set_num_threads(threads)


@pytest.fixture
def cli_on_lm(lm, monkeypatch):
    """The command line on the module's ``lm`` (no model is loaded) and without the caller's
    ``KVTIER_*`` settings."""
    from kvtier import cli_run

    monkeypatch.setattr(cli_run, "_load", lambda args: lm)
    for name in [k for k in os.environ if k.startswith(("KVTIER_", "MTPLX_"))]:
        monkeypatch.delenv(name)
