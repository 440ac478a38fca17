"""End-to-end decode throughput against HF generate, and against the memory-bandwidth roofline.

The same benchmark as ``kvtier bench decode``; see :mod:`kvtier_bench.decode`.
Run: ``python benchmarks/decode.py [--threads 1] [--plot benchmarks/decode.png]``.
"""

import argparse
import sys

from kvtier_bench import decode


def main() -> int:
    parser = argparse.ArgumentParser(description=decode.__doc__.splitlines()[0])
    decode.add_arguments(parser)
    return decode.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
