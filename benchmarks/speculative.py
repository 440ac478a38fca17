"""Speculative decoding against plain decoding on the default model.

The same benchmark as ``kvtier bench speculative``; see :mod:`kvtier_bench.speculative`.
Run: ``python benchmarks/speculative.py [--max-tokens 256] [--drafters ngram,early-exit:24] [--json FILE]``.
"""

import sys

from kvtier.cli import main

if __name__ == "__main__":  # the checks and errors of `kvtier bench speculative`
    sys.exit(main(["bench", "speculative", *sys.argv[1:]]))
