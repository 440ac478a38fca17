"""kvtier's benchmarks: one module per ``kvtier bench NAME``, outside the library.

A benchmark module offers ``add_arguments(parser)`` and ``run(args) -> int``, and the
first line of its docstring is its help text. Modules whose names start with an
underscore are helpers. The package ships in a checkout's ``benchmarks/`` folder and
is importable after ``pip install -e .`` there (or with ``benchmarks/`` on the path).

Example::

    >>> import kvtier_bench
    >>> "paged" in kvtier_bench.names()
    True
"""

from __future__ import annotations

import pkgutil


def names() -> list[str]:
    """The benchmarks of this package, sorted: every module that is not a helper."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
