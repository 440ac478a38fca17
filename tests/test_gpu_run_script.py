"""benchmarks/gpu_run.sh's choice of steps (STEPS), run with a stand-in for python (``true``), so
no GPU is needed: the steps chosen run and are summarised, the others do not, and an unknown
step is refused before anything runs."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_run.sh"


def run(tmp_path: Path, steps: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(tmp_path / "out"), STEPS=steps, PYTHON="true")
    return subprocess.run(["bash", str(SCRIPT)], cwd=SCRIPT.parents[1], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("steps", ["attention", "attention hf", "decode_gpu", "decode_kernels"])
def test_only_the_chosen_steps_run(tmp_path, steps):
    done = run(tmp_path, steps)
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    ran = [line.split()[0] for line in summary if not line.startswith("total")]
    assert ran == steps.split()
    assert all(" ok " in line for line in summary if not line.startswith("total"))


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    done = run(tmp_path, "attention benchmark")
    assert done.returncode == 2
    assert "unknown step 'benchmark'" in done.stderr and "tests kernels attention decode_kernels decode_gpu hf" in done.stderr
    assert not (tmp_path / "out").exists()
