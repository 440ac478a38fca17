"""kvtier's benchmarks: one module per ``kvtier bench NAME``, outside the library.

A benchmark module offers ``add_arguments(parser)`` and ``run(args) -> int``, and the
first line of its docstring is its help text. Modules whose names start with an
underscore are helpers. The package ships in a checkout's ``benchmarks/`` folder and
is importable after ``pip install -e .`` there (or with ``benchmarks/`` on the path).

``kvtier bench NAME`` (and ``python benchmarks/NAME.py``, which calls it) checks the
flags the modules share before one runs: ``--threads``, ``--repeats`` and
``--max-tokens`` at least 1, ``--warmup`` at least 0, ``--device`` a device torch
knows, ``--plot`` in a folder that exists (``.png`` added to a name without one;
folders are never created). Default plots go to :data:`FOLDER`, the checkout's
``benchmarks/``, whatever the working folder.

Example::

    >>> import kvtier_bench
    >>> "paged" in kvtier_bench.names()
    True
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

#: the checkout's benchmarks/ folder, where plots go by default (whatever the working folder)
FOLDER = Path(__file__).resolve().parent.parent


def names() -> list[str]:
    """The benchmarks of this package, sorted: every module that is not a helper."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
