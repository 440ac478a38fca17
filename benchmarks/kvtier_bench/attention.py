"""Paged decode attention bandwidth against PyTorch SDPA, quantised pages, and the write kernel.

Four measurements, each against a peer in the same run:

1. ``bf16``: the Triton paged decode kernel (``paged_attention_triton``, pages of
   ``--page`` tokens scattered through the pool by a shuffled block table)
   against ``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``)
   on the same K/V laid out contiguously ``[B, H_kv, L, D]``. Effective
   bandwidth = K and V bytes read / time.
2. ``quant``: each ``--modes`` codec at ``--quant-batch`` x ``--quant-context``
   against the bf16 kernel on the same shape (speedup = bf16 time / mode time),
   through both decode kernels for quantised pages: ``mma`` (the general kernel,
   on the tensor cores) and ``cuda_core`` (``kvtier.kernels.triton_decode_quant``),
   with the largest difference between their outputs; a last table names the
   faster kernel per mode (``QUANT_DECODE_KERNEL`` in
   ``kvtier.kernels.triton_attention`` picks the default).
3. ``write``: one decode step's write (``paged_write_triton``, ``B`` tokens x
   ``H_kv`` heads, quantised on the way) against the attention time of that step.
4. ``--sweep``: tile sizes, warps, stages and split counts on a few bf16 shapes;
   ``--quant-sweep``: the same for both quantised decode kernels.

Timing: each call is captured ``--iters`` times in one CUDA graph and the graph
is replayed ``--reps`` times between CUDA events (median per call), so launch
overhead is out of the figures for the kernel and for SDPA alike; inputs smaller
than ``4 x`` the L2 cache are replicated and cycled, so no figure reads from L2.

Example::

    kvtier bench attention --out benchmarks/results_gpu_attention.md
    python benchmarks/attention.py --batches 8 --contexts 32768 --sweep
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

L2_BYTES = 60 * 2**20  # H100/H200: about 50-60 MB


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


#: default shapes per device: the GPU's measure bandwidth; the CPU's (Triton's interpreter, a
#: smoke test) are small enough to finish in well under a minute
SHAPES = {
    "cuda": {"batches": "1,8,32,64", "contexts": "4096,16384,32768", "quant_batch": 64,
             "quant_contexts": "1024,8192", "sweep_shapes": "1x32768,8x32768,64x8192", "iters": 20, "reps": 10,
             "heads": 32, "kv_heads": 8, "head_dim": 128},
    "cpu": {"batches": "1,2", "contexts": "32,64", "quant_batch": 2, "quant_contexts": "32",
            "sweep_shapes": "1x32", "iters": 1, "reps": 1, "heads": 4, "kv_heads": 2, "head_dim": 64},
}


def _shape_help(name: str) -> str:
    return f"(default: {SHAPES['cuda'][name]} on cuda, {SHAPES['cpu'][name]} on cpu)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default=None, help=f"batch sizes of the bf16 table {_shape_help('batches')}")
    parser.add_argument("--contexts", default=None,
                        help=f"context lengths of the bf16 table {_shape_help('contexts')}")
    parser.add_argument("--page", type=int, default=16, help="tokens per page (block_size) (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=None, help=f"query heads {_shape_help('heads')}")
    parser.add_argument("--kv-heads", type=int, default=None, help=f"key/value heads {_shape_help('kv_heads')}")
    parser.add_argument("--head-dim", type=int, default=None, help=f"{_shape_help('head_dim')}")
    parser.add_argument("--modes", default="q8;q4;q4_g32;turboquant:q8_0,q3_0",
                        help="';'-separated codec modes of the quantised table (kvtier.quant.codec_for_mode) (default: %(default)s)")
    parser.add_argument("--quant-batch", type=int, default=None, help=f"batch of the quantised table {_shape_help('quant_batch')}")
    parser.add_argument("--quant-contexts", default=None,
                        help=f"contexts of the quantised table {_shape_help('quant_contexts')}")
    parser.add_argument("--iters", type=int, default=None, help=f"calls per captured graph {_shape_help('iters')}")
    parser.add_argument("--reps", type=int, default=None,
                        help=f"graph replays, the median is reported {_shape_help('reps')}")
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel configurations")
    parser.add_argument("--quant-sweep", action="store_true",
                        help="also sweep both quantised decode kernels (BLOCK_N, warps, splits) at --quant-batch x "
                             "the longest --quant-contexts")
    parser.add_argument("--sweep-shapes", default=None, help=f"BxL shapes of the sweep {_shape_help('sweep_shapes')}")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: bf16, quant, write")
    parser.add_argument("--out", default=None, help="write the tables as Markdown here")
    parser.add_argument("--profile", default=None, metavar="BxL[:MODE[@KERNEL]]",
                        help="only call the kernel 3 times on this shape (run under ncu), then exit; "
                             "KERNEL: mma or cuda_core for quantised decode")
    parser.add_argument("--device", default="cuda",
                        help="cuda; cpu runs a smoke test under TRITON_INTERPRET=1, no meaningful times (default: %(default)s)")


# -- timing ---------------------------------------------------------------------------------
def graph_of(fns: list[Callable[[], object]], iters: int) -> tuple[torch.cuda.CUDAGraph, torch.cuda.Stream]:
    """A CUDA graph of ``iters`` calls of ``fns`` (cycled) and the side stream it was captured
    on (replay it there), each called once before (compile, allocate, warm up), replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(iters):
                fns[i % len(fns)]()
        graph.replay()
        torch.cuda.synchronize()
    return graph, stream


