"""A rich progress bar on stderr for the long benchmarks, off where stderr is not a terminal.

Runs of ``kvtier bench decode``, ``hf``, ``speculative`` or ``serve`` take from tens of
seconds to minutes; the bar says which contender runs and how many runs are left. It
draws on stderr only, so tables and ``--json`` output on stdout stay clean, and it is
transient: it leaves no trace once done. Redirected to a file or a pipe (CI, ``2> log``),
it draws nothing at all.

Example::

    >>> with BenchProgress("decode", total=2) as bar:
    ...     for name in ("kvtier tail", "HF DynamicCache"):
    ...         bar.advance(name)  # names the run that starts, counts the one before as done
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class BenchProgress:
    """A bar over ``total`` runs titled ``description``; a no-op unless ``console`` is a
    terminal (default: a console on stderr).

    ``advance(label)`` marks the run before as done (all but the first call) and names the
    run that starts; leaving the ``with`` block counts the last one and removes the bar.
    """

    def __init__(self, description: str, total: int, *, console: Console | None = None):
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be an int >= 0 (the number of runs), got {total!r}")
        console = Console(file=sys.stderr) if console is None else console
        self.description, self.started = description, False
        self.bar: Progress | None = None
        if console.is_terminal:
            # stdout printed while the bar runs goes above it where both are the terminal; where
            # stdout is a file or a pipe it must stay there, not come out on stderr
            self.bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                transient=True, redirect_stdout=sys.stdout.isatty())
            self.task = self.bar.add_task(description, total=total)

    def __enter__(self) -> BenchProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def advance(self, label: str = "") -> None:
        """Count the run before this one as done and show ``label`` (the run now starting)."""
        if self.bar is None:
            return
        text = f"{self.description}: {label}" if label else self.description
        self.bar.update(self.task, advance=int(self.started), description=text)
        self.started = True

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=int(self.started))
            self.bar.stop()
            self.bar = None
