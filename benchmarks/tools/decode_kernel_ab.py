"""The decode kernels side by side: the MMA kernel and the pipelined Gluon kernel
(:mod:`kvtier.kernels.gluon_decode`) over bf16, q8, q4, fp8, q4_g32 and TurboQuant pages (and
TurboQuant's CUDA-core kernel), at the defaults
and other tiles, warps a program and split counts, on the shapes of issue 15 and a serving step.

    PYTHONPATH=src:benchmarks python3 benchmarks/tools/decode_kernel_ab.py [--out DIR] [--modes fp,tq]
        [--shapes 64x8192,serve] [--plans "default,gluon 32 w1"]

Times: medians of CUDA-graph replays over replicas beyond 4x the L2
(``kvtier_bench.attention.time_calls``); the last column is the largest difference from the
MMA kernel's output. ``--device cpu`` is a smoke run of the MMA rows under
``TRITON_INTERPRET=1`` (Gluon kernels run on GPUs only).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from kvtier_bench.attention import TQ

#: capped plans by page kind: (keys a tile, warps, programs a wave, registers a thread)
CAPPED = {"q8": [(64, 4, 5, 96)], "fp8": [(64, 4, 5, 100)], "q4": [(32, 1, 10, 200), (32, 1, 11, 184)],
          "q4_g32": [(32, 1, 10, 204), (32, 1, 11, 184), (32, 1, 12, 168)], TQ: [(16, 1, 13, 152), (16, 1, 14, 144)]}


#: the Gluon kernel's page kind (:data:`kvtier.kernels.gluon_decode.KINDS`) of each mode
KIND = {"fp": "fp", "q8": "q8", "q4": "q4", "fp8": "fp8", "q4_g32": "q4_g32", TQ: "tq"}


def around_default(mode: str, rows: int, L: int, device: str) -> dict:
    """Plans around the default launch of ``rows`` rows of ``L`` keys (32/8 heads, head_dim 128):
    twice and half its splits, a ring of three stages, and its splits under the register cap at
    which two more programs fit a multiprocessor (the split count fixed, the cap alone changes the
    launch: how many programs a multiprocessor holds follows from the registers)."""
    from kvtier.kernels import gluon_plan
    from kvtier.kernels.launch_plan import LaunchConfig

    p = gluon_plan.plan(KIND[mode], rows, 32, 8, 128, L, torch.device(device), LaunchConfig())
    more = p.launch.resident + 2
    cap = 65536 // (more * 32 * p.warps) // 8 * 8

    def gluon(**kw):
        return LaunchConfig(decode_kernel="gluon", **kw)

    print(f"# {mode}, {rows} rows of {L} keys: the default launch {p.splits} splits of {p.split_len} keys, "
          f"{p.launch.resident} programs a multiprocessor; '+2 programs': {more} at {cap} registers", flush=True)
    out = {"splits x2": ({}, gluon(num_splits=2 * p.splits)), "ring 3": ({}, gluon(num_stages=3)),
           "+2 programs": (dict(MAXNREG=cap), gluon(num_splits=p.splits))}
    if p.splits > 1:
        out["splits /2"] = ({}, gluon(num_splits=p.splits // 2))
    return out


def plans(mode: str, B, cuda: bool, L: int = 0) -> dict:
    """``{name: (knobs, config)}``: the MMA kernel, the default and Gluon plans (``L``: the rows'
    keys, for the plans around the default's); ``knobs`` set module attributes of
    :mod:`kvtier.kernels.gluon_decode` for the plan's launches."""
    from kvtier.kernels.launch_plan import LaunchConfig

    def gluon(bn=64, splits=None, stages=None, **knobs):
        return knobs, LaunchConfig(decode_kernel="gluon", block_n=bn, num_splits=splits, num_stages=stages)

    out = {"mma": ({}, LaunchConfig(decode_kernel="mma")), "default": ({}, None)}
    if mode == TQ:  # its kernel before the Gluon kernel took it
        out["cuda_core"] = ({}, LaunchConfig(decode_kernel="cuda_core"))
    if not cuda:
        return out
    out |= around_default(mode, 256 if B == "serve" else B, L, "cuda")
    # each tile's scores an iteration ahead (gluon_decode.AHEAD, a third stage; no default takes it),
    # at the default plan, with four stages, and for the kinds whose registers grow past their
    # programs' share: uncapped in waves of eight (q4_g32, TurboQuant) or capped at four programs'
    # 128 (q8, fp8)
    ahead = dict(AHEAD=True)
    out |= {"ahead": (ahead, None), "ahead ns4": (ahead, LaunchConfig(decode_kernel="gluon", num_stages=4))}
    # codes as they lie (subnormal fp16 operands), the dots scaled back (gluon_plan.programs' raw), or not
    out |= {"raw": (dict(RAW=True), None), "not raw": (dict(RAW=False), None),
            "raw r8": (dict(RAW=True, RESIDENT=8, MAXNREG=255), None)}
    if mode in ("q4", "q4_g32"):  # the kernel of swapped roles (gluon_decode.SWAP, kvtier.kernels.gluon_swap;
        # TurboQuant's default): keys and channels down the dots' rows, 128-129 registers a thread; in waves of
        # eight or twelve, or capped at 128 in waves of sixteen
        out |= {"swap": (dict(SWAP=True), None), "swap r12": (dict(SWAP=True, RESIDENT=12), None),
                "swap c128 r16": (dict(SWAP=True, RESIDENT=16, MAXNREG=128), None)}
    if mode in ("q4_g32", TQ):
        out["ahead r8"] = (dict(AHEAD=True, RESIDENT=8, MAXNREG=255), None)
    if mode in ("q8", "fp8"):
        out["ahead c128"] = (dict(AHEAD=True, MAXNREG=128), None)
    # warps a program (the default by page kind: gluon_plan.TILING): one warp holds the whole
    # tile's softmax and accumulator, no barrier across warps in the loop, at 180-218 registers a
    # thread (eight programs an SM: RESIDENT)
    w1 = dict(WARPS=1, RESIDENT=8)
    out |= {"gluon 32 w4": gluon(32, WARPS=4, RESIDENT=4), "gluon 32 w1": gluon(32, **w1),
            "gluon 16 w1": gluon(16, WARPS=1, RESIDENT=12)}
    if mode == "fp":
        return out
    if mode == TQ:  # 16-key tiles on the swapped kernel (the default: 128 registers, waves of sixteen) in
        # waves of eight, uncapped (164), and at 168 in waves of twelve; the decode kernel's (168, twelve)
        out["gluon 16 w1 r8"] = gluon(16, WARPS=1, RESIDENT=8)
        out["gluon 16 w1 r8 uncapped"] = gluon(16, WARPS=1, RESIDENT=8, MAXNREG=255)
        out |= {"swap c168 r12": (dict(MAXNREG=168, RESIDENT=12), None), "not swap": (dict(SWAP=False), None)}
    out |= {"gluon 64 w4": gluon(64, WARPS=4, RESIDENT=4), "gluon 32 w1 ns3": gluon(32, stages=3, **w1)}
    # two warps a program: at most 167 registers a thread for q4 and q4_g32 at 64 keys (six programs
    # an SM), 4% more of q4_g32's instructions a key than one warp's 32-key tile at 244 (eight)
    w2 = dict(WARPS=2, RESIDENT=6)
    out |= {"gluon 32 w2": gluon(32, **w2), "gluon 64 w2": gluon(64, **w2)}
    if mode in ("q4", "q4_g32"):  # 64-key tiles on one warp: 254 and 219 registers (sm_90, Triton 3.9 offline),
        # 7-8% fewer instructions a key than the 32-key tile
        out |= {"gluon 64 w1": gluon(64, **w1), "gluon 64 w1 r9": gluon(64, WARPS=1, RESIDENT=9)}
    if mode == TQ:  # 178 and 201 registers a thread: five and four programs an SM
        out |= {"gluon 32 w2 r5": gluon(32, WARPS=2, RESIDENT=5), "gluon 64 w2 r4": gluon(64, WARPS=2, RESIDENT=4)}
    # the default tiles under a register cap, for more programs a multiprocessor (on the H200,
    # Triton 3.6: no spills but TurboQuant's 4-8 bytes, and all slower at B=64 / 8k;
    # benchmarks/RESULTS.md 2026-12-04)
    for bn, w, r, cap in CAPPED.get(mode, []):
        out[f"gluon {bn} w{w} r{r} c{cap}"] = gluon(bn, WARPS=w, RESIDENT=r, MAXNREG=cap)
    if B != "serve" and B >= 8:
        out |= {f"gluon 32 w1 s{s}": gluon(32, splits=s, **w1) for s in (8, 16)}
    return out


def parse_shapes(text: str) -> list[tuple] | None:
    """``"64x8192,serve"`` as ``[(64, 8192), ("serve", 1280)]``; ``None`` where an item is neither."""
    out = []
    for item in text.split(","):
        b, _, l_ = item.strip().partition("x")
        if item.strip() == "serve":
            out.append(("serve", 1280))
        elif b.isdigit() and l_.isdigit() and int(b) > 0 and int(l_) > 0:
            out.append((int(b), int(l_)))
        else:
            return None
    return out


def summary(results: list[dict]) -> list[str]:
    """A table of each shape and page kind: the default plan's time and the fastest plan's, each
    as a ratio to the 16-bit pages' default time of that shape (where the run has them)."""
    times: dict[tuple, dict[str, float]] = {}
    for r in results:
        times.setdefault((r["shape"], r["pages"]), {})[r["plan"]] = r["us"]
    out = ["", "| shape | pages | default us | vs bf16 | fastest plan | us | vs bf16 |", "|---|---|---|---|---|---|---|"]
    for (shape, pages), t in times.items():
        base = times.get((shape, "fp"), {}).get("default")
        best = min(t, key=t.get)

        def ratio(us, base=base):
            return f"{base / us:.2f}x" if base else "-"

        d = t.get("default")  # (a run of other plans only has none)
        default = f"{d:.2f} | {ratio(d)}" if d else "- | -"
        out.append(f"| {shape} | {pages} | {default} | {best} | {t[best]:.2f} | {ratio(t[best])} |")
    return out


def main() -> None:
    from kvtier.kernels import gluon_decode
    from kvtier.kernels.launch_plan import LaunchConfig
    from kvtier_bench.attention import build_paged, copies_for, page_modes, time_calls, write_report

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    p.add_argument("--modes", default="fp,q8,q4,fp8,q4_g32,tq",
                   help="page kinds, comma-separated (tq: TurboQuant's 8-bit keys and 3-bit values)")
    p.add_argument("--shapes", default="64x8192,8x16384,8x4096,1x4096,1x16384,32x4096,serve",
                   help="BxL, comma-separated; serve: a serving step (256 rows of 64-1,280 keys); "
                        "the CPU smoke run takes 2x64")
    p.add_argument("--plans", default=None,
                   help="only these plans, comma-separated by name (default, mma, gluon 32 w1, ...); all by default")
    args = p.parse_args()
    only = None if args.plans is None else {n.strip() for n in args.plans.split(",")}
    wanted = parse_shapes(args.shapes)
    if wanted is None:
        p.error(f"--shapes takes BxL items (or serve), comma-separated, such as 64x8192,serve; got {args.shapes!r}")
    dev = args.device
    cuda = dev == "cuda"
    shape = SimpleNamespace(kv_heads=8, heads=32, head_dim=128, page=16, device=dev)
    if not cuda:
        shape = SimpleNamespace(kv_heads=2, heads=8, head_dim=64, page=16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = wanted
    if not cuda:
        shapes = [(2, 64)]
    name = torch.cuda.get_device_name() if cuda else dev
    lines = [f"{time.strftime('%Y-%m-%d %H:%M')} {name}, torch {torch.__version__}, "
             f"{shape.heads}/{shape.kv_heads} heads, head_dim {shape.head_dim}, pages of 16",
             "", "| shape | pages | plan | us | max diff vs mma |", "|---|---|---|---|---|"]
    results = []
    for B, L in shapes:
        serve = B == "serve"
        rows = 256 if serve else B
        gen_lens = torch.Generator().manual_seed(0)
        lens = torch.randint(64, L + 1, (rows,), generator=gen_lens).sort(descending=True).values if serve else torch.full((rows,), L)
        label = "serving step" if serve else f"B={B} / {L}"
        for mode in page_modes(args.modes):
            base = build_paged(mode, rows, L, shape, gen)
            n = copies_for(int(lens.sum()) * (base.nbytes // (rows * L))) if cuda else 1
            reps = [base] + [build_paged(mode, rows, L, shape, gen) for _ in range(n - 1)]
            for r in reps:
                r.set_lengths(lens.to(dev))
            ref = base.attention(LaunchConfig(decode_kernel="mma")).float()
            for plan, (knobs, cfg) in plans(mode, B, cuda, L).items():
                if only is not None and plan not in only:
                    continue
                saved = {k: getattr(gluon_decode, k) for k in knobs}
                for k, v in knobs.items():
                    setattr(gluon_decode, k, v)
                try:
                    t = time_calls([lambda r=r, cfg=cfg: r.attention(cfg) for r in reps], 20, 10)
                    diff = (base.attention(cfg).float() - ref).abs().max().item()
                finally:
                    for k, v in saved.items():
                        setattr(gluon_decode, k, v)
                results.append(dict(shape=label, pages=mode, plan=plan, us=t * 1e6, max_diff=diff))
                lines.append(f"| {label} | {mode} | {plan} | {t * 1e6:.2f} | {diff:.1e} |")
                print(lines[-1], flush=True)
            del reps, base
            if cuda:
                torch.cuda.empty_cache()
    lines += summary(results)
    if cuda:  # what each compiled variant of the Gluon kernel holds: registers, spills, shared memory
        lines += ["", "| Gluon kernel variant | registers | spills | shared bytes |", "|---|---|---|---|"]
        for cache in getattr(gluon_decode._decode_kernel, "device_caches", {}).values():
            for key, k in cache[0].items():
                lines.append(f"| {variant(key, k)} | {getattr(k, 'n_regs', '?')} | {getattr(k, 'n_spills', '?')} | "
                             f"{k.metadata.shared} |")
    write_report(args.out, "decode_kernel_ab", lines, results)


def variant(key, kernel) -> str:
    """A compiled variant by its compile-time arguments' names and values and its warps (the
    specialisation key's tail where the compiled kernel does not carry its source)."""
    src = getattr(kernel, "src", None)
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    constants = getattr(src, "constants", None)
    if not names or not isinstance(constants, dict):
        return str(key)[-160:]
    parts = [f"{names[i[0]]}={v}" for i, v in constants.items()
             if isinstance(i, tuple) and len(i) == 1 and i[0] < len(names) and not isinstance(v, (type(None), str))]
    return ", ".join(parts + [f"{getattr(kernel.metadata, 'num_warps', '?')} warps"])


if __name__ == "__main__":
    main()