def time_calls(fns: list[Callable[[], object]], iters: int, reps: int) -> float:
    """Median seconds per call of ``fns`` (cycled), from CUDA-graph replays (wall clock on the CPU)."""
    if not torch.cuda.is_available():  # a smoke run under the interpreter: the figures mean nothing,
        t0 = time.perf_counter()  # so one call of the first replica (each takes seconds there)
        fns[0]()
        return time.perf_counter() - t0
    graph, stream = graph_of(fns, iters)
    times = []
    with torch.cuda.stream(stream):
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def write_report(out: str | None, name: str, lines: list[str], data) -> None:
    """``lines`` as ``OUT/NAME.md`` and ``data`` as ``OUT/NAME.json`` (the folder made if need be);
    nothing when ``out`` is ``None``."""
    if out is None:
        return
    import json
    from pathlib import Path

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.md").write_text("\n".join(lines) + "\n")
    (folder / f"{name}.json").write_text(json.dumps(data, indent=1))


def copies_for(nbytes: int) -> int:
    """How many replicas keep a cycled working set at 4x the L2 cache."""
    return max(1, min(16, math.ceil(4 * L2_BYTES / max(1, nbytes))))


# -- inputs -------------------------------------------------------------------------------
#: TurboQuant's default pages (8-bit keys, 3-bit values), ``tq`` in the tools' ``--modes``
TQ = "turboquant:q8_0,q3_0"


def page_modes(text: str) -> list[str]:
    """A comma-separated ``--modes`` list as cache modes, ``tq`` standing for :data:`TQ` (a mode
    whose own name holds a comma)."""
    return [TQ if m.strip() == "tq" else m.strip() for m in text.split(",")]


@dataclass
class Paged:
    q: torch.Tensor
    kp: torch.Tensor
    vp: torch.Tensor
    ks: dict
    vs: dict
    table: torch.Tensor
    kv_len: torch.Tensor
    kc: object
    vc: object
    nbytes: int
    #: the query's position, ``kv_len - 1``, made once (``set_lengths``) as an engine's decode
    #: step makes it once for all its layers: a subtraction a call would time a kernel of its own
    q_start: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.set_lengths(self.kv_len)

    def set_lengths(self, kv_len: torch.Tensor) -> None:
        """Each row's keys (a tensor ``[B]``) and the query's position, the last of them."""
        self.kv_len, self.q_start = kv_len, kv_len - 1

    def formats(self) -> tuple:
        """How the kernels see the key and the value pages (``triton_quant.PageFormat``)."""
        from kvtier.kernels.triton_quant import page_format

        return page_format(self.kc, self.kp, self.ks), page_format(self.vc, self.vp, self.vs)

    def attention(self, config=None) -> torch.Tensor:
        from kvtier.kernels.triton_paged import paged_attention_triton

        return paged_attention_triton(
            self.q, self.kp, self.vp, self.table, self.q_start, self.kv_len,
            k_codec=self.kc, v_codec=self.vc, k_sidecars=self.ks, v_sidecars=self.vs, config=config,
        )  # fmt: skip


