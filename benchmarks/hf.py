"""KVTierCache against DynamicCache (and StaticCache on CUDA) inside transformers' generate.

The same benchmark as ``kvtier bench hf``; see :mod:`kvtier_bench.hf`.
Run: ``python benchmarks/hf.py [--quick] [--model llama3-8b --batch 1,16]``.
"""

import sys

from kvtier.cli import main

if __name__ == "__main__":  # the checks and errors of `kvtier bench hf`
    sys.exit(main(["bench", "hf", *sys.argv[1:]]))
