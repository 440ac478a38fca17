"""`make setup` on a machine without CUDA: what pip would install decides where PyTorch
comes from. pip is replaced by a stand-in that logs its calls and answers the dry run with
a recorded report, so nothing is installed and no index is contacted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = [
    pytest.mark.skipif(shutil.which("make") is None, reason="needs make"),
    pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                       reason="with nvidia-smi, set-up takes the CUDA build on purpose"),
]


def _plan(*wheels: str) -> dict:
    """A pip --report with these name==version wheels to install."""
    return {"install": [{"metadata": dict(zip(("name", "version"), w.split("==")))}
                        for w in wheels]}


# what stock PyPI resolves torch==2.13.0 to on Linux x86-64 (recorded with a dry run, trimmed),
# what the local CPU wheel resolves to, and an environment that already holds torch
PLANS = {
    "pypi_cuda": _plan("torch==2.13.0", "cuda-toolkit==13.0.3.0", "nvidia-cudnn-cu13==9.20.0.48",
                       "nvidia-cublas==13.1.1.3", "triton==3.7.1", "sympy==1.14.0"),
    "cu_suffix": _plan("torch==2.13.0+cu126"),
    "cpu_wheel": _plan("torch==2.13.0+cpu", "sympy==1.14.0", "filelock==4.3.1"),
    "installed": _plan(),
}


def _setup(tmp_path, plan: str, cpu_index_reachable: bool):
    """Run `make setup` against a stand-in venv; returns (process, pip calls)."""
    venv, log = tmp_path / "venv", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "report.json").write_text(json.dumps(PLANS[plan]))
    python = venv / "bin" / "python"
    python.write_text(f"""#!/bin/sh
case "$1" in -c) exec {sys.executable} "$@";; esac
echo "$*" >> {log}
case "$*" in
  *--dry-run*) cat {tmp_path / "report.json"};;
  *--index-url*) exit {0 if cpu_index_reachable else 1};;
esac
""")
    python.chmod(0o755)
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "setup", f"VENV={venv}"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MAKEFLAGS": ""})
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls, (venv / ".kvtier-setup").exists()


PLAIN = '-m pip install -q torch==2.13.0'


@pytest.mark.parametrize("plan", ["pypi_cuda", "cu_suffix"])
def test_a_cuda_build_is_replaced_by_the_cpu_build(tmp_path, plan):
    proc, calls, done = _setup(tmp_path, plan, cpu_index_reachable=True)
    assert proc.returncode == 0 and done, proc.stderr
    assert f"{PLAIN} --index-url {CPU_INDEX}" in calls and PLAIN not in calls
    assert "CUDA build" in proc.stderr


def test_without_the_cpu_index_set_up_stops_instead_of_installing_cuda(tmp_path):
    proc, calls, done = _setup(tmp_path, "pypi_cuda", cpu_index_reachable=False)
    assert proc.returncode != 0 and not done
    assert PLAIN not in calls  # the CUDA build was never installed
    assert not any("-e .[" in c for c in calls)  # nor anything after it
    assert "CPU build (torch==2.13.0) cannot be had" in proc.stderr
    assert "nvidia-cudnn-cu13==9.20.0.48" in proc.stderr


@pytest.mark.parametrize("plan", ["cpu_wheel", "installed"])
def test_a_cpu_build_installs_directly_without_the_cpu_index(tmp_path, plan):
    proc, calls, done = _setup(tmp_path, plan, cpu_index_reachable=False)
    assert proc.returncode == 0 and done, proc.stderr
    assert PLAIN in calls and not any("--index-url" in c for c in calls)


def test_the_license_is_an_spdx_expression_without_deprecation_warnings(monkeypatch):
    """setuptools read the old `license = {text = ...}` table with a deprecation box."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)  # the readme is read relative to the project
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"
