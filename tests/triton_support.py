"""What the Triton kernel test modules share: running their tests in this process or,
when triton was imported before ``TRITON_INTERPRET`` was set, in a fresh one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def interpret_without_cuda():
    """The device kernel tests run on: CUDA when present, else the CPU under Triton's
    interpreter (``TRITON_INTERPRET=1``, set here: call it before triton is imported)."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def needs_interpreter_mark():
    """A ``skipif`` for kernel tests without CUDA whose module set ``TRITON_INTERPRET`` too late
    (triton decides at import). Call it after the module has set the variable."""
    import torch

    from kvtier.kernels import triton_paged

    return pytest.mark.skipif(not torch.cuda.is_available() and not triton_paged.interpreted(),
                              reason="triton was imported before the interpreter was switched on")


def in_this_process_or_a_fresh_one(in_process: bool, test_file: str):
    """The autouse fixture and the test a kernel module binds at its top level.

    When ``in_process`` is false every test of the module but ``test_in_a_fresh_process``
    is skipped, and that one runs ``test_file`` again in a fresh interpreted process.
    """

    @pytest.fixture(autouse=True)
    def _kernels_in_this_process(request):
        if not in_process and request.node.name != "test_in_a_fresh_process":
            pytest.skip("triton was imported before TRITON_INTERPRET was set: see test_in_a_fresh_process")

    @pytest.mark.skipif(in_process, reason="the kernels run in this process")
    def test_in_a_fresh_process():
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]

    return _kernels_in_this_process, test_in_a_fresh_process
