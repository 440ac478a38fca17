#!/usr/bin/env bash
# Decode attention on the GPU in one batch: the kernels' GPU tests, then every figure of
# issue 15 side by side (bf16 paged decode against SDPA, quantised and fp8 pages against our
# bf16 kernel at B >= 8 and contexts >= 4k, a few launch plans of each).
#
#   OUT=/path/to/results bash benchmarks/perf_gpu_run.sh [tests|bench|profile|all]   # repository root
#
# Uses the machine's python3 (torch, triton, pytest, rich) with src/ and benchmarks/ on
# PYTHONPATH, so nothing is installed; every step has a time limit (about 7 minutes in all).
# PERF_SWEEP=1 adds split counts at B=1 and the MMA kernel's tiles at B=64 / 8k.
# Files under $OUT: env.txt, tests.log, perf.md (the tables), perf.json, bench.log, ncu.txt
# (Nsight Compute sections of the bf16 and q8 kernels at B=64 / 8k), summary.txt.
set -u
OUT=${OUT:?set OUT to the folder the results go to}
WHAT=${1:-all}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
START=$(date +%s)

step() {  # step NAME SECONDS LOG COMMAND...
    local name=$1 limit=$2 log=$3 t0 rc
    shift 3
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" >>"$log"
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    printf '%-10s rc %-4s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$*" >>"$SUMMARY"
}

{
    date -u '+%Y-%m-%d %H:%M UTC'
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    git rev-parse HEAD 2>/dev/null || echo "no git metadata here"
} >"$OUT/env.txt" 2>&1

if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
    PARALLEL=()
    "$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n 8)
    step tests 130 "$OUT/tests.log" "$PY" -m pytest -m gpu -q -rfE -p no:cacheprovider "${PARALLEL[@]}" \
        tests/kernels/test_triton_paged.py tests/kernels/test_triton_packed.py tests/kernels/test_triton_decode_quant.py \
        tests/kernels/test_triton_ragged.py tests/quant/test_fp8.py
fi

if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
    step bench 270 "$OUT/bench.log" "$PY" - "$OUT" <<'EOF'
import json, os, sys, time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kvtier_bench.attention import build_paged, copies_for, time_calls
from kvtier.kernels.paged import paged_attention_reference
from kvtier.kernels.triton_attention import LaunchConfig

out_dir = sys.argv[1]
args = SimpleNamespace(kv_heads=8, heads=32, head_dim=128, page=16, device="cuda")
gen = torch.Generator(device="cuda").manual_seed(0)
ITERS, REPS = 20, 10
SWEEP = os.environ.get("PERF_SWEEP") == "1"  # also a few split counts and MMA tiles
MODES = ["q8", "fp8", "q4", "q4_g32", "turboquant:q8_0,q3_0"]
md, js = [f"Date: {time.strftime('%Y-%m-%d')}. {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}. H_q 32, H_kv 8, head_dim 128, page 16, bf16 queries.", ""], {}


