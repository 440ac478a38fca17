"""Where a small decode step's time goes: the paged attention call of each page kind at its
default plan, timed three ways on the same replicas.

- ``full``: CUDA-graph replays at the shape's lengths (``kvtier_bench.attention.time_calls``);
- ``floor``: the same graphs' launches with every row one key long: the same grid, splits and
  merge, the loads of one key a row (the launches' fixed cost);
- ``L2``: the same call whose block table sends every row's pages to the first 64 pages of row
  0, which the L2 holds: the same work at the L2's latency and bandwidth. Close to ``full``,
  the kernel is bound by its own loop, not by DRAM;
- the kernels of ``full`` one by one (``torch.profiler`` over graph replays): the attention
  kernel and the split merge, microseconds a call, and the attention kernel's bytes a second.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/decode_overhead.py [--out DIR]
        [--modes fp,q8,q4,fp8] [--shapes 8x4096,1x4096,8x16384,64x8192]

Writes ``DIR/decode_overhead.md`` and ``.json``. GPU only.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from types import SimpleNamespace

import torch


def kernel_times(fns, iters: int = 20) -> dict[str, float]:
    """Microseconds a call of each kernel name of ``fns`` (cycled), from profiled graph replays."""
    from torch.profiler import ProfilerActivity, profile

    from kvtier_bench.attention import graph_of

    graph, stream = graph_of(fns, iters)
    with torch.cuda.stream(stream), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            total[e.name] += e.device_time_total
    return {name: t / (5 * iters) for name, t in total.items()}


def main() -> None:
    from kvtier_bench.attention import build_paged, copies_for, page_modes, time_calls, write_report

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--modes", default="fp,q8,q4,fp8",
                   help="page kinds, comma-separated (tq: TurboQuant's 8-bit keys and 3-bit values)")
    p.add_argument("--shapes", default="8x4096,1x4096,8x16384,64x8192", help="BxL, comma-separated")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this tool times CUDA kernels; no CUDA device is visible")
    shape = SimpleNamespace(kv_heads=8, heads=32, head_dim=128, page=16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             "32/8 heads, head_dim 128, pages of 16; us a call",
             "", "| shape | pages | full | L2 (64 pages) | floor (1 key a row) | attention kernel | merge | other | "
             "kernel GB/s |", "|---|---|---|---|---|---|---|---|---|"]
    results = []
    for item in args.shapes.split(","):
        B, L = (int(x) for x in item.split("x"))
        for mode in page_modes(args.modes):
            base = build_paged(mode, B, L, shape, gen)
            n = copies_for(base.nbytes)
            reps = [base] + [build_paged(mode, B, L, shape, gen) for _ in range(n - 1)]
            fns = [r.attention for r in reps]
            full = time_calls(fns, 20, 10)
            kernels = kernel_times(fns)
            table = base.table
            pages = torch.arange(table.shape[1], device="cuda") % min(64, table.shape[1])
            base.table = table[0, pages].expand_as(table).contiguous()
            hot = time_calls([base.attention], 20, 10)
            base.table = table
            for r in reps:
                r.set_lengths(torch.ones_like(r.kv_len))
            floor = time_calls(fns, 20, 10)
            merge = sum(t for k, t in kernels.items() if "merge" in k)
            attn = max((t for k, t in kernels.items() if "merge" not in k), default=0.0)  # the longest
            other = sum(kernels.values()) - attn - merge
            gbs = base.nbytes / (attn * 1e-6) / 1e9 if attn else 0.0
            results.append(dict(shape=item, pages=mode, full_us=full * 1e6, l2_us=hot * 1e6, floor_us=floor * 1e6,
                                kernels=kernels))
            lines.append(f"| B={B} / {L} | {mode} | {full * 1e6:.1f} | {hot * 1e6:.1f} | {floor * 1e6:.1f} | {attn:.1f} | "
                         f"{merge:.1f} | {other:.1f} | {gbs:.0f} |")
            print(lines[-1], {k[:60]: round(v, 2) for k, v in kernels.items()}, flush=True)
            del reps, base, fns
            torch.cuda.empty_cache()
    write_report(args.out, "decode_overhead", lines, results)


if __name__ == "__main__":
    main()
