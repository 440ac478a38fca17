"""The engine's steps while a begun save of the prefix cache is written, against its steps without one.

The workload of ``kvtier bench restart`` (``--documents`` documents of ``--document-tokens``
tokens, asked once so the prefix cache holds them) is cached, then ``--rows`` requests of
``--prompt-tokens`` prompt tokens and ``--max-tokens`` new tokens keep the engine stepping (a
request that ends is replaced at once). The step times are taken without a save, then while a
save begun between two steps (:func:`~kvtier.serve.prefix_save.begin_prefix_save`) is written by
its thread: ``incremental`` after a save while the engine waited and a few new blocks (the
periodic case), ``full`` with no file yet (every block copied). Printed: the engine's pause to
begin, the thread's time to write, and the median, p99 and longest step of both runs; the
figures as JSON with ``--json``.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/save_steps.py --device cpu --json steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from kvtier_bench.offload import workload


def _quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def _figures(xs: list[float]) -> dict:
    return {"steps": len(xs), "median_ms": 1e3 * statistics.median(xs), "p99_ms": 1e3 * _quantile(xs, 0.99),
            "max_ms": 1e3 * max(xs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--document-tokens", type=int, default=512)
    parser.add_argument("--rows", type=int, default=4, help="requests kept in flight")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--baseline-steps", type=int, default=200)
    parser.add_argument("--arch", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.kv_quant, args.threads = None, None

    from kvtier.serve.engine import EngineConfig, LLMEngine
    from kvtier.serve.params import RequestParams
    from kvtier.serve.prefix_save import begin_prefix_save, save_prefix_cache

    model, tokenizer, label, (first, second) = workload(args, args.device, 2)
    out = {"model": label, "device": args.device, "args": vars(args)}
    for mode in ("incremental", "full"):
        engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=(2 * args.documents + args.rows + 2) * (
            max(map(len, first + second)) // 16 + 8)))
        engine.generate(first, RequestParams(max_tokens=4))
        params = RequestParams(max_tokens=args.max_tokens, ignore_eos=True)

        def steps(until, engine=engine, params=params) -> list[float]:
            times = []
            while not until(len(times)):
                while len(engine.scheduler.running) + len(engine.scheduler.waiting) < args.rows:
                    engine.add_request(second[0][-args.prompt_tokens:], params)
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            return times

        steps(lambda n: n >= 60)  # warm
        base = steps(lambda n: n >= args.baseline_steps)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "prefixes.safetensors")
            if mode == "incremental":
                save_prefix_cache(engine, path)
                engine.generate(second[1:], RequestParams(max_tokens=4))  # a few blocks new to the file
            t0 = time.perf_counter()
            save = begin_prefix_save(engine, path)
            during = steps(lambda n, save=save: save.written())
            written = time.perf_counter() - t0
            save.finish()
        out[mode] = {"pause_ms": 1e3 * save.pause_s, "new_blocks": save.new_blocks, "blocks": save.blocks,
                     "written_s": written, "without": _figures(base), "during": _figures(during)}
        r = out[mode]
        print(f"{mode}: the engine paused {r['pause_ms']:.1f} ms to copy {save.new_blocks} of {save.blocks} blocks; "
              f"the thread wrote the file in {written:.2f} s")
        for name in ("without", "during"):
            f = r[name]
            print(f"  steps {name} a save: {f['steps']}, median {f['median_ms']:.1f} ms, p99 {f['p99_ms']:.1f}, "
                  f"longest {f['max_ms']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
