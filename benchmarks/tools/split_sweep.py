"""bf16 paged decode against SDPA over launch plans: split counts, keys per tile and stages at
each batch size and context of the issue-15 table, to choose the plan heuristics from.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/split_sweep.py --out DIR [--defaults-only]

Writes ``DIR/NAME.md`` (one table per shape, the default plan first) and ``DIR/NAME.json``
(``--name``, default ``split_sweep``). Times are medians of CUDA-graph replays of 20 calls over replicas
that keep the working set beyond 4x the L2 (``kvtier_bench.attention.time_calls``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

SPLITS = {1: (16, 32, 48, 64, 96, 128), 8: (4, 6, 8, 12, 16), 32: (2, 3, 4, 5, 6, 8, 12), 64: (2, 3, 4, 6)}


def main() -> None:
    from kvtier.kernels.triton_attention import LaunchConfig, plan_launch
    from kvtier_bench.attention import bf16_against_sdpa, time_calls

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--name", default="split_sweep", help="file stem of the results")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="4096,16384,32768")
    p.add_argument("--defaults-only", action="store_true", help="time only the default plan of each shape")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = SimpleNamespace(kv_heads=8, heads=32, head_dim=128, page=16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    md = [f"{time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    js = []
    for B in map(int, args.batches.split(",")):
        for L in map(int, args.contexts.split(",")):
            ps, sdpa, _ = bf16_against_sdpa(B, L, shape, gen)
            q = ps[0].q
            t_s = time_calls(sdpa, 20, 10)
            default = plan_launch(B, 8, 4, 1, L, q.device, LaunchConfig())
            rows = [("default", default[3], default[2], "-", time_calls([lambda p=p: p.attention() for p in ps], 20, 10))]
            for splits in () if args.defaults_only else SPLITS.get(B, ()):
                for bn, stages in ((64, 2), (64, 3), (128, 2)):
                    cfg = LaunchConfig(num_splits=splits, block_n=bn, num_stages=stages)
                    try:
                        t = time_calls([lambda p=p, cfg=cfg: p.attention(cfg) for p in ps], 20, 10)
                    except Exception as e:  # out of shared memory
                        print(B, L, cfg, type(e).__name__, str(e)[:80], flush=True)
                        continue
                    rows.append((f"splits {splits}", splits, bn, stages, t))
            md += [f"## B={B}, context {L} (SDPA {t_s * 1e6:.1f} us)", "",
                   "| plan | splits | block_n | stages | us | of SDPA |", "|---|---|---|---|---|---|"]
            md += [f"| {name} | {s} | {bn} | {st} | {t * 1e6:.1f} | {t_s / t:.0%} |" for name, s, bn, st, t in rows]
            best = min(rows, key=lambda r: r[4])
            md += ["", f"best: {best[0]} block_n {best[2]} stages {best[3]}: {t_s / best[4]:.0%} of SDPA", ""]
            js.append(dict(B=B, L=L, t_sdpa=t_s, plans=[dict(name=r[0], splits=r[1], block_n=r[2], stages=r[3], t=r[4])
                                                      for r in rows]))
            print("\n".join(md[-len(rows) - 6:]), flush=True)
            (out / f"{args.name}.md").write_text("\n".join(md))
            (out / f"{args.name}.json").write_text(json.dumps(js, indent=1))
            del ps, sdpa
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
