"""One-row products of the packed Q4_1 and Q8_0 kernels, from the L2 cache to memory, against the machine's bandwidth.

A decode step on the CPU multiplies one row by every packed weight
(:mod:`kvtier.model.packed_kernels`). Whether those products are bound by memory or by their
own instructions decides what a faster memory would buy: this benchmark times them
(``PackedKernels.gemv``, one row, random codes of the default model's width ``--k``) at
weights of increasing size, from ones that fit the L2 cache to ones that only memory holds,
and prints each size's GB/s and cycles a block and core (at ``--ghz``, the core clock
assumed). Where the rate stays the same from the caches to memory, the loop's instructions
bound it.

Each round also measures the machine's bandwidth as ``decode``'s roofline does: a copy
(read + write bytes) and a sum (read bytes) of a 1 GiB tensor, the best of six passes. Rounds
(``--repeats``) interleave the two, so a machine whose bandwidth changes shows it; each row
reports its best round.

Example::

    kvtier bench cpu_products
    kvtier bench cpu_products --k 1536 --sizes 1024 8192 98304
"""

from __future__ import annotations

import argparse

import torch

from kvtier.devices import set_threads
from kvtier_bench._progress import BenchProgress
from kvtier_bench.decode import best_seconds, measure_bandwidth, measure_read_bandwidth

BYTES_A_BLOCK = {"q4_1": 20, "q8_0": 34}  # codes, scale (and minimum) of 32 weights


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--k", type=int, default=576, help="the row's length, a multiple of 32")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 98304],
                        help="output counts N of the weights timed (default: L2, L3 and memory sized at K 576)")
    parser.add_argument("--formats", nargs="+", choices=sorted(BYTES_A_BLOCK), default=sorted(BYTES_A_BLOCK))
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each row reports its best")
    parser.add_argument("--ghz", type=float, default=None,
                        help="core clock for the cycles column (default: left out)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def weight(fmt: str, n: int, k: int, seed: int = 0):
    """Random packed codes, scales and minima of an ``[n, k]`` weight (``fmt``'s layout)."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // 32
    d = (torch.rand(n, blocks, generator=g) * 0.01).half()
    if fmt == "q4_1":
        codes = torch.randint(0, 256, (n, blocks * 16), dtype=torch.uint8, generator=g)
        return codes, d, (-torch.rand(n, blocks, generator=g) * 0.05).half()
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), d, None


def time_product(kernels, fmt: str, n: int, k: int, calls: int) -> float:
    """Seconds a call, the best of five batches of ``calls``."""
    codes, d, m = weight(fmt, n, k)
    x, y = torch.randn(1, k), torch.empty(1, n)
    def batch(count: int) -> None:
        for _ in range(count):
            kernels.gemv(fmt, x, codes, d, m, y)

    batch(3)
    return best_seconds(lambda: batch(calls), lambda: None, passes=5) / calls


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvtier.model.packed_kernels import load_kernels

    if args.threads is not None:
        set_threads(args.threads)
    if args.ghz is not None and not 0 < args.ghz < 100:
        raise ValueError(f"--ghz {args.ghz}: the cores' clock in GHz, a number in (0, 100)")
    if args.k <= 0 or args.k % 32:
        raise ValueError(f"--k {args.k} is not a positive multiple of 32 (the blocks' length)")
    if any(n <= 0 for n in args.sizes):
        raise ValueError(f"--sizes {args.sizes}: each output count must be positive")
    kernels = load_kernels()
    if kernels is None:
        raise RuntimeError("no C compiler builds the packed kernels here (set $CC to one)")
    cpu, sync = torch.device("cpu"), (lambda: None)
    rows = [(fmt, n) for fmt in args.formats for n in args.sizes]
    best = {row: float("inf") for row in rows}
    copy_bw, read_bw = [], []
    with BenchProgress("cpu_products", args.repeats * (len(rows) + 1)) as bar:
        for i in range(args.repeats):
            bar.advance(f"round {i + 1}/{args.repeats}, bandwidth")
            copy_bw.append(measure_bandwidth(cpu, sync))
            read_bw.append(measure_read_bandwidth(cpu, sync))
            for fmt, n in rows:
                bar.advance(f"round {i + 1}/{args.repeats}, {fmt} N={n}")
                nbytes = n * args.k // 32 * BYTES_A_BLOCK[fmt]
                calls = max(3, int(2e8 // nbytes))  # about 200 MB a batch
                best[fmt, n] = min(best[fmt, n], time_product(kernels, fmt, n, args.k, calls))
    table = Table(title=f"one-row packed products, K {args.k}, {torch.get_num_threads()} CPU threads, "
                        f"digits {', '.join(kernels.digits) or 'off'}, {kernels.lanes} lanes")
    columns = ["format", "N", "weight MB", "us a call", "GB/s", "of the sum's bandwidth"]
    for col in columns + (["cycles a block and core"] if args.ghz else []):
        table.add_column(col, justify="right")
    top_read = max(read_bw)
    for fmt, n in rows:
        nbytes = n * args.k // 32 * BYTES_A_BLOCK[fmt]
        s = best[fmt, n]
        cells = [fmt, str(n), f"{nbytes / 1e6:.2f}", f"{s * 1e6:.1f}", f"{nbytes / s / 1e9:.1f}",
                 f"{100 * nbytes / s / top_read:.0f}%"]
        if args.ghz:
            cells.append(f"{s * args.ghz * 1e9 * torch.get_num_threads() / (n * args.k // 32):.2f}")
        table.add_row(*cells)
    console = Console(width=120)
    console.print(table)
    console.print("bandwidth each round, copy / sum GB/s: "
                  + ", ".join(f"{c / 1e9:.1f} / {r / 1e9:.1f}" for c, r in zip(copy_bw, read_bw)))
    return 0
