"""Quantised decode with int8 queries against the fp16-operand kernel, on shared shapes.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/int8_query_ab.py [--out DIR] [--quick]

For each shape (B / context, and a serving step: 256 rows of 64-1,280 keys, longest first), times
the MMA kernel over q8 pages with ``LaunchConfig(int8_queries=False)`` (keys converted to fp16
operands) and ``True`` (``--plans``: under other tiles too), beside bf16, fp8 and q4 pages of the
same shape. Times: medians of CUDA-graph replays over
replicas beyond 4x the L2 (``kvtier_bench.attention.time_calls``). The last column is the
largest difference from the fp16-operand kernel's output on the same pages. ``--profile`` runs
three calls and nothing else, for ``ncu``.
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
    p.add_argument("--modes", default="q8,fp8,q4")
    p.add_argument("--quick", action="store_true", help="B=64 / 8k only")
    p.add_argument("--plans", action="store_true", help="also other tiles, stages and warps with int8 queries")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    p.add_argument("--profile", default=None, metavar="MODE[:int8]",
                   help="three calls at B=64 / 8k and nothing else (for ncu)")
    args = p.parse_args()
    dev = args.device
    shape = SimpleNamespace(kv_heads=8, heads=32, head_dim=128, page=16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    if args.profile:
        mode, _, int8 = args.profile.partition(":")
        pages = build_paged(mode, 64, 8192, shape, gen)
        for _ in range(3):
            pages.attention(LaunchConfig(decode_kernel="mma", int8_queries=int8 == "int8"))
        torch.cuda.synchronize()
        return
    shapes = [(64, 8192)] if args.quick else [(64, 8192), (8, 16384), (8, 4096), ("serve", 1280)]
    if dev != "cuda":
        shapes = [(2, 64)]
    mma = dict(decode_kernel="mma")  # q8 decode steps go to the Gluon kernel unless told
    plans = {"fp16 operands": LaunchConfig(int8_queries=False, **mma), "int8 queries": LaunchConfig(int8_queries=True, **mma)}
    if args.plans and dev == "cuda":  # tile plans (none beat the default on the H200, 2026-12-03)
        plans |= {
            "int8, 3 stages": LaunchConfig(int8_queries=True, num_stages=3, **mma),
            "int8, 64 keys": LaunchConfig(int8_queries=True, block_n=64, **mma),
            "int8, 256 keys": LaunchConfig(int8_queries=True, block_n=256, **mma),
            "int8, 8 warps": LaunchConfig(int8_queries=True, num_warps=8, **mma),
        }
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    lines = [f"{time.strftime('%Y-%m-%d %H:%M')} {name}, torch {torch.__version__}, 32/8 heads, head_dim 128, pages of 16",
             "", "| shape | mode | plan | us | vs bf16 | max diff vs fp16 operands |", "|---|---|---|---|---|---|"]
    results = []
    for B, L in shapes:
        serve = B == "serve"
        rows = 256 if serve else B
        if serve:
            lens = torch.randint(64, L + 1, (rows,), generator=torch.Generator().manual_seed(0)).sort(descending=True).values
        else:
            lens = torch.full((rows,), L)
        label = "serving step" if serve else f"B={B} / {L}"
        bf16_t = None
        for mode in ["fp"] + args.modes.split(","):
            base = build_paged(mode, rows, L, shape, gen)
            per_token = base.nbytes // (rows * L)
            n = copies_for(int(lens.sum()) * per_token) if dev == "cuda" else 1
            reps = [base] + [build_paged(mode, rows, L, shape, gen) for _ in range(n - 1)]
            for r in reps:
                r.set_lengths(lens.to(dev))
            ref = base.attention(LaunchConfig(int8_queries=False, **mma)).float()
            for plan, cfg in plans.items():
                if mode in ("fp", "fp8", "q4") and plan != "fp16 operands":
                    continue  # int8 queries serve q8 keys only
                try:
                    t = time_calls([lambda r=r, cfg=cfg: r.attention(cfg) for r in reps], 20, 10)
                except Exception as e:  # a plan that does not fit (shared memory)
                    print(label, mode, plan, type(e).__name__, str(e)[:120], flush=True)
                    continue
                diff = (base.attention(cfg).float() - ref).abs().max().item()
                if mode == "fp" and plan == "fp16 operands":
                    bf16_t = t
                ratio = bf16_t / t if bf16_t else float("nan")
                results.append(dict(shape=label, mode=mode, plan=plan, us=t * 1e6, vs_bf16=ratio, max_diff=diff))
                lines.append(f"| {label} | {mode} | {plan} | {t * 1e6:.1f} | {ratio:.2f}x | {diff:.1e} |")
                print(lines[-1], flush=True)
            del reps, base
            if dev == "cuda":
                torch.cuda.empty_cache()
    write_report(args.out, "int8_query_ab", lines, results)


if __name__ == "__main__":
    main()
