"""The Gluon decode kernel (:mod:`kvtier.kernels.gluon_decode`) compiled for a GPU without one:
registers, spills, shared memory and the main loop's size in the GPU's assembly, per page kind.

    PYTHONPATH=src python3 benchmarks/tools/gluon_offline.py [--kinds fp,q8,q4,fp8,q4_g32,tq]
        [--head-dims 64,128] [--arch 90] [--tile 32,1] [--maxnreg 184] [--sass DIR] [--swap on|off] [--json]

Each kind is compiled at its default launch (``gluon_plan.TILING``'s keys a tile and warps,
the plan's register cap, ``MAXNREG_BY_KIND``'s or ``SWAPPED``'s) unless ``--tile`` and ``--maxnreg`` name others, for
compute capability ``--arch`` (90: H100/H200, 80: A100), with 32 query heads on 8 kv heads,
pages of 16 and bf16 queries, the strides specialised as a cache's are (multiples of 16), and
q4_g32's heads stacked by group of channels where they fill the rows (head_dim 128, as
launches of 32 pairs or more run; ``gluon_plan.programs``; raw codes where it plans them), uncapped. It
needs Triton's NVIDIA backend and its bundled ``ptxas``, ``cuobjdump`` and ``nvdisasm``, not a
GPU or a driver; where those are missing it says why and exits with status 3. The loop is the
basic block of the assembly with the most tensor-core instructions; ``stack`` is the bytes a
thread spills. ``--sass DIR`` keeps each variant's assembly. A kind that does not compile is
listed with its error, and the exit status is 1. ``tests/kernels/test_gluon_compile.py`` runs
it on the CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

#: pointer types of (keys, values, scales) by page kind; the kernel's other pointers take one type
POINTERS = {"fp": ("*bf16", "*bf16", "*bf16"), "q8": ("*i8", "*i8", "*fp32"), "q4": ("*u8", "*u8", "*fp32"),
            "fp8": ("*u8", "*u8", "*fp32"), "q4_g32": ("*u8", "*u8", "*fp16"), "tq": ("*u8", "*i32", "*fp16")}
OTHER_POINTERS = {"Q": "*bf16", "BT": "*i32", "KVLEN": "*i32", "QSTART": "*i32", "OUT": "*bf16", "PO": "*fp32",
                  "PL": "*fp32"}


def signature(fn, kind: str) -> dict[str, str]:
    """The types of ``fn``'s (``_decode_kernel``'s) arguments, in order, for pages of ``kind``:
    its pointers by name, ``qk_scale`` fp32, the other values int32 and its constexprs
    ``constexpr``."""
    k, v, s = POINTERS[kind]
    pointers = OTHER_POINTERS | {"K": k, "V": v, "KS": s, "VS": s, "KZ": s, "VZ": s}
    return {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "fp32" if p.name == "qk_scale" else "i32")
            for p in fn.params}


def prerequisites() -> str | None:
    """What this machine lacks to compile offline (``None``: nothing): Triton with Gluon and a
    compile source for it, and the NVIDIA backend's tools."""
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401

        from kvtier.kernels import gluon_decode
    except ImportError as e:
        return f"this Triton cannot compile Gluon without a GPU ({e})"
    if not gluon_decode.HAVE_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    absent = [t for t in ("ptxas", "cuobjdump", "nvdisasm") if not os.path.exists(_tool(t))]
    return f"Triton's NVIDIA backend lacks {', '.join(absent)}" if absent else None


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_variant(kind: str, head_dim: int = 128, *, block_n: int | None = None, warps: int | None = None,
                    maxnreg: int | None = None, arch: int = 90, sass_dir: str | None = None,
                    ahead: bool | None = None, swap: bool | None = None) -> dict:
    """Compile one variant; ``{"kind", "head_dim", "block_n", "warps", "maxnreg", "arch", "swap",
    "registers", "stack", "shared", "instructions", "loop", "loop_ops"}`` (``loop``: the
    instructions of the main loop; ``loop_ops``: how many of each opcode, with its modifiers, such
    as ``LDS.U16``). ``swap``: on the kernel of swapped roles (:mod:`kvtier.kernels.gluon_swap`)
    where it takes the kind (True), never (False), or as the launch plan has it (``None``:
    TurboQuant's default launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvtier.kernels import gluon_decode as gd
    from kvtier.kernels import gluon_plan

    tile, w, _ = gluon_plan.TILING[kind]
    block_n, warps = block_n or tile, warps or w
    ahead = bool(gd.AHEAD) if ahead is None else ahead
    # (gluon_decode.RAW, set for a sweep, wins over the plan's raw codes)
    plan = gluon_plan.programs(kind, 4, head_dim, 512, block_n, None if warps == w else warps, False if ahead else swap,
                               gd.RAW)  # fmt: skip
    if swap and not plan.swap:
        raise ValueError(f"the swapped kernel does not take {kind} at {warps} warps (raw={plan.raw}, ahead={ahead})")
    if maxnreg is None and (block_n, warps) == (tile, w):
        maxnreg = plan.maxnreg
    raw, swap = plan.raw, plan.swap
    fn = gd.gluon_swap.kernel(kind) if swap else gd._decode_kernel
    sig = signature(fn, kind)
    const = dict(G=4, D=head_dim, BLOCK_N=block_n, PAGE=16, NS=3 if ahead else 2, SPLIT=True, KIND=gd.KINDS[kind],
                 CAUSAL=False, LIKE=True, W=warps, STACK=True, AHEAD=ahead, RAW=raw)
    names = list(sig)
    # a cache's pointers and strides are multiples of 16 (Triton specialises on it), but the
    # grouped scales' head stride (head_dim / 32 of them)
    aligned = [i for i, n in enumerate(names) if sig[n].startswith("*")
               or (n.startswith("stride") and n not in ("stride_ksh", "stride_vsh"))]
    src = GluonASTSource(fn, sig, const, {(i,): [["tt.divisibility", 16]] for i in aligned})
    opts = {"num_warps": warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        name = f"{kind}_d{head_dim}_{block_n}x{warps}{'_ahead' if ahead else ''}{'_swap' if swap else ''}_sm{arch}.sass"
        with open(os.path.join(sass_dir, name), "w") as f:
            f.write(sass)
    field = {m[0]: int(m[1]) for m in re.findall(r"(REG|STACK):(\d+)", usage)}
    line = re.compile(r"^\s+/\*[0-9a-f]{4}\*/", re.M)
    blocks = re.split(r"\n(?=\.L_x_\d+:)", sass)
    loop = max(blocks, key=lambda b: b.count("HMMA") + b.count("IMMA"))
    return {"kind": kind, "head_dim": head_dim, "block_n": block_n, "warps": warps, "maxnreg": maxnreg, "ahead": ahead,
            "swap": swap,
            "arch": arch, "registers": field.get("REG"), "stack": field.get("STACK"), "shared": k.metadata.shared,
            "instructions": len(line.findall(sass)), "loop": len(line.findall(loop)),
            "loop_ops": dict(collections.Counter(re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)",
                                                            loop, re.M)))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="fp,q8,q4,fp8,q4_g32,tq", help="page kinds, comma-separated")
    p.add_argument("--head-dims", default="128", help="comma-separated: 64, 128")
    p.add_argument("--arch", type=int, default=90, help="compute capability as one number: 90, 80, 89")
    p.add_argument("--tile", default=None, help="keys a tile and warps a program, such as 32,1 (default: TILING's)")
    p.add_argument("--maxnreg", type=int, default=None, help="a register cap (default: the plan's, gluon_plan.MAXNREG_BY_KIND or SWAPPED)")
    p.add_argument("--sass", default=None, help="a folder for each variant's assembly")
    p.add_argument("--ahead", choices=("default", "on", "off"), default="default",
                   help="score each tile one iteration ahead (default: gluon_decode.AHEAD, off)")
    p.add_argument("--swap", choices=("default", "on", "off"), default="default",
                   help="the kernel of swapped roles (kvtier.kernels.gluon_swap) where it takes the kind (on: q4, q4_g32, "
                        "TurboQuant), never (off), or as the launch plan has it (default: TurboQuant's)")
    p.add_argument("--json", action="store_true", help="one JSON list, the last line on stdout, instead of a table")
    a = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # (Triton's interpreter compiles nothing; read at its import)
    missing = prerequisites()
    if missing:
        print(f"cannot compile here: {missing}", file=sys.stderr)
        return 3
    from kvtier.kernels import gluon_decode as gd

    kinds = [k.strip() for k in a.kinds.split(",")]
    unknown = [k for k in kinds if k not in gd.KINDS]
    if unknown:
        p.error(f"--kinds takes {', '.join(gd.KINDS)}; got {', '.join(unknown)}")
    bn, w = (int(x) for x in a.tile.split(",")) if a.tile else (None, None)
    rows, failed = [], False
    for kind in kinds:
        for d in (int(x) for x in a.head_dims.split(",")):
            try:
                ahead = None if a.ahead == "default" else a.ahead == "on"
                rows.append(compile_variant(kind, d, block_n=bn, warps=w, maxnreg=a.maxnreg, arch=a.arch,
                                            sass_dir=a.sass, ahead=ahead,
                                            swap=None if a.swap == "default" else (a.swap == "on" and kind in ("q4", "q4_g32", "tq"))))
            except Exception as e:  # a variant that does not compile is a result here
                failed = True
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""]
                # its first line and the assembler's first error, else its last line
                why = next((ln for ln in lines[1:] if "error" in ln and ":" in ln), lines[-1])
                what = " ... ".join(dict.fromkeys([lines[0], why]))[:400]
                rows.append({"kind": kind, "head_dim": d, "arch": a.arch, "error": f"{type(e).__name__}: {what}"})
    if a.json:
        print(json.dumps(rows))
    else:
        print(f"sm_{a.arch} | kind | head_dim | keys a tile x warps | ahead | cap | registers | stack | shared | "
              "loop / all")
        for r in rows:
            if "error" in r:
                print(f"{r['kind']} | {r['head_dim']} | did not compile: {r['error']}")
            else:
                print(f"{r['kind']}{' (swap)' if r['swap'] else ''} | {r['head_dim']} | {r['block_n']} x {r['warps']} | {'yes' if r['ahead'] else 'no'} | "
                      f"{r['maxnreg'] or '-'} | "
                      f"{r['registers']} | {r['stack']} | {r['shared']} | {r['loop']} / {r['instructions']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
