"""One ragged decode step against row-by-row and padded tail caches.

``B`` rows (default 8) hold lengths spread evenly from ``--min-len`` to ``--max-len``
(default 1,024 to 8,192 tokens). One decode step writes one token per row, builds
the mask and computes the attention of one query per row. Contenders:

- ``ragged``: one :class:`RaggedBatchKVCache` (one scatter, one masked attention over
  the padded buffer, cut at the host bound);
- ``ragged frozen``: the same after ``freeze_capacity`` (static shapes: attention
  over the whole capacity, as a CUDA graph would run it);
- ``row by row``: ``B`` tail caches of one row each, stepped one after another, the
  outputs concatenated;
- ``ragged + triton`` (CUDA only): the same cache read by the Triton ragged decode
  kernel of :mod:`kvtier.kernels.triton_ragged` instead of the masked SDPA path;
- ``padded tail``: one tail cache holding every row padded to the longest (the cost
  of padding; its rows' outputs are not masked per row, so they are not checked).

Head shape: ``--shape llama`` (default; one layer of Llama-3-8B: 32 query heads,
8 KV heads, head_dim 128) or ``--shape smollm2`` (9, 3, 64). Time: the median of
``--repeats`` steps, each timed alone (CUDA synchronised), after ``--warmup`` steps;
after each step every cache is trimmed back by one token, so all steps see the same
lengths. Memory: the bytes each contender's caches hold, and on CUDA the peak
allocator bytes one step adds (mask, GQA-expanded K/V, outputs). The ragged
outputs are checked against the row-by-row ones.

Example::

    kvtier bench ragged
    python benchmarks/ragged.py --shape smollm2 --device cuda --plot benchmarks/ragged.png
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch

from kvtier.caches.ragged import RaggedBatchKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.devices import set_threads
from kvtier_bench._progress import BenchProgress

SHAPES = {"llama": (32, 8, 128), "smollm2": (9, 3, 64)}  # (H_q, H_kv, D)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=8, help="rows in the batch")
    parser.add_argument("--min-len", type=int, default=1024, help="shortest row (tokens)")
    parser.add_argument("--max-len", type=int, default=8192, help="longest row (tokens)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama",
                        help="head shape: llama (32/8/128) or smollm2 (9/3/64)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--plot", default=None, help="write a PNG of the figures here")


def _time_steps(step: Callable[[], torch.Tensor], trim: Callable[[], None], args, sync) -> tuple:
    """Median seconds of one step, its first output and the peak bytes a step adds (CUDA)."""
    for _ in range(args.warmup):
        step()
        trim()
    sync()
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times, first = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t0)
        first = out if first is None else first
        trim()
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    return statistics.median(times), first, peak


def _row_by_row(rows: list, step_in: tuple, args, sync) -> tuple:
    """``B`` one-row tail caches stepped one after another, outputs concatenated."""
    k1, v1, q1 = step_in
    tails = [TailOwnedKVCache() for _ in rows]
    for t, (k, v) in zip(tails, rows):
        t.update(k, v)

    def step() -> torch.Tensor:
        outs = []
        for r, t in enumerate(tails):
            t.update(k1[r : r + 1], v1[r : r + 1])
            outs.append(t.attention(q1[r : r + 1]))  # (1, H_q, 1, D)
        return torch.cat(outs)

    s, out, peak = _time_steps(step, lambda: [t.trim(1) for t in tails], args, sync)
    return s, out, sum(t.nbytes for t in tails), peak


def _triton_decode(*args, **kwargs) -> torch.Tensor:
    from kvtier.kernels.triton_ragged import ragged_decode_attention_triton  # imports triton

    return ragged_decode_attention_triton(*args, **kwargs)


def _ragged(rows: list, lengths: list[int], variant: str, step_in: tuple, args, sync) -> tuple:
    """One ragged cache holding every row at its own length; ``variant``: plain, frozen, triton."""
    k1, v1, q1 = step_in
    keys = rows[0][0].new_zeros(len(rows), rows[0][0].shape[1], max(lengths), rows[0][0].shape[3])
    values = torch.zeros_like(keys)  # (B, H_kv, max_len, D)
    for r, (k, v) in enumerate(rows):
        keys[r, :, : lengths[r]], values[r, :, : lengths[r]] = k[0], v[0]
    cache = RaggedBatchKVCache(keys=keys, values=values, offsets=lengths)
    del keys, values
    if variant == "frozen":
        cache.freeze_capacity(max(lengths) + 1)
    else:
        cache.reserve(1)

    def step() -> torch.Tensor:
        cache.update(k1, v1)
        if variant == "triton":  # reads each row's first offset[b] keys; no mask
            S = cache.host_bound
            return _triton_decode(q1, cache.keys[:, :, :S], cache.values[:, :, :S], cache.offset)
        return cache.attention(q1)  # the mask is built inside, from the offsets

    s, out, peak = _time_steps(step, lambda: cache.trim(1), args, sync)
    return s, out, cache.nbytes, peak


def _padded(keys: torch.Tensor, values: torch.Tensor, step_in: tuple, args, sync) -> tuple:
    """One tail cache with every row padded to the longest; its output is not checked."""
    k1, v1, q1 = step_in
    cache = TailOwnedKVCache()
    cache.update(keys, values)
    del keys, values

    def step() -> torch.Tensor:
        cache.update(k1, v1)
        return cache.attention(q1)

    s, _, peak = _time_steps(step, lambda: cache.trim(1), args, sync)
    return s, None, cache.nbytes, peak


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        console.print(f"--device {args.device}: CUDA is not available here; use --device cpu")
        return 2
    if not 1 <= args.min_len <= args.max_len or args.batch < 1 or args.repeats < 1:
        console.print("need --batch >= 1, --repeats >= 1 and 1 <= --min-len <= --max-len")
        return 2
    if args.threads:
        set_threads(args.threads)
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    Hq, Hkv, D = SHAPES[args.shape]
    B = args.batch
    lengths = [round(args.min_len + i * (args.max_len - args.min_len) / max(B - 1, 1)) for i in range(B)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    rows = [(rand(1, Hkv, n, D), rand(1, Hkv, n, D)) for n in lengths]  # each (1, H_kv, L_r, D)
    step_in = (rand(B, Hkv, 1, D), rand(B, Hkv, 1, D), rand(B, Hq, 1, D))  # k, v, q of one token
    results: dict[str, tuple] = {}  # name -> (seconds, output, held bytes, peak bytes)
    # one contender at a time, each freed before the next is built
    variants = {"ragged": "plain", "ragged frozen": "frozen"}
    if dev.type == "cuda":
        variants["ragged + triton"] = "triton"
    with BenchProgress("ragged", len(variants) + 2) as bar:  # long rows take a while on CPU
        bar.advance("row by row")
        results["row by row"] = _row_by_row(rows, step_in, args, sync)
        for name, variant in variants.items():
            bar.advance(name)
            results[name] = _ragged(rows, lengths, variant, step_in, args, sync)
            gc.collect()
        bar.advance("padded tail")
        results["padded tail"] = _padded(rand(B, Hkv, max(lengths), D), rand(B, Hkv, max(lengths), D),
                                         step_in, args, sync)
    ref = results["row by row"][1].float()
    base_s, base_b = results["ragged"][0], results["ragged"][2]
    table = Table(title=f"one decode step: B={B}, rows {lengths[0]:,}..{lengths[-1]:,} tokens, "
                        f"H_q/H_kv/D {Hq}/{Hkv}/{D} ({args.shape}), {dtype}, {dev}",
                  caption="time x = contender's step time / ragged's (above 1: ragged is "
                          "faster); memory x = contender's held bytes / ragged's")
    for col in ("contender", "ms/step", "time x", "held MiB", "memory x", "step peak MiB",
                "max |out - rows|"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    for name, (s, out, held, peak) in results.items():
        err = "-" if out is None else f"{(out.float() - ref).abs().max().item():.2e}"
        table.add_row(name, f"{s * 1e3:.3f}", f"{s / base_s:.2f}", f"{held / 2**20:,.1f}",
                      f"{held / base_b:.2f}", "n/a" if peak is None else f"{peak / 2**20:,.1f}", err)
    console.print(table)
    if args.plot:
        _plot(results, args.plot, table.title)
        console.print(f"plot written to {args.plot}")
    return 0


def _plot(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [results[n][0] * 1e3 for n in names])
    a.set_ylabel("one decode step (ms)")
    b.bar(names, [results[n][2] / 2**20 for n in names])
    b.set_ylabel("bytes held (MiB)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
