"""End-to-end decode throughput against HF generate, and against the memory-bandwidth roofline.

The same benchmark as ``kvtier bench decode``; see :mod:`kvtier_bench.decode`.
Run: ``python benchmarks/decode.py [--threads 1] [--plot benchmarks/decode.png]``.
"""

import sys

from kvtier.cli import main

if __name__ == "__main__":  # the checks and errors of `kvtier bench decode`
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
