#!/usr/bin/env bash
# Tensor parallelism on two GPUs of one host (2 x H200), in one go of about 6 minutes:
#
#   OUT=/path/to/results bash benchmarks/tp_gpu_run.sh        # from the repository root
#   TINY=1 OUT=/tmp/tp bash benchmarks/tp_gpu_run.sh          # the same steps on the CPU (gloo)
#
# Uses the machine's python3 (torch, triton) with src/ and benchmarks/ on PYTHONPATH, so
# nothing is installed. Each step has a time limit and the script goes on past a failure.
# Files under $OUT:
#   env.txt        devices, driver, versions, NCCL settings
#   tp_8b.md/.json Llama-3-8B shape: greedy tokens on 2 GPUs against 1 GPU (float32 and
#                  bfloat16, paged tier, CUDA graph capturing the all-reduces), and decode at
#                  batch 64 / 8k context on 1 GPU and on 2 (eager and CUDA graph)
#   tp_70b.md/.json 70B shape (80 layers, dim 8192, 64 heads, 8 KV heads, hidden 28672), random
#                  bf16 shards built on each GPU (the 141 GB of weights never exist whole), decode
#                  at batch 32 / 8k context on 2 GPUs (weights + KV: 211 GiB, one H200 has 140)
#   refusals.log   more ranks than GPUs (KV heads that do not divide, with TINY): rc 2, a clear error
#   bench.log      everything the steps printed
#   summary.txt    one line per step: outcome, seconds, command
set -u
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (it can take a shared host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
TP=(-m kvtier.cli bench tensor_parallel --world-size 2)
SMALL=()
if [ -n "${TINY:-}" ]; then  # a dry run of the same steps on the CPU
    SMALL=(--tiny)
fi

step() {  # step NAME SECONDS LOG COMMAND...
    local name=$1 limit=$2 log=$3
    shift 3
    local t0 rc what
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" >>"$log"
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
        0) what="ok" ;;
        124 | 137) what="timed out" ;;
        *) what="failed (rc $rc)" ;;
    esac
    printf '%-10s %-16s %4ss  %s\n' "$name" "$what" "$(($(date +%s) - t0))" "$*" >>"$SUMMARY"
}

{
    date -u '+%Y-%m-%d %H:%M UTC'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    nvidia-smi topo -m 2>&1
    env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)_' | sort
    "$PY" - <<'EOF'
import torch, torch.distributed as dist
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None,
      "nccl available", dist.is_nccl_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton absent")
EOF
    git rev-parse HEAD 2>/dev/null || echo "no git metadata here"
} >"$OUT/env.txt" 2>&1

# (a) Llama-3-8B shape: tokens against one GPU, then throughput at batch 64 / 8k
step tp-8b 300 "$OUT/bench.log" "$PY" "${TP[@]}" --arch llama3-8b --check-tokens 32 \
    --big-batch 64 --big-context 8192 --big-steps 32 --out "$OUT/tp_8b.md" "${SMALL[@]}"

# (b) 70B shape, shards built on each GPU, batch 32 / 8k
step tp-70b 200 "$OUT/bench.log" "$PY" "${TP[@]}" --arch llama3-70b --shard-init \
    --big-batch 32 --big-context 8192 --big-steps 16 --out "$OUT/tp_70b.md" "${SMALL[@]}"

# (c) refusals, expected to fail with rc 2 and a message naming the fix: more ranks than GPUs
# (checked before any process starts); on the CPU also the default model's 3 KV heads over 2
# ranks (the default model's wheel is not on the GPU machine)
if [ -z "${TINY:-}" ]; then
    step refuse-gpus 60 "$OUT/refusals.log" "$PY" -m kvtier.cli generate "Hi" --raw \
        --max-tokens 2 --tensor-parallel 3 --device cuda
else
    step refuse-kv 120 "$OUT/refusals.log" "$PY" -m kvtier.cli generate "Hi" --raw \
        --max-tokens 2 --tensor-parallel 2 --device cpu
fi

cat "$SUMMARY"
