"""Paged decode attention bandwidth against PyTorch SDPA, quantised pages, and the write kernel.

The same benchmark as ``kvtier bench attention``; see :mod:`kvtier_bench.attention`.
Run: ``python benchmarks/attention.py [--sweep] [--out benchmarks/results_gpu_attention.md]``.
"""

import sys

from kvtier.cli import main

if __name__ == "__main__":  # the checks and errors of `kvtier bench attention`
    sys.exit(main(["bench", "attention", *sys.argv[1:]]))
