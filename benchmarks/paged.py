"""Bytes per token, fragmentation and codec error of the paged tier.

The same benchmark as ``kvtier bench paged``; see :mod:`kvtier_bench.paged`.
Run: ``python benchmarks/paged.py [--sequences 64] [--plot benchmarks/paged.png]``.
"""

import sys

from kvtier.cli import main

if __name__ == "__main__":  # the checks and errors of `kvtier bench paged`
    sys.exit(main(["bench", "paged", *sys.argv[1:]]))
