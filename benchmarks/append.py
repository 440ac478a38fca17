"""Per-token append cost of the tail and block tiers against HF DynamicLayer.

The same benchmark as ``kvtier bench append``; see :mod:`kvtier_bench.append`.
Run: ``python benchmarks/append.py [--quick] [--contexts 1024,8192,32768]``.
"""

import argparse
import sys

from kvtier_bench import append


def main() -> int:
    parser = argparse.ArgumentParser(description=append.__doc__.splitlines()[0])
    append.add_arguments(parser)
    return append.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
