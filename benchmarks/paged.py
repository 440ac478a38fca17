"""Bytes per token, fragmentation and codec error of the paged tier.

The same benchmark as ``kvtier bench paged``; see :mod:`kvtier_bench.paged`.
Run: ``python benchmarks/paged.py [--sequences 64] [--plot benchmarks/paged.png]``.
"""

import argparse
import sys

from kvtier_bench import paged


def main() -> int:
    parser = argparse.ArgumentParser(description=paged.__doc__.splitlines()[0])
    paged.add_arguments(parser)
    return paged.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
