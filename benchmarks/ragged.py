"""One ragged decode step against row-by-row and padded tail caches.

The same benchmark as ``kvtier bench ragged``; see :mod:`kvtier_bench.ragged`.
Run: ``python benchmarks/ragged.py [--shape smollm2] [--device cuda] [--plot benchmarks/ragged.png]``.
"""

import sys

from kvtier.cli import main

if __name__ == "__main__":  # the checks and errors of `kvtier bench ragged`
    sys.exit(main(["bench", "ragged", *sys.argv[1:]]))
