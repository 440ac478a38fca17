"""Host (Python) time of the serving engine's decode steps.

A decode step on a GPU should cost little more than its kernels; what the host adds
does not overlap them. On the CPU this tool runs the engine with a tiny random model
(dim 64, 2 layers) and splits the median wall time of a decode-only step into
schedule / execute (the model's forward timed apart; on the CPU the paged attention's
PyTorch reference makes it the largest part) / sample / update and outputs, then prints a
cProfile top-20 of decode steps. ``--stub-forward`` replaces the forward by fixed
logits (host time only, in seconds instead of minutes). It also times the host-side
input building of a CUDA-graph decode step (:class:`kvtier.serve.graphs.HostInputs`)
against the list-based construction it replaced. ``--device cuda`` runs ``--arch`` in
bf16 (decode steps replayed from CUDA graphs) and sets the step's wall time beside the
sum of its CUDA kernel times (torch.profiler).

    PYTHONPATH=src .venv/bin/python benchmarks/tools/serve_host.py
    PYTHONPATH=src .venv/bin/python benchmarks/tools/serve_host.py --only engine --stub-forward
    PYTHONPATH=src python3 benchmarks/tools/serve_host.py --device cuda --only engine --prefix off
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import random
import statistics
import time
from collections import defaultdict

import torch

PHASES = ("schedule", "execute", "forward", "sample", "update+outputs", "step")


class _TimedModel:
    """The model, with the time of each call added to ``sink['forward']``."""

    def __init__(self, model, sink: dict[str, float]):
        self._model, self._sink = model, sink

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        out = self._model(*a, **kw)
        self._sink["forward"] += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


class _StubModel:
    """Fixed random logits of the shape the model would return, without running it (host time
    only: nothing is written to the caches)."""

    def __init__(self, model):
        self.args = model.args
        self._logits = torch.randn(1, model.args.vocab_size, generator=torch.Generator().manual_seed(0))

    def __call__(self, tokens, caches, *, last_only=False, select=None, **kw):
        B, T = tokens.shape
        T = len(select) if select is not None else 1 if last_only else T
        return self._logits.expand(B * T, -1).reshape(B, T, -1)  # (B, T, V)


def _timed(fn, name: str, sink: dict[str, float]):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        sink[name] += time.perf_counter() - t0
        return out
    return wrapper


def build_engine(args, prefix: bool):
    """The engine and the prompts: a tiny random model on the CPU, or ``--arch`` on CUDA (bf16)."""
    from kvtier.model import ModelArgs, build_random
    from kvtier.serve.engine import EngineConfig, LLMEngine

    lo, hi = (int(x) for x in args.input_len.split(","))
    if args.device == "cpu":
        margs = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=args.vocab,
                          max_position_embeddings=hi + args.output_len + 16)
        model = build_random(margs, dtype=torch.float32, device="cpu", std=0.2)
    else:
        model = build_random(args.arch, dtype=torch.bfloat16, device=args.device)
    vocab = model.args.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.requests)]
    need = sum(math.ceil((len(q) + args.output_len) / 16) for q in prompts) + 64
    cfg = EngineConfig(num_blocks=need, block_size=16, max_num_seqs=args.requests,
                       max_batched_tokens=args.max_batched_tokens, max_waiting=args.requests,
                       enable_prefix_caching=prefix)
    return LLMEngine(model, None, cfg), prompts


def kernel_ms(engine, steps: int) -> float:
    """Sum of the CUDA kernel times of ``steps`` engine steps, per step (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps


def run_engine(args, prefix: bool) -> tuple[dict[str, list[float]], str, int]:
    """Median-ready per-phase seconds of the decode-only steps, a cProfile table, step count."""
    from kvtier.serve.params import RequestParams

    engine, prompts = build_engine(args, prefix)
    sink: dict[str, float] = defaultdict(float)
    batches = []
    sched, runner = engine.scheduler, engine.runner

    def schedule():
        t0 = time.perf_counter()
        b = type(sched).schedule(sched)
        sink["schedule"] += time.perf_counter() - t0
        batches.append(b)
        return b

    sched.schedule = schedule
    runner.execute = _timed(runner.execute, "execute", sink)
    engine._sample = _timed(engine._sample, "sample", sink)
    runner.model = _TimedModel(_StubModel(runner.model) if args.stub_forward else runner.model, sink)

    params = RequestParams(max_tokens=args.output_len, ignore_eos=True)
    for q in prompts:
        engine.add_request(q, params)
    phases: dict[str, list[float]] = defaultdict(list)
    prof = cProfile.Profile()
    profiled = decode_steps = 0
    kernels = None
    cuda = args.device != "cpu"
    while engine.has_unfinished():
        if cuda and kernels is None and decode_steps == 8:
            kernels = kernel_ms(engine, 4)  # after the decode-only steps began (not timed below)
            phases["kernels"].append(kernels)
        sink.clear()
        batches.clear()
        # profile every fourth decode-only step (after the first few); time the others
        profile = decode_steps >= 4 and decode_steps % 4 == 0 and profiled < args.profile_steps
        t0 = time.perf_counter()
        if profile:
            prof.enable()
        engine.step()
        if profile:
            prof.disable()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        batch = batches[0]
        if not batch.rows or any(len(r.token_ids) != 1 for r in batch.rows):
            continue
        decode_steps += 1
        if profile:
            profiled += 1
            continue
        phases["step"].append(dt)
        for k in ("schedule", "execute", "forward", "sample"):
            phases[k].append(sink[k])
        phases["update+outputs"].append(dt - sink["schedule"] - sink["execute"] - sink["sample"])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
    return phases, s.getvalue(), decode_steps


def fake_rows(n: int, blocks: int, block_size: int, seed: int = 0):
    from kvtier.serve.scheduler import ScheduledRow

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        nb = rng.randint(blocks - 8, blocks + 8)
        start = (nb - 1) * block_size + rng.randrange(block_size)
        ids = tuple(rng.sample(range(100_000), nb))
        rows.append(ScheduledRow(f"r{i}", (rng.randrange(1000),), start, ids, True))
    return rows


def time_host_inputs(args) -> dict[str, float]:
    """Median ms of building one step's inputs: the list-based way, ``HostInputs.fill`` on a
    fresh buffer (every row written), and on the buffer of the step before (rows equal to
    the previous step's, as fresh tuples the way the scheduler makes them)."""
    from kvtier.serve.graphs import HostInputs, reference_inputs
    from kvtier.serve.scheduler import ScheduledRow

    rows = fake_rows(args.requests, args.blocks, 16)
    width, bucket, scratch = args.blocks + 16, args.requests, 100_001
    steady = HostInputs(bucket, width, block_size=16, scratch=scratch)
    steady.fill(rows, bucket)
    cases = {
        "list-based": lambda rs: reference_inputs(rs, bucket, 16, scratch),
        "host_inputs, first step": lambda rs: HostInputs(bucket, width, block_size=16,
                                                        scratch=scratch).fill(rs, bucket),
        "host_inputs, next steps": lambda rs: steady.fill(rs, bucket),
    }
    out = {}
    for name, fn in cases.items():
        ts = []
        for _ in range(args.repeats):
            rs = [ScheduledRow(r.request_id, r.token_ids, r.start, tuple(list(r.blocks)), r.sample)
                  for r in rows]
            t0 = time.perf_counter()
            fn(rs)
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts) * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--input-len", default="64,1024")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--profile-steps", type=int, default=16)
    p.add_argument("--blocks", type=int, default=80, help="blocks per fake row of the input-building timing")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cpu", help="cpu: the tiny model; cuda: --arch in bf16")
    p.add_argument("--arch", default="llama3-8b")
    p.add_argument("--prefix", choices=("off", "on", "both"), default="both")
    p.add_argument("--stub-forward", action="store_true",
                   help="fixed logits instead of the model's forward: host time in seconds, not minutes")
    p.add_argument("--only", choices=("engine", "inputs"), default=None)
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)

    if args.only != "inputs":
        for prefix in {"off": (False,), "on": (True,), "both": (False, True)}[args.prefix]:
            phases, table, n = run_engine(args, prefix)
            print(f"\n== prefix caching {'on' if prefix else 'off'}: {n} decode-only steps of "
                  f"{args.requests} rows; median ms per step ==")
            med = {k: statistics.median(phases[k]) * 1e3 for k in PHASES}
            for k in PHASES:
                print(f"  {k:<16} {med[k]:8.3f}")
            if args.device == "cpu":
                print(f"  {'host (step - forward)':<22} {med['step'] - med['forward']:8.3f}")
                print(f"  {'execute - forward':<22} {med['execute'] - med['forward']:8.3f}")
            else:  # graph replays do not call the model: 'forward' is ~0; sample waits for the GPU
                k = phases["kernels"][0] if phases["kernels"] else float("nan")
                print(f"  {'CUDA kernels (profiler)':<24} {k:8.3f}")
                print(f"  {'step - kernels':<24} {med['step'] - k:8.3f}")
            print(f"\ncProfile of {args.profile_steps} decode-only steps (top 20 by own time):")
            print(table)
    if args.only != "engine":
        print(f"\n== CUDA-graph decode inputs, {args.requests} rows of ~{args.blocks} blocks: median ms ==")
        for k, v in time_host_inputs(args).items():
            print(f"  {k:<26} {v:8.3f}")


if __name__ == "__main__":
    main()
