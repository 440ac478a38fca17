"""One ragged decode step against row-by-row and padded tail caches.

The same benchmark as ``kvtier bench ragged``; see :mod:`kvtier_bench.ragged`.
Run: ``python benchmarks/ragged.py [--shape smollm2] [--device cuda] [--plot benchmarks/ragged.png]``.
"""

import argparse
import sys

from kvtier_bench import ragged


def main() -> int:
    parser = argparse.ArgumentParser(description=ragged.__doc__.splitlines()[0])
    ragged.add_arguments(parser)
    return ragged.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
