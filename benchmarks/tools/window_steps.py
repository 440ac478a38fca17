"""Decode steps of a model with a sliding window, past the window, against the same model without one.

The default model (or ``--arch``'s random weights) is given a window of ``--window`` keys in every
layer (as Mistral 7B v0.1 has 4,096); a prompt of ``--context`` random tokens is prefilled on each
tier, then ``--steps`` decode steps are timed one by one. Without a window the kernels attend over the
whole context (on the CPU the one-call step for the tail tier, the C decode kernel for the paged one);
with it each step attends over its window (the tail tier's one-call step, the C decode kernel, the
PyTorch reference where neither serves). ``paged-planned``: ``generate``'s decode steps over a step
plan (on the CPU the one-call step over the pages, as the server's). Printed: the median step of
both and their ratio, per tier; the figures as JSON with ``--json``.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/window_steps.py --device cpu --json window.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _steps(model, tier: str, context: int, steps: int, device: str) -> list[float]:
    from kvtier.config import KVCacheConfig
    from kvtier.generate import generate_step

    cfg = KVCacheConfig(tier=tier) if not tier.startswith("paged") else KVCacheConfig(
        tier="paged", paged_num_blocks=(context + steps) // 16 + 2)
    caches = model.make_caches(cfg)
    ids = torch.randint(10, model.args.vocab_size - 10, (1, context + steps),
                        generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    if tier == "paged-planned":  # generate's decode steps over one step plan (on the CPU the one-call step)
        run = generate_step(model, ids[:, :context].tolist(), caches, prefill_chunk=512)
        next(run)
        for _ in range(steps):
            t0 = time.perf_counter()
            next(run)
            times.append(time.perf_counter() - t0)
        run.close()
        return times
    with torch.inference_mode():
        for start in range(0, context, 512):
            model(ids[:, start : min(start + 512, context)], caches, last_only=True)
        for t in range(context, context + steps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(ids[:, t : t + 1], caches)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return times


def set_window(model, plain, window: int | None) -> None:
    """Give ``model`` (whose arguments without a window are ``plain``) ``window`` keys in every
    layer, or none: the same weights either way."""
    from kvtier.model import ModelArgs
    from kvtier.model.cpu_step import forget

    model.args = ModelArgs.from_dict({**plain.to_dict(), "sliding_window": window})
    for i, layer in enumerate(model.layers):
        layer.attention.window = model.args.window_of(i)
    forget(model)  # (the CPU step's plan holds the windows)


def write_json(out: dict, path: str | None) -> None:
    """``out`` as indented JSON at ``path`` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arch", default=None, help="random weights of a named shape (default: the default model)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--tiers", default="tail,paged,paged-planned")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from kvtier.model import build_random, load_model

    if args.arch:
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model, label = build_random(args.arch, device=args.device, dtype=dtype), f"{args.arch} ({dtype})"
    else:
        model = load_model(device=args.device, dtype=torch.float32, progress=False).model
        label = "default model (SmolLM2-135M-Instruct, float32)"
    plain = model.args
    out = {"model": label, "device": args.device, "args": vars(args), "tiers": {}}
    for tier in args.tiers.split(","):
        row = {}
        for name, window in (("whole context", None), (f"window {args.window}", args.window)):
            set_window(model, plain, window)
            xs = _steps(model, tier, args.context, args.steps, args.device)
            row[name] = 1e3 * statistics.median(xs)
        a, b = row.values()
        row["window / whole"] = b / a
        out["tiers"][tier] = row
        print(f"{tier:6s} context {args.context}: whole context {a:7.2f} ms a step, window {args.window} "
              f"{b:7.2f} ms ({b / a:.2f}x)", flush=True)
    write_json(out, args.json)


if __name__ == "__main__":
    main()
