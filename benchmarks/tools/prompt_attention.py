"""The packed prompt launch at a serving prompt step's shape: prompt chunks of random lengths
side by side in one ``[1, H_q, N, D]`` forward, each over its own pages from position 0 (a
whole prompt, as in issue 14's workload), for each storage mode and a few tilings.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/prompt_attention.py [--out DIR]

Times: medians of CUDA-graph replays of 20 calls (``kvtier_bench.attention.time_calls``) over
replicas that keep the pages beyond 4x the L2. ``--device cpu`` is a smoke run under the
interpreter (``--tokens 256``), whose times mean nothing.
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

import torch


def chunk_lengths(tokens: int, lo: int, hi: int, seed: int) -> list[int]:
    """Random prompt lengths in ``[lo, hi]`` while they fit in ``tokens`` (the step's budget)."""
    rng, out = random.Random(seed), []
    while True:
        n = rng.randint(lo, hi)
        if sum(out) + n > tokens:
            return out or [min(n, tokens)]
        out.append(n)


def main() -> None:
    from kvtier.kernels.triton_paged import LaunchConfig, paged_attention_triton
    from kvtier_bench.attention import build_paged, copies_for, time_calls, write_report

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", type=int, default=16384, help="the step's token budget")
    p.add_argument("--lengths", default="64,1024", help="uniform range of the prompts' lengths")
    p.add_argument("--modes", default="fp,q8,fp8,q4")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    args = p.parse_args()
    dev = args.device
    shape = SimpleNamespace(kv_heads=8, heads=32, head_dim=128, page=16, device=dev)
    if dev == "cpu":
        shape = SimpleNamespace(kv_heads=1, heads=2, head_dim=64, page=16, device=dev)
    lo, hi = (int(x) for x in args.lengths.split(","))
    counts = chunk_lengths(args.tokens, lo, hi, 0)
    B, N, L = len(counts), sum(counts), max(counts)
    to = dict(dtype=torch.int64, device=dev)
    kv_len = torch.tensor(counts, **to)
    q_start = torch.zeros(B, **to)
    q_offsets = torch.tensor([sum(counts[:b]) for b in range(B)], **to)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, shape.heads, N, shape.head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
    configs = {"default": LaunchConfig(), "block_m 64": LaunchConfig(block_m=64),
               "block_m 128": LaunchConfig(block_m=128), "block_m 128, block_n 32": LaunchConfig(block_m=128, block_n=32),
               "block_m 64, block_n 32": LaunchConfig(block_m=64, block_n=32),
               "block_m 128, stages 3": LaunchConfig(block_m=128, num_stages=3)}
    lines = [f"{time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name() if dev == 'cuda' else dev}, "
             f"torch {torch.__version__}; {B} prompt chunks of {lo}-{hi} tokens, {N} in all, "
             f"{shape.heads}/{shape.kv_heads} heads, head_dim {shape.head_dim}", "",
             "| mode | plan | us |", "|---|---|---|"]
    results = []
    for mode in args.modes.split(","):
        base = build_paged(mode, B, L, shape, gen)
        n = copies_for(N * base.nbytes // (B * L))
        reps = [base] + [build_paged(mode, B, L, shape, gen) for _ in range(n - 1)]

        def call(r, cfg):
            return paged_attention_triton(q, r.kp, r.vp, r.table, q_start, kv_len, q_offsets=q_offsets,
                                          max_q_len=L, k_codec=r.kc, v_codec=r.vc, k_sidecars=r.ks,
                                          v_sidecars=r.vs, config=cfg)

        for name, cfg in configs.items():
            try:
                t = time_calls([lambda r=r, cfg=cfg: call(r, cfg) for r in reps], 20, 10)
            except Exception as e:  # a tiling that does not fit (shared memory, registers)
                print(mode, name, type(e).__name__, str(e)[:100], flush=True)
                continue
            results.append(dict(mode=mode, plan=name, us=t * 1e6))
            lines.append(f"| {mode} | {name} | {t * 1e6:.1f} |")
            print(lines[-1], flush=True)
        del reps, base
        if dev == "cuda":
            torch.cuda.empty_cache()
    write_report(args.out, "prompt_attention", lines, results)


if __name__ == "__main__":
    main()
