"""KVTierCache against DynamicCache (and StaticCache on CUDA) inside transformers' generate.

The same benchmark as ``kvtier bench hf``; see :mod:`kvtier_bench.hf`.
Run: ``python benchmarks/hf.py [--quick] [--model llama3-8b --batch 1,16]``.
"""

import argparse
import sys

from kvtier_bench import hf


def main() -> int:
    parser = argparse.ArgumentParser(description=hf.__doc__.splitlines()[0])
    hf.add_arguments(parser)
    return hf.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
