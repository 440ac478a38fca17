"""Batch-1 projections: the Triton matrix-vector kernel (``kvtier.kernels.triton_gemv``) over tile
configurations against ``torch.nn.functional.linear`` (cuBLAS), on the Llama-3-8B shapes.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/gemv_sweep.py --out DIR

Writes ``DIR/gemv_sweep.md`` and ``.json``. Times are medians of CUDA-graph replays of 20 calls
cycling over weight replicas that keep the working set beyond 4x the L2
(``kvtier_bench.attention.time_calls``); GB/s counts the weight bytes once per call.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import astuple
from pathlib import Path

import torch
import torch.nn.functional as F

#: (name, N, K) of the Llama-3-8B decoder's projections and its head
SHAPES = [("wqkv", 6144, 4096), ("wo", 4096, 4096), ("w13", 28672, 4096), ("w2", 4096, 14336),
          ("lm_head", 128256, 4096)]


def main() -> None:
    from kvtier.kernels.triton_gemv import GemvConfig, gemv
    from kvtier_bench.attention import copies_for, time_calls

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [GemvConfig(bn, bk, w, s) for bn, bk, w, s in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (1, 3))
               if bn * bk <= 8192]
    md = [f"{time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    js = []
    for name, N, K in SHAPES:
        nbytes = N * K * 2
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies_for(nbytes))]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        t_cublas = time_calls([lambda w=w, x=x: F.linear(x, w) for w in ws], 20, 10)
        rows = []
        for cfg in configs:
            try:
                err = (gemv(x, ws[0], cfg).float() - ref).abs().max().item()
                t = time_calls([lambda w=w, x=x, cfg=cfg: gemv(x, w, cfg) for w in ws], 20, 10)
            except Exception as e:  # resources
                print(name, cfg, type(e).__name__, str(e)[:80], flush=True)
                continue
            rows.append((astuple(cfg), t, err))
        rows.sort(key=lambda r: r[1])
        md += [f"## {name}: N={N}, K={K} ({nbytes / 2**20:.0f} MiB); cuBLAS {t_cublas * 1e6:.1f} us, "
               f"{nbytes / t_cublas / 1e9:.0f} GB/s", "",
               "| block_n, block_k, warps, stages | us | GB/s | vs cuBLAS | max err |", "|---|---|---|---|---|"]
        md += [f"| {c} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | {t_cublas / t:.2f}x | {e:.3g} |" for c, t, e in rows[:8]]
        if name == "w2":  # the MLP's tail: silu_mul then the product, or the SiLU in the prologue
            from kvtier.kernels.triton_fused import silu_mul

            h = torch.randn(1, 2 * K, device="cuda", dtype=torch.bfloat16)
            tails = {"silu_mul + cuBLAS": lambda w, h=h: F.linear(silu_mul(h), w),
                     "silu_mul + gemv": lambda w, h=h: gemv(silu_mul(h), w),
                     "gemv, SiLU prologue": lambda w, h=h: gemv(h, w, silu_mul=True)}
            md += ["", "| MLP tail | us |", "|---|---|"]
            md += [f"| {k} | {time_calls([lambda w=w, f=f: f(w) for w in ws], 20, 10) * 1e6:.1f} |"
                   for k, f in tails.items()]
        md.append("")
        js.append(dict(name=name, N=N, K=K, t_cublas=t_cublas, rows=[dict(cfg=c, t=t, err=e) for c, t, e in rows]))
        print("\n".join(md[-12:]), flush=True)
        (out / "gemv_sweep.md").write_text("\n".join(md))
        (out / "gemv_sweep.json").write_text(json.dumps(js, indent=1))
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
