"""Real ``kvtier serve`` processes for the tests (serve and parallel): a free port, a server
started with given flags (waited for through ``/health``, stopped by its pid), and what its
routes report."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


def _ephemeral_low() -> int:
    """The lowest port the system hands out for outgoing connections and ``bind(0)``."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


_EPHEMERAL_LOW = _ephemeral_low()
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# Each xdist worker draws from its own slice of [20000, 32000), below the usual ephemeral range
# (32768-60999): a port from bind(0) lies in that range, where any outgoing connection (the
# tensor-parallel ranks open many while rank 0 loads, before it listens) or another worker's
# bind(0) can take it between the test's choice and the server's bind.
_SLICE = 12000 // max(1, _WORKERS)
_NEXT = iter(range(20000 + _WORKER * _SLICE, 20000 + (_WORKER + 1) * _SLICE))


def free_port() -> int:
    """A port no one holds now (each call a new one): from this worker's slice below the
    ephemeral range where the system's range starts above it (Linux's default), else the
    system's pick."""
    if _EPHEMERAL_LOW > 32000:
        for port in _NEXT:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, url: str, log: Path, within_s: float = 180) -> None:
    """Return once the server at ``url`` answers ``/health``; fail the test, with its log, if
    ``proc`` exits first or ``within_s`` seconds pass."""
    deadline = time.monotonic() + within_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"kvtier serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"kvtier serve did not answer /health within {within_s} s:\n{log.read_text()}")
        time.sleep(0.5)


@contextlib.contextmanager
def started_server(log: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``(base URL, process)`` of a ``kvtier serve`` started with ``flags``, stopped by its pid
    on exit (a test may stop it first); its log is shown if it fails to start, and must hold no
    traceback at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port), "--threads", "1", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url, log)
        yield url, proc
        assert "Traceback" not in log.read_text(), log.read_text()  # nothing failed inside it
    finally:
        proc.terminate()  # by its pid
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_server(log: Path, *flags: str) -> Iterator[str]:
    """Base URL of a :func:`started_server`."""
    with started_server(log, *flags) as (url, _):
        yield url


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics by name (labels joined into the name)."""
    text = httpx.get(f"{server}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def settle(server, timeout: float = 60.0) -> dict:
    """/health once nothing runs or waits (aborts land at the next engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{server}/health").json()
        if (h["running"] == h["waiting"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)
