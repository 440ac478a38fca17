"""Per-token append cost of the tail and block tiers against Hugging Face's DynamicLayer.

For each context ``C`` every contender is filled to ``C - steps`` tokens in one
update, then appends ``steps`` single tokens ``[B, H_kv, 1, D]`` one by one; each
step is timed alone. The window ends at ``C`` and, by default, is a multiple of
the tail tier's ``step`` and the block tier's ``block_size``, so it holds the same
share of growth events as any stretch of that length: its mean is the amortised
cost per token, growth included. ``DynamicLayer.update`` concatenates the whole
cache on every step (nothing to amortise), so a few steps measure it.

Each (contender, context) runs in a fresh process, so one run's freed memory
cannot hide the next run's allocations. Memory: on CPU, the peak resident set
size (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs``)
above the RSS before the run, inputs already allocated, so it counts what the
contender allocated, transient copies included ("n/a" where ``/proc`` is
missing); on CUDA, ``torch.cuda.max_memory_allocated`` above the start. Also
shown: the bytes the contender's K/V tensors hold at the end.

Example::

    kvtier bench append --quick
    python benchmarks/append.py --contexts 1024,8192,32768 --plot benchmarks/append.png
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier_bench import FOLDER
from kvtier_bench._memory import reset_peak_rss, rss_bytes

PEER = "DynamicLayer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="1024,8192,32768",
                        help="comma-separated contexts (tokens) at which each window ends")
    parser.add_argument("--steps", type=int, default=1024,
                        help="timed one-token steps per window for the tail and block tiers")
    parser.add_argument("--peer-steps", type=int, default=8,
                        help="timed steps per window for DynamicLayer (each copies the whole cache)")
    parser.add_argument("--quick", action="store_true",
                        help="contexts 1024,4096, 256 steps, 4 DynamicLayer steps")
    parser.add_argument("--plot", default=str(FOLDER / "append.png"), help=f"PNG written here (default {FOLDER / 'append.png'}, beside the benchmarks; \"\" for none)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--step", type=int, default=None,
                        help="tail tier step (default: TailOwnedKVCache's)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="block tier block size (default: BlockOwnedKVCache's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads in each measuring process (1: a decode step's "
                             "copies are small, and one thread keeps other load out of the figures)")


@dataclass
class Job:
    """One (contender, context) measurement, run in a process of its own."""

    name: str
    context: int
    steps: int
    dims: tuple[int, int, int]  # (B, H_kv, D)
    device: str
    threads: int
    params: dict = field(default_factory=dict)  # constructor arguments of the tier


@dataclass
class Result:
    name: str
    context: int
    step_s: list[float]
    peak: int | None  # bytes above the start (RSS on CPU, allocator on CUDA)
    held: int  # bytes of K/V the contender holds at the end
    grow_events: int | None  # in the timed window; None for DynamicLayer

    @property
    def mean_us(self) -> float:
        return statistics.fmean(self.step_s) * 1e6

    @property
    def median_us(self) -> float:
        return statistics.median(self.step_s) * 1e6


# -- contenders ------------------------------------------------------------------------


def _make(job: Job):
    if job.name == PEER:
        from transformers.cache_utils import DynamicLayer

        return DynamicLayer()
    cls = {"tail": TailOwnedKVCache, "block": BlockOwnedKVCache}[job.name]
    return cls(**job.params)


def _measure(job: Job) -> Result:
    torch.set_num_threads(job.threads)  # this process only: it was spawned for this job
    B, H, D = job.dims
    cuda = job.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    pre_k, pre_v = (torch.randn(B, H, job.context - job.steps, D, generator=gen).to(job.device)
                    for _ in range(2))
    new_k, new_v = (torch.randn(job.steps, B, H, 1, D, generator=gen).to(job.device)
                    for _ in range(2))
    warm = _make(job)  # first calls pay one-off costs (dispatch, lazy initialisation)
    for i in range(min(8, job.steps)):
        warm.update(new_k[i], new_v[i])
    del warm
    cache = _make(job)
    gc.collect()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes("VmRSS")
        base = base if reset_peak_rss() else None

    if pre_k.shape[2]:
        cache.update(pre_k, pre_v)
    grow0 = None if job.name == PEER else cache.stats()["grow_events"]
    times = []
    for i in range(job.steps):
        sync()
        t0 = time.perf_counter()
        cache.update(new_k[i], new_v[i])
        sync()
        times.append(time.perf_counter() - t0)

    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        hwm = rss_bytes("VmHWM")
        peak = None if base is None or hwm is None else hwm - base
    if job.name == PEER:
        held, grow = cache.keys.nbytes + cache.values.nbytes, None
    else:
        held, grow = cache.nbytes, cache.stats()["grow_events"] - grow0
    return Result(job.name, job.context, times, peak, held, grow)


def _measure_apart(job: Job) -> Result:
    """Run one job in a fresh process (spawned: no inherited heap, no CUDA state)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_measure, job).result()


# -- report ------------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f}"