def table(title, headers, rows):
    md.extend([f"## {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)])
    md.extend("| " + " | ".join(map(str, r)) + " |" for r in rows)
    md.append("")
    with open(f"{out_dir}/perf.md", "w") as f:
        f.write("\n".join(md))
    with open(f"{out_dir}/perf.json", "w") as f:
        json.dump(js, f, indent=1)
    print("\n".join(md[-len(rows) - 4:]), flush=True)


def pages(mode, B, L):
    p = build_paged(mode, B, L, args, gen)
    return [p] + [build_paged(mode, B, L, args, gen) for _ in range(copies_for(p.nbytes) - 1)]


def timed(ps, cfg=None):
    return time_calls([lambda p=p: p.attention(cfg) for p in ps], ITERS, REPS)


def max_err(p, cfg=None):
    kw = dict(k_codec=p.kc, v_codec=p.vc, k_sidecars=p.ks, v_sidecars=p.vs)
    ref = paged_attention_reference(p.q, p.kp, p.vp, p.table, p.kv_len - 1, p.kv_len, **kw)
    return (p.attention(cfg).float() - ref.float()).abs().max().item()


# 1. bf16 paged decode against SDPA on contiguous K/V, default plan, and split counts at small B
rows, sweep = [], []
for B in (1, 8, 32, 64):
    for L in (4096, 16384, 32768):
        k = torch.randn(B, 8, L, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        nbytes = 2 * k.numel() * 2
        n = copies_for(nbytes)
        ps = [build_paged("fp", B, L, args, gen, k, v)] + [build_paged("fp", B, L, args, gen) for _ in range(n - 1)]
        q = ps[0].q
        kvs = [(k, v)] + [(k.clone(), v.clone()) for _ in range(n - 1)]
        t_s = time_calls([lambda k=kk, v=vv: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                          for kk, vv in kvs], ITERS, REPS)
        t_k = timed(ps)
        err = (ps[0].attention().float() - F.scaled_dot_product_attention(q, k, v, enable_gqa=True).float()).abs().max().item()
        rows.append([B, L, f"{nbytes / 1e6:.0f}", f"{t_k * 1e6:.1f}", f"{t_s * 1e6:.1f}", f"{nbytes / t_k / 1e12:.2f}",
                     f"{nbytes / t_s / 1e12:.2f}", f"{t_s / t_k:.0%}", f"{err:.1e}"])
        js.setdefault("bf16", []).append(dict(B=B, L=L, t_kernel=t_k, t_sdpa=t_s, err=err))
        if SWEEP and B == 1 and L == 4096:
            for splits in (32, 64, 128):
                for stages in (2, 3):
                    cfg = LaunchConfig(num_splits=splits, num_stages=stages)
                    t = timed(ps, cfg)
                    sweep.append([B, L, splits, stages, f"{t * 1e6:.1f}", f"{t_s / t:.0%}"])
                    js.setdefault("bf16_sweep", []).append(dict(B=B, L=L, splits=splits, stages=stages, t=t, t_sdpa=t_s))
        del ps, kvs, k, v
        torch.cuda.empty_cache()
table("bf16 paged decode vs SDPA (default plan)",
      ["B", "context", "KV MB", "kernel us", "SDPA us", "kernel TB/s", "SDPA TB/s", "kernel/SDPA", "max abs diff"], rows)
if sweep:
    table("bf16 split counts at small B (block_n 64, 4 warps)", ["B", "context", "splits", "stages", "us", "of SDPA"], sweep)

# 2. quantised and fp8 pages against our bf16 kernel, default plans, and the MMA kernel's tiles
rows, sweep = [], []
for B, L in ((8, 4096), (8, 16384), (64, 8192), (64, 16384)):
    base = pages("fp", B, L)
    t_bf16 = timed(base)
    rows.append(["bf16", B, L, f"{base[0].nbytes / 1e6:.0f}", f"{t_bf16 * 1e6:.1f}", "", "1.00x", "0"])
    del base
    torch.cuda.empty_cache()
    for mode in MODES:
        ps = pages(mode, B, L)
        t = timed(ps)
        err = max_err(ps[0])
        extra = ""
        if mode.startswith("turbo"):
            t_mma = timed(ps, LaunchConfig(decode_kernel="mma"))
            extra = f"mma {t_mma * 1e6:.1f}"
        rows.append([mode, B, L, f"{ps[0].nbytes / 1e6:.0f}", f"{t * 1e6:.1f}", extra, f"{t_bf16 / t:.2f}x", f"{err:.1e}"])
        js.setdefault("quant", []).append(dict(mode=mode, B=B, L=L, t=t, t_bf16=t_bf16, err=err, extra=extra))
        if SWEEP and (B, L) == (64, 8192) and mode in ("q8", "fp8", "q4", "q4_g32"):
            for bn, warps, stages in ((128, 4, 3), (128, 4, 1), (256, 4, 2), (128, 2, 2)):
                cfg = LaunchConfig(block_n=bn, num_warps=warps, num_stages=stages)
                try:
                    tc = timed(ps, cfg)
                except Exception as e:  # out of shared memory or registers
                    print(mode, cfg, type(e).__name__, str(e)[:100])
                    continue
                sweep.append([mode, bn, warps, stages, f"{tc * 1e6:.1f}", f"{t_bf16 / tc:.2f}x"])
                js.setdefault("quant_sweep", []).append(dict(mode=mode, bn=bn, warps=warps, stages=stages, t=tc, t_bf16=t_bf16))
        del ps
        torch.cuda.empty_cache()
table("quantised decode vs our bf16 kernel (default plans; time of the default kernel)",
      ["mode", "B", "context", "stored MB", "us", "other kernel us", "vs bf16", "max abs diff vs reference"], rows)
if sweep:
    table("MMA kernel tiles at B=64, context 8192 (default: 128 keys, 4 warps, 2 stages)",
          ["mode", "BLOCK_N", "warps", "stages", "us", "vs bf16"], sweep)
EOF
fi

if [ "$WHAT" = all ] || [ "$WHAT" = profile ]; then
    for mode in fp q8; do
        step "ncu-$mode" 60 "$OUT/ncu.txt" ncu --clock-control none -k regex:_attention_kernel -c 1 \
            --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
            --section MemoryWorkloadAnalysis --section LaunchStats \
            "$PY" -m kvtier.cli bench attention --profile "64x8192:$mode@mma"
    done
fi

echo "total $(($(date +%s) - START))s" >>"$SUMMARY"
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -n 3 >>"$SUMMARY"
cat "$SUMMARY"
