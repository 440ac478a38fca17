"""Where a batch-1 decode step's GPU time goes: torch.profiler over eager decode steps of the
paged tier on the Llama-3-8B shape (random bf16 weights), kernels grouped by name, with their
share of the step and the weight bytes per second of the matrix products.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/decode_profile.py --out DIR

Writes ``DIR/decode_profile.md``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict
from pathlib import Path

import torch


def main() -> None:
    from kvtier.config import KVCacheConfig
    from kvtier.generate import generate_step
    from kvtier.model import build_random

    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="llama3-8b")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_random(args.arch, dtype=torch.bfloat16, device="cuda")
    L, n = args.prompt_tokens, 16 + args.steps
    prompt = torch.randint(0, model.args.vocab_size, (L,), generator=torch.Generator().manual_seed(0)).tolist()
    caches = model.make_caches(KVCacheConfig(tier="paged", paged_num_blocks=math.ceil((L + n + 2) / 16) + 1))
    steps = generate_step(model, [prompt], caches, cuda_graph=False, max_steps=n)
    for _ in range(16):  # prefill and warm-up steps
        next(steps).tolist()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            next(steps).tolist()
        wall = (time.perf_counter() - t0) / args.steps
    steps.close()
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    total = sum(sum(v) for v in kernels.values()) / args.steps
    rows = sorted(((sum(v) / args.steps, len(v) / args.steps, k) for k, v in kernels.items()), reverse=True)
    md = [f"{time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"{args.arch}, prompt {L}, eager paged decode, {args.steps} steps profiled", "",
          f"GPU kernel time per step {total / 1e3:.3f} ms; wall per step (eager, profiled) {wall * 1e3:.3f} ms; "
          f"kernels per step {sum(len(v) for v in kernels.values()) / args.steps:.0f}", "",
          "| kernel | us per step | launches per step | us per launch | share |", "|---|---|---|---|---|"]
    md += [f"| `{k[:90]}` | {t:.1f} | {c:.0f} | {t / c:.2f} | {t / total:.1%} |" for t, c, k in rows[:30]]
    (out / "decode_profile.md").write_text("\n".join(md) + "\n")
    print("\n".join(md), flush=True)


if __name__ == "__main__":
    main()
