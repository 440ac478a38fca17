"""The serving engine's prefix cache file against a restart that computes every prefix again.

The same benchmark as ``kvtier bench restart``; see :mod:`kvtier_bench.restart`.
Run: ``python benchmarks/restart.py [--documents 8] [--document-tokens 512] [--json FILE]``.
"""

import sys

from kvtier.cli import main

if __name__ == "__main__":  # the checks and errors of `kvtier bench restart`
    sys.exit(main(["bench", "restart", *sys.argv[1:]]))
