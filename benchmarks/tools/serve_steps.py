"""Where a serving step's wall time goes, with and without asynchronous scheduling: the
engine on issue 14's workload (Llama-3-8B shape, bf16, random weights, 256 requests of
64-1,024 prompt tokens and 256 new tokens), each phase of ``LLMEngine.step`` timed on the
host (schedule, launch, book, resolve, and inside resolve the wait for the GPU), medians
over the decode-only steps of at least 200 rows.

    PYTHONPATH=src python3 benchmarks/tools/serve_steps.py [--out steps.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="llama3-8b")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from kvtier.model import build_random

    model = build_random(args.arch, dtype=torch.bfloat16, device="cuda")
    rng = random.Random(0)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(64, 1024))] for _ in range(args.requests)]
    need = sum(math.ceil((len(q) + args.output_len) / 16) for q in prompts) + 64
    results = {}
    for mode in (True, False):
        summary = run(model, prompts, need, args, mode)
        results["async" if mode else "sync"] = summary
        print("async" if mode else "sync", json.dumps(summary), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def run(model, prompts, need: int, args, mode: bool) -> dict:
    """The workload through one engine (``async_scheduling=mode``); medians of its decode steps."""
    from kvtier.serve.engine import EngineConfig, LLMEngine
    from kvtier.serve.params import RequestParams

    engine = LLMEngine(model, None, EngineConfig(
        num_blocks=need, max_num_seqs=args.requests, max_batched_tokens=8192, max_waiting=args.requests,
        enable_prefix_caching=False, async_scheduling=mode))
    for q in prompts:  # warm-up: every prompt length's kernels
        engine.add_request(q, RequestParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    spent = dict.fromkeys(("schedule", "launch", "book", "resolve", "wait"), 0.0)

    def timed(obj, name, key):
        f = getattr(obj, name)

        def g(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(obj, name, g)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine, "_launch", "launch")
    timed(engine, "_book", "book")
    timed(engine, "_resolve", "resolve")
    event_sync = torch.cuda.Event.synchronize

    def waiting(event):
        t = time.perf_counter()
        event_sync(event)
        spent["wait"] += time.perf_counter() - t

    torch.cuda.Event.synchronize = waiting
    try:
        for q in prompts:
            engine.add_request(q, RequestParams(max_tokens=args.output_len, ignore_eos=True))
        steps = []
        t_all = time.perf_counter()
        while engine.has_unfinished():
            before, t0 = dict(spent), time.perf_counter()
            n = len(engine.step())
            steps.append({"s": time.perf_counter() - t0, "outputs": n,
                          "prompts_waiting": bool(engine.scheduler.waiting),
                          **{k: spent[k] - before[k] for k in spent}})
        total = time.perf_counter() - t_all
    finally:
        torch.cuda.Event.synchronize = event_sync
    decode = [s for s in steps if s["outputs"] >= 200 and not s["prompts_waiting"]]
    summary = {"total_s": total, "output_tok_s": args.requests * args.output_len / total,
               "steps": len(steps), "decode_steps": len(decode),
               "prompt_phase_s": sum(s["s"] for s in steps if s["prompts_waiting"])}
    for k in ("s", *spent):
        summary[f"{k}_ms_median"] = 1000 * statistics.median(s[k] for s in decode) if decode else None
    return summary


if __name__ == "__main__":
    main()