def _table(results: list[Result], title: str):
    from rich.table import Table

    peer = {r.context: r for r in results if r.name == PEER}
    table = Table(title=title, caption=(
        "µs per one-token append over the window ending at 'tokens' (mean: growth amortised); "
        "× = DynamicLayer mean / this mean; grows = allocations in the window; peak = memory "
        "above the start of the run; held = K/V bytes at the end"))
    for col in ("cache", "tokens", "mean µs", "median µs", "worst ms", "× vs HF",
                "grows", "peak MiB", "held MiB"):
        table.add_column(col, justify="left" if col == "cache" else "right")
    for r in sorted(results, key=lambda r: (r.name != PEER, r.name, r.context)):
        ratio = peer[r.context].mean_us / r.mean_us if r.context in peer else float("nan")
        table.add_row(
            r.name, f"{r.context:,}", f"{r.mean_us:,.1f}", f"{r.median_us:,.1f}",
            f"{max(r.step_s) * 1e3:,.2f}", "1.0" if r.name == PEER else f"{ratio:,.0f}",
            "-" if r.grow_events is None else str(r.grow_events), _mib(r.peak), _mib(r.held),
        )
    return table


def _plot(results: list[Result], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r.name for r in results):
        rs = sorted((r for r in results if r.name == name), key=lambda r: r.context)
        ctx = [r.context for r in rs]
        (line,) = ax_t.plot(ctx, [r.mean_us for r in rs], marker="o", label=f"{name} (mean)")
        if name != PEER:
            ax_t.plot(ctx, [r.median_us for r in rs], ls="--", color=line.get_color(),
                      label=f"{name} (median)")
        if all(r.peak is not None for r in rs):
            ax_m.plot(ctx, [r.peak / 2**20 for r in rs], marker="o", label=name)
    ax_t.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="µs per appended token",
             title="append cost, growth amortised")
    ax_m.set(xscale="log", xlabel="context (tokens)", ylabel="MiB",
             title="peak memory above start (window run)")
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write the plot; returns 0 (a bad flag: ValueError, transformers
    missing: ImportError)."""
    from rich.console import Console

    console = Console()
    if console.width < 120:  # the table has nine columns; wrap rather than truncate them
        console = Console(width=120)
    if args.quick:
        args.contexts, args.steps, args.peer_steps = "1024,4096", 256, 4
    try:
        contexts = [int(c) for c in str(args.contexts).split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--contexts {args.contexts!r}: give comma-separated integers, e.g. 1024,8192") from None
    for name in ("steps", "peer_steps", "batch", "kv_heads", "head_dim", "threads"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    least = max(args.steps, args.peer_steps)
    if not contexts or min(contexts) < least:
        raise ValueError(f"--contexts {args.contexts!r}: each context must be at least {least} tokens "
                         f"(--steps {args.steps}, --peer-steps {args.peer_steps}): give longer contexts or fewer steps")
    try:
        import transformers.cache_utils  # noqa: F401
    except ImportError as e:
        raise ImportError(f"transformers is needed for the {PEER} baseline ({e}); "
                          "install it with: pip install 'kvtier[hf]'") from e
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available here; use --device cpu")

    tail_kw = {} if args.step is None else {"step": args.step}
    block_kw = {} if args.block_size is None else {"block_size": args.block_size}
    tail, block = TailOwnedKVCache(**tail_kw), BlockOwnedKVCache(**block_kw)  # validates them
    contenders = [
        (PEER, args.peer_steps, {}),
        ("tail", args.steps, tail_kw),
        ("block", args.steps, block_kw),
    ]
    dims = (args.batch, args.kv_heads, args.head_dim)
    results = []
    for context in contexts:
        for name, steps, params in contenders:
            console.print(f"[dim]{name} at {context:,} tokens ({steps} steps)…[/dim]")
            results.append(_measure_apart(Job(name, context, steps, dims, args.device, args.threads, params)))

    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
             else f"CPU, {args.threads} thread(s)")
    title = (f"append one token, B={args.batch} H_kv={args.kv_heads} D={args.head_dim} fp32, "
             f"{where}; step={tail.step}, block_size={block.block_size}")
    console.print(_table(results, title))
    _summary(console, results, contexts)
    if args.plot:  # "" for no plot, as in the other benchmarks
        _plot(results, args.plot, title)
        console.print(f"plot written to {args.plot}")
    return 0


def _summary(console, results: list[Result], contexts: list[int]) -> None:
    by = {(r.name, r.context): r for r in results}
    lo, hi = min(contexts), max(contexts)
    for name in ("tail", "block"):
        ratio = by[(PEER, hi)].mean_us / by[(name, hi)].mean_us
        flat_mean = by[(name, hi)].mean_us / by[(name, lo)].mean_us
        flat_median = by[(name, hi)].median_us / by[(name, lo)].median_us
        console.print(
            f"{name}: at {hi:,} tokens {ratio:,.0f}× cheaper than {PEER} per token; "
            f"cost {hi:,} vs {lo:,}: mean ×{flat_mean:.2f}, median ×{flat_median:.2f}"
        )
