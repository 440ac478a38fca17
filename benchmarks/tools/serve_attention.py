"""The paged decode kernel at a serving step's shape: 256 rows of ragged contexts (the issue-14
workload's, 64-1,280 tokens), a block table as wide as the CUDA graphs' (``--width`` blocks),
for each storage mode and a few launch plans, against the same bytes in rows of one length.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/serve_attention.py [--out DIR]

Rows in the order of the step (random), longest first, shortest first; ``uniform``: every row at
the mean length (the same bytes, no raggedness). Times: medians of CUDA-graph replays of 20
calls over replicas that keep the working set beyond 4x the L2.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch


def main() -> None:
    from kvtier.kernels.triton_attention import LaunchConfig
    from kvtier_bench.attention import build_paged, copies_for, time_calls, write_report

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--lengths", default="64,1280", help="uniform range of the rows' contexts")
    p.add_argument("--width", type=int, default=512, help="blocks per row of the table")
    p.add_argument("--modes", default="fp,fp8,q8")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    args = p.parse_args()
    dev = args.device
    shape = SimpleNamespace(kv_heads=8, heads=32, head_dim=128, page=16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    B = args.rows
    lo, hi = (int(x) for x in args.lengths.split(","))
    lengths = torch.randint(lo, hi + 1, (B,), generator=torch.Generator().manual_seed(0))
    mean = int(lengths.float().mean().round())
    orders = {"step order": lengths, "longest first": lengths.sort(descending=True).values,
              "shortest first": lengths.sort().values, "uniform": torch.full((B,), mean)}
    configs = {"default": None, "block_n 32": LaunchConfig(block_n=32), "block_n 128": LaunchConfig(block_n=128),
               "stages 3": LaunchConfig(num_stages=3), "warps 8": LaunchConfig(num_warps=8),
               "2 splits": LaunchConfig(num_splits=2)}
    lines = [f"{time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name() if dev == 'cuda' else dev}, torch {torch.__version__}; "
             f"{B} rows, contexts {lo}-{hi} (mean {mean}), table width {args.width}", "",
             "| mode | rows | plan | us | TB/s |", "|---|---|---|---|---|"]
    results = []
    for mode in args.modes.split(","):
        base = build_paged(mode, B, hi, shape, gen)
        per_token = base.nbytes // (B * hi)
        n = copies_for(int(lengths.sum()) * per_token)
        reps = [base] + [build_paged(mode, B, hi, shape, gen) for _ in range(n - 1)]
        for r in reps:  # the graphs' table: as wide as the context allows, unused entries 0
            pad = torch.zeros(B, args.width - r.table.shape[1], dtype=torch.int32, device=dev)
            r.table = torch.cat([r.table, pad], 1)
        for order, lens in orders.items():
            kv = lens.to(dev)
            nbytes = int(lens.sum()) * per_token
            for r in reps:
                r.set_lengths(kv)
            for name, cfg in configs.items():
                if order != "step order" and name != "default":
                    continue
                try:
                    t = time_calls([lambda r=r, cfg=cfg: r.attention(cfg) for r in reps], 20, 10)
                except Exception as e:  # a plan that does not fit (shared memory)
                    print(mode, order, name, type(e).__name__, str(e)[:100], flush=True)
                    continue
                results.append(dict(mode=mode, order=order, plan=name, us=t * 1e6, tbs=nbytes / t / 1e12))
                lines.append(f"| {mode} | {order} | {name} | {t * 1e6:.1f} | {nbytes / t / 1e12:.2f} |")
                print(lines[-1], flush=True)
        del reps, base
        torch.cuda.empty_cache()
    write_report(args.out, "serve_attention", lines, results)


if __name__ == "__main__":
    main()
