"""Speculative decoding against plain decoding on the default model.

The same benchmark as ``kvtier bench speculative``; see :mod:`kvtier_bench.speculative`.
Run: ``python benchmarks/speculative.py [--max-tokens 256] [--drafters ngram,early-exit:24] [--json FILE]``.
"""

import argparse
import sys

from kvtier_bench import speculative


def main() -> int:
    parser = argparse.ArgumentParser(description=speculative.__doc__.splitlines()[0])
    speculative.add_arguments(parser)
    return speculative.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
