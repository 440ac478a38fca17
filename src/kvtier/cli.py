"""The ``kvtier`` command line. It only parses arguments and calls the library.

Subcommands: ``generate``, ``info``, ``eval``, ``bench NAME``. Each benchmark
lives in ``kvtier.bench.NAME`` and offers ``add_arguments(parser)`` and
``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = {
    "append": "per-token append cost of the tail and block tiers against HF DynamicLayer",
    "ragged": "one ragged decode step against row-by-row and padded tail caches",
    "paged": "bytes per token, fragmentation and codec error of the paged tier",
    "speculative": "speculative decoding against plain decoding on the default model",
    "attention": "paged decode attention bandwidth against PyTorch SDPA",
    "decode": "end-to-end decode throughput against HF generate",
    "hf": "KVTierCache against DynamicCache inside transformers generate",
}


def _bench_module(name: str):
    try:
        return importlib.import_module(f"kvtier.bench.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"kvtier.bench.{name}":
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, help_text in BENCHMARKS.items():
        module = _bench_module(name)
        if module is None:
            continue
        p = bsub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
