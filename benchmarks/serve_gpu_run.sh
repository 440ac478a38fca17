#!/usr/bin/env bash
# The serving engine on one H200: its GPU tests, then `kvtier bench serve` on the issue's
# workload (Llama-3-8B shape, bf16, random weights; 256 requests, prompts 64-1024 tokens,
# 256 new tokens each, EOS ignored), kvtier alone and then side by side with transformers'
# generate_batch; then kvtier alone again with presence, frequency and repetition penalties on
# every request (their cost a step), with 40 bad words on every request, and, where xgrammar
# imports and TOKENIZER names a folder with tokenizer.json, with every answer held to a pattern
# through a grammar matcher (structured outputs' cost a step), and as tool_choice "auto" answers
# (free text until a call's trigger). Uses the machine's
# python3 with src/ and benchmarks/ on PYTHONPATH (the engine needs no FastAPI). Files under $OUT:
# env.txt, gpu_tests.log, serve_kvtier.{log,json}, serve_h200.{log,json,png},
# serve_penalties.{log,json}, serve_bans.{log,json}, serve_structured.{log,json},
# serve_tools.{log,json}, summary.txt.
#
#   OUT=/path/to/results bash benchmarks/serve_gpu_run.sh
set -u
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

step() {  # step NAME SECONDS LOG COMMAND...
    local name=$1 limit=$2 log=$3 t0 rc
    shift 3
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    printf '%-14s rc %-4s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$*" >>"$SUMMARY"
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} >"$OUT/env.txt" 2>&1

PARALLEL=()
"$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n 8)
# the HTTP tests (a real server and the official client) run on the CPU where these are missing
"$PY" -c "import openai, fastapi, httpx, prometheus_client" 2>/dev/null || for f in tests/serve/test_api*.py \
    tests/serve/test_server_process.py; do PARALLEL+=(--ignore="$f"); done
step tests "${TEST_LIMIT:-150}" "$OUT/gpu_tests.log" "$PY" -m pytest -m gpu -q -rfE -p no:cacheprovider \
    "${PARALLEL[@]}" tests/serve tests/caches tests/test_cuda_graph.py tests/kernels/test_dispatch.py
WORKLOAD=(--device cuda --num-requests "${REQUESTS:-256}" --input-len 64,1024 --output-len 256
          --max-num-seqs 256)
step kvtier "${KVTIER_LIMIT:-150}" "$OUT/serve_kvtier.log" "$PY" -m kvtier.cli bench serve "${WORKLOAD[@]}" \
    --skip-hf --json "$OUT/serve_kvtier.json"
step side_by_side "${HF_LIMIT:-270}" "$OUT/serve_h200.log" "$PY" -m kvtier.cli bench serve "${WORKLOAD[@]}" \
    --json "$OUT/serve_h200.json" --plot "$OUT/serve_h200.png"
step penalties "${KVTIER_LIMIT:-150}" "$OUT/serve_penalties.log" "$PY" -m kvtier.cli bench serve "${WORKLOAD[@]}" \
    --skip-hf --penalties --json "$OUT/serve_penalties.json"
step bans "${KVTIER_LIMIT:-150}" "$OUT/serve_bans.log" "$PY" -m kvtier.cli bench serve "${WORKLOAD[@]}" \
    --skip-hf --bans --json "$OUT/serve_bans.json"
if [ -n "${TOKENIZER:-}" ] && "$PY" -c "import xgrammar" 2>/dev/null; then
    step structured "${KVTIER_LIMIT:-150}" "$OUT/serve_structured.log" "$PY" -m kvtier.cli bench serve \
        "${WORKLOAD[@]}" --skip-hf --structured --tokenizer "$TOKENIZER" --json "$OUT/serve_structured.json"
    step tools "${KVTIER_LIMIT:-150}" "$OUT/serve_tools.log" "$PY" -m kvtier.cli bench serve \
        "${WORKLOAD[@]}" --skip-hf --structured tools --tokenizer "$TOKENIZER" --json "$OUT/serve_tools.json"
fi
cat "$SUMMARY"
tail -n 3 "$OUT/gpu_tests.log"
