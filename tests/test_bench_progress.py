"""kvtier_bench._progress: the bar draws only on a terminal, counts the runs, and never
writes to stdout."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvtier_bench._progress import BenchProgress


def console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=100), out


def test_on_a_terminal_the_bar_counts_the_runs_and_names_the_one_running(capsys):
    con, out = console(True)
    with BenchProgress("decode", 3, console=con) as bar:
        completed = []
        for name in ("warm-up", "round 1/1, kvtier tail", "round 1/1, HF DynamicCache"):
            bar.advance(name)
            task = bar.bar.tasks[0]
            completed.append(task.completed)
            assert task.description == f"decode: {name}"
        assert completed == [0, 1, 2]  # a run counts once the next one starts
        assert task.total == 3
    assert task.completed == 3 and bar.bar is None  # leaving the block counts the last run
    assert "decode" in out.getvalue()
    assert capsys.readouterr().out == ""  # stdout stays the tables' and --json's


def test_off_a_terminal_it_draws_nothing():
    con, out = console(False)
    with BenchProgress("serve", 2, console=con) as bar:
        bar.advance("kvtier LLMEngine")
        bar.advance("transformers")
    assert bar.bar is None and out.getvalue() == ""


def test_a_bad_total_is_refused():
    for bad in (-1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="total must be an int"):
            BenchProgress("x", bad)
