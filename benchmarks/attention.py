"""Paged decode attention bandwidth against PyTorch SDPA, quantised pages, and the write kernel.

The same benchmark as ``kvtier bench attention``; see :mod:`kvtier_bench.attention`.
Run: ``python benchmarks/attention.py [--sweep] [--out benchmarks/results_gpu_attention.md]``.
"""

import argparse
import sys

from kvtier_bench import attention


def main() -> int:
    parser = argparse.ArgumentParser(description=attention.__doc__.splitlines()[0])
    attention.add_arguments(parser)
    return attention.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