def build_paged(mode: str, B: int, L: int, args, gen: torch.Generator, k=None, v=None) -> Paged:
    """Pages holding ``k``/``v`` (random if ``None``) ``[B, H_kv, L, D]``, written by the write kernel."""
    from kvtier.kernels.triton_paged import paged_write_triton
    from kvtier.quant import codec_for_mode

    H, D, page = args.kv_heads, args.head_dim, args.page
    kc, vc = codec_for_mode(mode, D, torch.bfloat16)
    per_row = math.ceil(L / page)
    nb = B * per_row
    if k is None:
        k = torch.randn(B, H, L, D, device=args.device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(B, H, L, D, device=args.device, dtype=torch.bfloat16, generator=gen)

    def alloc(codec):
        p = torch.empty(nb, page, H, codec.packed_dim(), dtype=codec.payload_dtype, device=args.device)
        s = {x.name: torch.empty(nb, page, H, x.groups, dtype=x.dtype, device=args.device) for x in codec.sidecar_specs()}
        return p, s

    (kp, ks), (vp, vs) = alloc(kc), alloc(vc)
    table = torch.randperm(nb, device=args.device, generator=gen).to(torch.int32).reshape(B, per_row)
    pos = torch.arange(L, device=args.device)
    slots = (table[:, pos // page].long() * page + pos % page).reshape(-1)  # (B*L,)
    for b0 in range(0, B, 8):  # bounded temporaries
        sl = slots.reshape(B, L)[b0 : b0 + 8].reshape(-1)
        paged_write_triton(kp, vp, ks, vs, sl, k[b0 : b0 + 8], v[b0 : b0 + 8], k_codec=kc, v_codec=vc)
    q = torch.randn(B, args.heads, 1, D, device=args.device, dtype=torch.bfloat16, generator=gen)
    nbytes = B * L * H * (kc.bytes_per_token_head() + vc.bytes_per_token_head())
    kv_len = torch.full((B,), L, dtype=torch.int64, device=args.device)
    return Paged(q, kp, vp, ks, vs, table, kv_len, kc, vc, nbytes)


def bf16_against_sdpa(B: int, L: int, args, gen: torch.Generator) -> tuple[list[Paged], list[Callable], int]:
    """Replicas of bf16 pages of random K/V ``[B, H_kv, L, D]`` (enough to keep the working set
    beyond 4x the L2), the same number of SDPA calls on contiguous copies of that K/V, and the
    K/V bytes of one replica."""
    import torch.nn.functional as F

    k = torch.randn(B, args.kv_heads, L, args.head_dim, device=args.device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    nbytes = 2 * k.numel() * k.element_size()
    n = copies_for(nbytes)
    pg = [build_paged("fp", B, L, args, gen, k, v) for _ in range(n)]
    q = pg[0].q
    sdpa = [
        lambda q=q, k=kk, v=vv: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for kk, vv in [(k, v)] + [(k.clone(), v.clone()) for _ in range(n - 1)]
    ]
    return pg, sdpa, nbytes


# -- the measurements ----------------------------------------------------------------------------
def bench_bf16(args, gen) -> list[dict]:
    rows = []
    for B in _ints(args.batches):
        for L in _ints(args.contexts):
            pg, sdpa, nbytes = bf16_against_sdpa(B, L, args, gen)
            err = (pg[0].attention().float() - sdpa[0]().float()).abs().max().item()
            t_k = time_calls([p.attention for p in pg], args.iters, args.reps)
            t_s = time_calls(sdpa, args.iters, args.reps)
            rows.append(dict(B=B, L=L, mb=nbytes / 1e6, t_kernel=t_k, t_sdpa=t_s,
                             bw_kernel=nbytes / t_k / 1e12, bw_sdpa=nbytes / t_s / 1e12,
                             ratio=t_s / t_k, max_err=err))  # fmt: skip
            del pg, sdpa
            torch.cuda.empty_cache()
    return rows


def _kernel_cfg(kernel: str, **kw):
    from kvtier.kernels.triton_attention import LaunchConfig

    return LaunchConfig(decode_kernel=kernel, **kw)


def bench_quant(args, gen) -> tuple[list[dict], list[dict]]:
    """Each mode through both quantised decode kernels (MMA and CUDA-core, default plans) against bf16."""
    from kvtier.kernels import gluon_decode
    from kvtier.kernels.triton_attention import QUANT_DECODE_KERNEL
    from kvtier.kernels.triton_paged import paged_write_triton

    B = args.quant_batch
    rows, writes = [], []
    for L in _ints(args.quant_contexts):
        base = build_paged("fp", B, L, args, gen)
        n = copies_for(base.nbytes)
        t_bf16 = time_calls([base.attention] + [build_paged("fp", B, L, args, gen).attention for _ in range(n - 1)],
                            args.iters, args.reps)  # fmt: skip
        rows.append(dict(mode="bf16", L=L, mb=base.nbytes / 1e6, t={"mma": t_bf16}, diff=0.0))
        if max(_ints(args.quant_contexts)) == L and "write" not in args.skip:
            writes.append(bench_write("bf16", base, t_bf16, args, gen, paged_write_triton))
        del base
        torch.cuda.empty_cache()
        for mode in args.modes.split(";"):
            p = build_paged(mode, B, L, args, gen)
            ps = [p] + [build_paged(mode, B, L, args, gen) for _ in range(copies_for(p.nbytes) - 1)]
            times = {}
            # the pages the pipelined Gluon kernel reads: it too (their default decode kernel on CUDA)
            gluon = args.device == "cuda" and gluon_decode.pages_kind(*p.formats(), p.q, p.kp) is not None
            for kernel in ("mma", "cuda_core") + (("gluon",) if gluon else ()):
                cfg = _kernel_cfg(kernel)
                times[kernel] = time_calls([lambda x=x, cfg=cfg: x.attention(cfg) for x in ps], args.iters, args.reps)
            diff = (p.attention(_kernel_cfg("mma")).float() - p.attention(_kernel_cfg("cuda_core")).float())
            rows.append(dict(mode=mode, L=L, mb=p.nbytes / 1e6, t=times, diff=diff.abs().max().item(), t_bf16=t_bf16))
            if max(_ints(args.quant_contexts)) == L and "write" not in args.skip:
                family = "turboquant" if mode.startswith("turboquant") else "kv_quant"
                default = "gluon" if gluon else QUANT_DECODE_KERNEL[family]  # the kernel a step takes by default
                writes.append(bench_write(mode, p, times[default], args, gen, paged_write_triton))
            del p, ps
            torch.cuda.empty_cache()
    for r in rows:
        r.setdefault("t_bf16", r["t"]["mma"])
    return rows, writes


def bench_write(mode: str, p: Paged, t_attn: float, args, gen, paged_write_triton) -> dict:
    """One decode step's write (``B`` tokens x ``H_kv`` heads) against that step's attention time."""
    B = p.q.shape[0]
    kn = torch.randn(B, args.kv_heads, 1, args.head_dim, device=args.device, dtype=torch.bfloat16, generator=gen)
    slots = p.table[:, 0].long() * args.page + 3  # one slot per row
    w = lambda: paged_write_triton(p.kp, p.vp, p.ks, p.vs, slots, kn, kn, k_codec=p.kc, v_codec=p.vc)  # noqa: E731
    t_w = time_calls([w], args.iters, args.reps)
    return dict(mode=mode, B=B, L=p.table.shape[1] * args.page, t_write=t_w, t_attn=t_attn, share=t_w / t_attn)


def bench_sweep(args, gen) -> list[dict]:
    from kvtier.kernels.triton_attention import LaunchConfig, plan_launch

    rows = []
    for B, L in (map(int, x.split("x")) for x in args.sweep_shapes.split(",")):
        p = build_paged("fp", B, L, args, gen)
        n = copies_for(p.nbytes)
        ps = [p] + [build_paged("fp", B, L, args, gen) for _ in range(n - 1)]
        auto = plan_launch(B, args.kv_heads, args.heads // args.kv_heads, 1, L, torch.device(args.device), LaunchConfig())[3]
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    for splits in sorted({auto, max(1, auto // 2), auto * 2}):
                        cfg = LaunchConfig(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits)
                        try:
                            t = time_calls([lambda x=x, cfg=cfg: x.attention(cfg) for x in ps], args.iters, args.reps)
                        except Exception as e:  # out of shared memory for a large tile, say
                            print(f"sweep B={B} L={L} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                            continue
                        rows.append(dict(B=B, L=L, block_n=block_n, warps=warps, stages=stages, splits=splits,
                                         auto=splits == auto, t=t, bw=p.nbytes / t / 1e12))  # fmt: skip
        del p, ps
        torch.cuda.empty_cache()
    return rows


def bench_quant_sweep(args, gen, mode: str, t_bf16: float) -> list[dict]:
    """Both quantised decode kernels of ``mode`` over tiles, warps and split counts at one shape."""
    from kvtier.kernels.triton_attention import plan_launch
    from kvtier.kernels.triton_decode_quant import key_lanes, plan_decode

    B, L = args.quant_batch, max(_ints(args.quant_contexts))
    dev = torch.device(args.device)
    G = args.heads // args.kv_heads
    # every configuration is one more compile (seconds each): the MMA kernel's tiles and warps
    # were swept before (benchmarks/results_gpu_attention.md), so its best and two neighbours
    configs = [("mma", 128, 4, None, 2), ("mma", 128, 4, None, 3), ("mma", 64, 4, None, 2)]
    # CUDA-core kernel: 1 or 2 keys a thread (a tile is that times the key lanes of the warps)
    configs += [("cuda_core", rows * key_lanes(args.head_dim, w), w, None, None) for rows in (1, 2) for w in (1, 2)]
    p = build_paged(mode, B, L, args, gen)
    auto_mma = plan_launch(B, args.kv_heads, G, 1, L, dev, _kernel_cfg("mma"), True)[3]
    auto_cc = plan_decode(B, args.kv_heads, L, args.head_dim, dev, _kernel_cfg("cuda_core"))[2]
    extra = [("mma", 128, 4, s, 2) for s in sorted({max(1, auto_mma // 2), auto_mma * 2})]
    extra += [("cuda_core", None, None, s, None) for s in sorted({max(1, auto_cc // 2), auto_cc * 2})]
    rows = []
    for kernel, bn, warps, splits, stages in configs + extra:
        cfg = _kernel_cfg(kernel, block_n=bn, num_warps=warps, num_splits=splits, num_stages=stages)
        try:
            t = time_calls([lambda p=p, cfg=cfg: p.attention(cfg)], args.iters, args.reps)
        except Exception as e:  # out of registers or shared memory for a large tile
            print(f"quant sweep {mode} {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        auto = auto_mma if kernel == "mma" else auto_cc
        rows.append(dict(mode=mode, kernel=kernel, block_n=bn or "auto", warps=warps or "auto",
                         stages=stages or 1, splits=f"{splits}" if splits else f"{auto}*", t=t,
                         speedup=t_bf16 / t))  # fmt: skip
    del p
    torch.cuda.empty_cache()
    return rows


def decode_verdict(rows: list[dict]) -> list[list[str]]:
    """Per mode: the best time of each decode kernel in ``rows`` (quant table or sweep) and the winner."""
    best: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["mode"] == "bf16":
            continue
        times = r["t"] if isinstance(r["t"], dict) else {r["kernel"]: r["t"]}
        for kernel, t in times.items():
            cur = best.setdefault(r["mode"], {})
            cur[kernel] = min(cur.get(kernel, float("inf")), t)
    out = []
    for mode, t in best.items():
        if {"mma", "cuda_core"} <= set(t):
            win = min(t, key=t.get)
            gluon = f"{t['gluon'] * 1e6:.1f}" if "gluon" in t else "-"
            out.append([mode, f"{t['mma'] * 1e6:.1f}", f"{t['cuda_core'] * 1e6:.1f}", gluon, win])
    return out


# -- report ---------------------------------------------------------------------------------------
def command_line(argv: list[str]) -> str:
    """The command that ran, as a reader would type it: ``kvtier ...`` for the console script
    and for ``python -m kvtier.cli`` (whose argv[0] is the module's file), ``python FILE ...``
    for a script such as ``benchmarks/attention.py``."""
    head = argv[0].replace("\\", "/")
    if head.endswith("kvtier/cli.py") or not head.endswith(".py"):
        return shlex.join(["kvtier", *argv[1:]])
    return shlex.join(["python", *argv])


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    from kvtier.kernels.triton_paged import interpreted

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("kvtier bench attention needs a CUDA device (the figures are GPU bandwidths); "
                         "--device cpu runs the kernels under TRITON_INTERPRET=1 at small shapes")
    if args.device == "cpu" and not interpreted():
        raise ValueError("--device cpu needs TRITON_INTERPRET=1 in the environment (the Triton "
                         "interpreter runs the kernels on the CPU): TRITON_INTERPRET=1 kvtier bench "
                         "attention --device cpu")
    for name, value in SHAPES["cpu" if args.device == "cpu" else "cuda"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    gen = torch.Generator(device=args.device).manual_seed(0)
    if args.profile:
        shape, _, mode = args.profile.partition(":")
        mode, _, kernel = mode.partition("@")
        B, L = (int(x) for x in shape.split("x"))
        p = build_paged(mode or "fp", B, L, args, gen)
        for _ in range(3):
            p.attention(_kernel_cfg(kernel) if kernel else None)
        torch.cuda.synchronize()
        return 0
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton interpreter)"
    shape = f"H_q {args.heads}, H_kv {args.kv_heads}, head_dim {args.head_dim}, page {args.page}"
    md = [
        f"# Paged attention on {dev}",
        "",
        f"Date: {datetime.date.today().isoformat()}. Device: {dev}. torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}. Shape: {shape}, bf16.",
        "",
        f"Command: `{command_line(sys.argv)}`",
        "",
    ]

    def emit(title: str, headers: list[str], rows: list[list[str]]) -> None:
        """Print one table at once (a later failure loses nothing) and keep it for --out."""
        t = Table(title=title)
        for h in headers:
            t.add_column(h, justify="right")
        for row in rows:
            t.add_row(*row)
        console.print(t)
        md.extend([f"## {title}", "", _md_table(headers, rows), ""])
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(md))

    def emit_verdict(which: str, rows: list[dict]) -> None:
        from kvtier.kernels.triton_attention import QUANT_DECODE_KERNEL

        emit(
            f"quantised decode: the faster kernel per mode ({which}; "
            f"kvtier.kernels.triton_attention.QUANT_DECODE_KERNEL is {QUANT_DECODE_KERNEL})",
            ["mode", "mma best us", "cuda_core best us", "gluon best us", "faster"],
            decode_verdict(rows),
        )

    if "bf16" not in args.skip:
        r = bench_bf16(args, gen)
        emit(
            "bf16 paged decode vs SDPA on contiguous K/V (TB/s = K+V bytes / time)",
            ["B", "context", "KV MB", "kernel us", "SDPA us", "kernel TB/s", "SDPA TB/s", "kernel/SDPA BW", "max abs diff"],
            [[str(x["B"]), str(x["L"]), f"{x['mb']:.0f}", f"{x['t_kernel'] * 1e6:.1f}", f"{x['t_sdpa'] * 1e6:.1f}",
              f"{x['bw_kernel']:.2f}", f"{x['bw_sdpa']:.2f}", f"{x['ratio']:.0%}", f"{x['max_err']:.1e}"] for x in r],
        )  # fmt: skip
    if "quant" not in args.skip:
        q, w = bench_quant(args, gen)
        emit(
            f"quantised paged decode at B={args.quant_batch} vs our bf16 kernel, both decode kernels "
            "(TB/s of stored bytes, best kernel)",
            ["mode", "context", "stored MB", "mma us", "cuda_core us", "gluon us", "TB/s", "mma vs bf16",
             "cuda_core vs bf16", "gluon vs bf16", "max abs diff"],
            [[x["mode"], str(x["L"]), f"{x['mb']:.0f}", f"{x['t']['mma'] * 1e6:.1f}",
              f"{x['t']['cuda_core'] * 1e6:.1f}" if "cuda_core" in x["t"] else "-",
              f"{x['t']['gluon'] * 1e6:.1f}" if "gluon" in x["t"] else "-",
              f"{x['mb'] / 1e6 / min(x['t'].values()):.2f}", f"{x['t_bf16'] / x['t']['mma']:.2f}x",
              f"{x['t_bf16'] / x['t']['cuda_core']:.2f}x" if "cuda_core" in x["t"] else "-",
              f"{x['t_bf16'] / x['t']['gluon']:.2f}x" if "gluon" in x["t"] else "-",
              f"{x['diff']:.1e}"] for x in q],
        )  # fmt: skip
        emit_verdict("default plans", q)
        if w:
            emit(
                "write kernel (one decode step: B tokens x H_kv heads) vs attention of the same step",
                ["mode", "B", "context", "write us", "attention us", "write / attention"],
                [[x["mode"], str(x["B"]), str(x["L"]), f"{x['t_write'] * 1e6:.1f}", f"{x['t_attn'] * 1e6:.1f}",
                  f"{x['share']:.1%}"] for x in w],
            )  # fmt: skip
    if args.quant_sweep:
        L = max(_ints(args.quant_contexts))
        base = build_paged("fp", args.quant_batch, L, args, gen)
        t_bf16 = time_calls([base.attention], args.iters, args.reps)
        del base
        qs = []
        for mode in args.modes.split(";"):  # one table per mode: a run cut short keeps the modes it did
            rows = bench_quant_sweep(args, gen, mode, t_bf16)
            qs += rows
            emit(
                f"quantised decode configurations, {mode}, at B={args.quant_batch}, context {L} "
                f"(bf16 kernel {t_bf16 * 1e6:.1f} us; * = the plan's split count)",
                ["kernel", "BLOCK_N", "warps", "stages", "splits", "us", "speedup vs bf16"],
                [[x["kernel"], str(x["block_n"]), str(x["warps"]), str(x["stages"]), x["splits"],
                  f"{x['t'] * 1e6:.1f}", f"{x['speedup']:.2f}x"] for x in rows],
            )  # fmt: skip
        emit_verdict("best of the default plans and the sweep", (q if "quant" not in args.skip else []) + qs)
    if args.sweep:
        s = bench_sweep(args, gen)
        s.sort(key=lambda x: (x["B"], x["L"], x["t"]))
        emit(
            "configuration sweep, bf16 decode (fastest first per shape; * = the heuristic's split count)",
            ["B", "context", "BLOCK_N", "warps", "stages", "splits", "us", "TB/s"],
            [[str(x["B"]), str(x["L"]), str(x["block_n"]), str(x["warps"]), str(x["stages"]),
              f"{x['splits']}{'*' if x['auto'] else ''}", f"{x['t'] * 1e6:.1f}", f"{x['bw']:.2f}"] for x in s],
        )  # fmt: skip
    if args.out:
        console.print(f"wrote {args.out}")
    return 0
