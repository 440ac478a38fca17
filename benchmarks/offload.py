"""The serving engine's host tier of the prefix cache against recomputing evicted prefixes.

The same benchmark as ``kvtier bench offload``; see :mod:`kvtier_bench.offload`.
Run: ``python benchmarks/offload.py [--documents 8] [--document-tokens 512] [--json FILE]``.
"""

import sys

from kvtier.cli import main

if __name__ == "__main__":  # the checks and errors of `kvtier bench offload`
    sys.exit(main(["bench", "offload", *sys.argv[1:]]))
