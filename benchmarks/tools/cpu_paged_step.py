"""The server's CPU decode step over each kind of page, one C call (``DecodeStep.run_paged``)
against the layered forward: ``ModelRunner.execute`` of decode steps of ``--rows`` rows at
``--context`` tokens each, the default model (packed weights), medians of ``--steps`` steps,
the two paths alternated in one process (``KVTIER_DECODE_STEP=1`` / ``0``).

    PYTHONPATH=src python3 benchmarks/tools/cpu_paged_step.py --rows 1,8 --context 200,2000 \\
        --pages fp,q8,q4,fp8,q4_g32,turboquant:q8_0,q3_0 [--threads 2] [--out steps.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,8", help="rows a step, comma-separated")
    p.add_argument("--context", default="200", help="tokens each row holds, comma-separated")
    p.add_argument("--pages", default="fp,q8,q4,fp8,q4_g32,turboquant:q8_0,q3_0",
                   help="page storages (mode names; turboquant:K,V), comma-separated")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvtier.model.loading import load_model
    from kvtier.quant.modes import parse_mode

    model = load_model().model
    rows = [int(x) for x in args.rows.split(",")]
    contexts = [int(x) for x in args.context.split(",")]
    names, pending = [], args.pages.split(",")
    while pending:  # (turboquant:K,V holds a comma)
        name = pending.pop(0)
        if name.startswith("turboquant:") and "," not in name and pending:
            name += "," + pending.pop(0)
        names.append(name)
    results = []
    for name in names:
        kv_quant, turboquant = parse_mode(name)
        for context in contexts:
            for n in rows:
                step, layered = time_steps(model, n, context, args.steps, kv_quant, turboquant)
                results.append({"pages": name, "rows": n, "context": context, "step_ms": step,
                                "layered_ms": layered})
                print(f"{name:>22}  {n:>3} rows  {context:>5} tokens:  one call {step:7.1f} ms   "
                      f"layered {layered:7.1f} ms   {layered / step:5.2f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def time_steps(model, n: int, context: int, steps: int, kv_quant, turboquant) -> tuple[float, float]:
    """Median ms of a decode step of ``n`` rows at ``context`` tokens: (one call, layered)."""
    from kvtier.serve.runner import ModelRunner
    from kvtier.serve.scheduler import ScheduledRow, StepBatch

    per_row = -(-(context + 2 * steps + 2) // 16)
    runner = ModelRunner(model, num_blocks=n * per_row + 1, block_size=16, kv_quant=kv_quant,
                         turboquant=turboquant)
    g = torch.Generator().manual_seed(0)
    held = []
    for r in range(n):
        blocks = tuple(range(1 + r * per_row, 1 + (r + 1) * per_row))
        ids = tuple(torch.randint(0, 1000, (context,), generator=g).tolist())
        runner.execute(StepBatch(rows=(ScheduledRow(f"r{r}", ids, 0, blocks, True),)))
        held.append((f"r{r}", blocks))
    times = {"1": [], "0": []}
    position = context
    for _ in range(steps):
        for flag in ("1", "0"):
            os.environ["KVTIER_DECODE_STEP"] = flag
            batch = StepBatch(rows=tuple(ScheduledRow(rid, (5,), position, blocks, True) for rid, blocks in held))
            t = time.perf_counter()
            runner.execute(batch)
            times[flag].append(time.perf_counter() - t)
            position += 1
    os.environ.pop("KVTIER_DECODE_STEP", None)
    return statistics.median(times["1"]) * 1e3, statistics.median(times["0"]) * 1e3


if __name__ == "__main__":
    main()
