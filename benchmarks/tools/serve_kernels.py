"""Where the GPU time of a whole `kvtier bench serve` workload goes, by phase and kind of kernel.

The workload of `kvtier bench serve` (the same flags, the same engine configuration and
warm-up) runs once under torch.profiler with CUDA activity only. A marker kernel is launched
after the step in which the last prompt finished its prefill, which splits the kernels into
a prompt phase and a decode phase. For each phase the tool prints the GPU time of each kind
of kernel (matmuls, paged attention, the split merge, KV writes, norms, RoPE, SiLU-mul,
sampling, the rest) and the heaviest kernels by name, and writes them as JSON. It also times
the host in ``ModelRunner.execute`` each step: a step far over the median waited there for the
GPU (the host launches only), as the LM head's first row count of a kind did before
the engine padded it.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/serve_kernels.py --device cuda \
        --num-requests 256 --input-len 64,1024 --output-len 256 --kv-quant q8 --json q8.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import re
import time
from collections import defaultdict

import torch

KINDS = (  # first match wins; matched against the lower-cased kernel name
    ("marker", r"spin_kernel"),
    ("merge", r"merge"),
    ("attention", r"paged|gluon|attn|attention|flash|fmha|decode_kernel"),
    ("kv write", r"quant|write|store|scatter|index_put|copy_kv|append"),
    ("matmul", r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitk|matvec"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary"),
    ("silu-mul", r"silu|swiglu|act_and_mul"),
    ("sampling", r"argmax|topk|softmax|sampl|max_|reduce"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def main() -> None:
    from kvtier_bench import serve

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    serve.add_arguments(p)
    p.add_argument("--top", type=int, default=12, help="heaviest kernels listed a phase")
    p.add_argument("--cpu-trace", action="store_true",
                   help="also trace the host (CUDA runtime calls, aten ops) and print its heaviest calls "
                        "by their own time: where a step waits for the GPU (best on a short workload)")
    p.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                   help="leave the start-up heap to the garbage collector (bench serve freezes it)")
    args = p.parse_args()
    device = torch.device(args.device or "cuda")
    lo, hi = (int(x) for x in args.input_len.split(","))
    model, label, _ = serve.load(args, device)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(model.args.vocab_size) for _ in range(rng.randint(lo, hi))]
               for _ in range(args.num_requests)]

    from kvtier.serve.engine import LLMEngine, freeze_startup_heap
    from kvtier.serve.params import RequestParams

    engine = LLMEngine(model, None, serve.engine_config(args, device, prompts))
    serve.drive(engine, serve.warmup_prompts(prompts, device), 4, len(prompts), math.inf, args.seed)
    torch.cuda.synchronize(device)
    if args.gc_freeze:
        freeze_startup_heap()
    collections: list[tuple[float, int, float]] = []  # (when, generation, ms) inside the timed run
    started = {}

    def on_gc(phase, info):
        now = time.perf_counter()
        if phase == "start":
            started["t"] = now
        elif "t" in started:
            collections.append((now - t0, info["generation"], 1e3 * (now - started.pop("t"))))

    compiles: list[tuple[float, str]] = []  # kernels Triton compiles (or loads) inside the timed run
    t0 = time.perf_counter()
    try:
        import triton

        def record_compile(*_, **kw):
            compiles.append((time.perf_counter() - t0, kw.get("repr", "?")))
            return None

        triton.knobs.runtime.jit_cache_hook = record_compile
    except (ImportError, AttributeError):
        pass
    launches: list[tuple[int, int, int, float]] = []  # (step, rows, tokens, ms in execute) of each step
    execute = engine.runner.execute

    def timed_execute(batch, pending=None):
        ts = time.perf_counter()
        try:
            return execute(batch, pending)
        finally:
            launches.append((len(launches) + 1, len(batch.rows), batch.num_tokens,
                             1e3 * (time.perf_counter() - ts)))

    engine.runner.execute = timed_execute
    params = RequestParams(max_tokens=args.output_len, ignore_eos=True)
    ids = [engine.add_request(q, params) for q in prompts]
    walls: list[tuple[str, float]] = []
    first: dict[str, float] = {}
    marked, produced = None, 0
    activities = [torch.profiler.ProfilerActivity.CUDA] + [torch.profiler.ProfilerActivity.CPU] * args.cpu_trace
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        gc.callbacks.append(on_gc)  # the timed run's collections only, not the profiler's start
        while engine.has_unfinished():
            ts = time.perf_counter()
            outs = engine.step()
            walls.append(("decode" if marked else "prompt", 1e3 * (time.perf_counter() - ts)))
            for o in outs:
                first.setdefault(o.request_id, time.perf_counter() - t0)
                produced += len(o.token_ids)
            if marked is None and len(first) == len(ids):
                marked = time.perf_counter() - t0
                torch.cuda._sleep(1000)  # the phase marker: a kernel named spin_kernel
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        gc.callbacks.remove(on_gc)  # before the profiler's own work on leaving
    steps = {phase: sum(k == phase for k, _ in walls) for phase in ("prompt", "decode")}

    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    marks = [e.time_range.start for e in events if kind_of(e.name) == "marker"]
    split = marks[0] if marks else math.inf
    phases = {"prompt": defaultdict(float), "decode": defaultdict(float)}
    names = {"prompt": defaultdict(lambda: [0.0, 0]), "decode": defaultdict(lambda: [0.0, 0])}
    span = {"prompt": [math.inf, 0.0], "decode": [math.inf, 0.0]}
    gaps = {"prompt": [], "decode": []}  # GPU idle between consecutive kernels: (us, before, after)
    last_end, last_name = None, ""
    for e in events:
        if last_end is not None and e.time_range.start > last_end:
            phase = "prompt" if e.time_range.start <= split else "decode"
            gaps[phase].append((e.time_range.start - last_end, last_name, e.name))
        if last_end is None or e.time_range.end > last_end:
            last_end, last_name = e.time_range.end, e.name
        kind = kind_of(e.name)
        if kind == "marker":
            continue
        phase = "prompt" if e.time_range.start < split else "decode"
        us = e.time_range.end - e.time_range.start
        phases[phase][kind] += us
        names[phase][e.name][0] += us
        names[phase][e.name][1] += 1
        span[phase][0] = min(span[phase][0], e.time_range.start)
        span[phase][1] = max(span[phase][1], e.time_range.end)

    report = {"model": label, "kv_quant": args.kv_quant or "bf16", "requests": len(prompts),
              "max_batched_tokens": engine.scheduler.config.max_batched_tokens,
              "wall_s": wall, "output_tok_s": produced / wall, "last_prompt_done_s": marked,
              "steps": steps, "step_wall_ms": walls, "compiles": compiles,
              "gc_frozen": args.gc_freeze, "collections": collections, "phases": {}}
    print(f"{label}, {report['kv_quant']} pages: {produced} tokens in {wall:.3f} s under the profiler "
          f"({produced / wall:,.1f} tok/s); last prompt done at {marked:.3f} s; steps {steps}")
    for phase in ("prompt", "decode"):
        busy = sum(phases[phase].values())
        width = max(span[phase][1] - span[phase][0], 1e-9)
        top = sorted(names[phase].items(), key=lambda kv: -kv[1][0])[: args.top]
        report["phases"][phase] = {
            "span_ms": width / 1e3, "kernel_ms": busy / 1e3,
            "by_kind_ms": {k: v / 1e3 for k, v in sorted(phases[phase].items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:160], "ms": t / 1e3, "count": c, "kind": kind_of(n)} for n, (t, c) in top],
            "idle_ms": sum(g[0] for g in gaps[phase]) / 1e3,
            "largest_gaps": [{"us": g, "after": a[:80], "before": b[:80]}
                             for g, a, b in sorted(gaps[phase], reverse=True)[: args.top]]}
        print(f"\n{phase} phase: {width / 1e3:,.1f} ms from first to last kernel, {busy / 1e3:,.1f} ms of kernels "
              f"({100 * busy / width:.1f}% busy), {steps[phase]} steps")
        for k, v in report["phases"][phase]["by_kind_ms"].items():
            print(f"  {k:<10} {v:10,.1f} ms")
        for row in report["phases"][phase]["top"]:
            print(f"    {row['ms']:9,.1f} ms {row['count']:7d}x  {row['kind']:<9} {row['name'][:100]}")
        print(f"  idle between kernels {report['phases'][phase]['idle_ms']:,.1f} ms; the largest gaps:")
        for g in report["phases"][phase]["largest_gaps"]:
            print(f"    {g['us'] / 1e3:8.2f} ms after {g['after'][:50]} before {g['before'][:50]}")
        ws = [w for k, w in walls if k == phase]
        if ws:
            print(f"  host wall a step: median {sorted(ws)[len(ws) // 2]:.1f} ms, max {max(ws):.1f}; "
                  f"the first ten {[round(w, 1) for w in ws[:10]]}")
    # the host only launches in execute; a step far over the median waited for the GPU there
    median = sorted(ms for *_, ms in launches)[len(launches) // 2]
    blocked = [x for x in launches if x[3] > max(3 * median, median + 20)]
    report["blocked_launches"] = [{"step": a, "rows": b, "tokens": c, "ms": d} for a, b, c, d in blocked]
    print(f"\nhost time in ModelRunner.execute: median {median:.1f} ms a step; {len(blocked)} steps over "
          f"3x that (the host waited inside the forward): {[(a, b, c, round(d, 1)) for a, b, c, d in blocked[:12]]} "
          "(step, rows, tokens, ms)")
    slow = sorted(collections, key=lambda c: -c[2])[:5]
    print(f"\n{len(collections)} garbage collections inside the timed run "
          f"({sum(c[1] == 2 for c in collections)} of generation 2), {sum(c[2] for c in collections):.1f} ms "
          f"in all{' (start-up heap frozen)' if args.gc_freeze else ''}; the longest: "
          f"{[(round(t, 3), g, round(ms, 1)) for t, g, ms in slow]}")
    print(f"{len(compiles)} Triton compilations or cache loads inside the timed run")
    for t, r in compiles[:20]:
        print(f"  {t:8.3f} s  {r[:150]}")
    if args.cpu_trace:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
        report["cpu_table"] = table
        print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
