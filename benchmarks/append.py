"""Per-token append cost of the tail and block tiers against HF DynamicLayer.

The same benchmark as ``kvtier bench append``; see :mod:`kvtier_bench.append`.
Run: ``python benchmarks/append.py [--quick] [--contexts 1024,8192,32768]``.
"""

import sys

from kvtier.cli import main

if __name__ == "__main__":  # the checks and errors of `kvtier bench append`
    sys.exit(main(["bench", "append", *sys.argv[1:]]))
