"""CPU threads worth asking for (:mod:`kvtier.devices`): more than the CPUs is allowed but warned of."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvtier import cli
from kvtier.devices import check_threads, oversubscribed, set_threads, usable_cpus


@pytest.mark.parametrize("threads, ranks, cpus, most", [(3, 1, 2, 2), (2, 2, 2, 1), (5, 1, 4, 4), (3, 2, 4, 2)])
def test_more_threads_than_cpus_is_named_with_the_most_that_fit(threads, ranks, cpus, most) -> None:
    note = oversubscribed(threads, ranks, cpus=cpus)
    each = f" on each of {ranks} ranks" if ranks > 1 else ""
    assert note == (f"--threads {threads}{each} is more than the {cpus} CPUs this process may run on: OpenMP's "
                    f"threads then wait for one another at every product, and a step takes many times as long; "
                    f"use at most {most}")


def test_more_ranks_than_cpus_is_told_to_use_fewer_ranks() -> None:
    """One thread a rank is already too many: "use at most 1" would not be a fix."""
    note = oversubscribed(1, 3, cpus=2)
    assert note.startswith("--threads 1 on each of 3 ranks is more than the 2 CPUs")
    assert note.endswith("; use at most 2 ranks (--tensor-parallel) of one thread each")


@pytest.mark.parametrize("threads, ranks, cpus", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 4)])
def test_threads_that_fit_the_cpus_get_no_warning(threads, ranks, cpus) -> None:
    assert oversubscribed(threads, ranks, cpus=cpus) is None
    assert check_threads(threads, cpus=cpus) == threads


def test_set_threads_checks_warns_and_sets() -> None:
    before = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning at what the CPUs hold
            set_threads(1)
        assert torch.get_num_threads() == 1
        with pytest.warns(UserWarning, match=rf"^--threads {usable_cpus() + 1} is more than the {usable_cpus()} CPUs"):
            set_threads(usable_cpus() + 1)
        assert torch.get_num_threads() == usable_cpus() + 1
        with pytest.raises(ValueError, match="--threads must be an int from 1 to"):
            set_threads(0)
        assert torch.get_num_threads() == usable_cpus() + 1  # refused before anything was set
    finally:
        torch.set_num_threads(before)


def test_the_server_warns_of_more_threads_than_cpus_before_the_model_loads(tmp_path, capsys) -> None:
    """The warning comes with the flags' checks: here a refusal that also comes before the model
    (named, and missing) is read."""
    n = usable_cpus() + 1
    argv = ["serve", "--threads", str(n), "--device", "cpu", "--model", str(tmp_path / "missing.gguf"),
            "--batch-invariant", "--kv-quant", "fp8"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"kvtier: warning: --threads {n} is more than the {usable_cpus()} CPUs" in err, err
    assert "fp8 pages (--kv-quant fp8)" in err and "missing.gguf" not in err, err
