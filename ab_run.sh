#!/usr/bin/env bash
set -u
mkdir -p $OUT/w
export PYTHONPATH=$PWD/src:$PWD/benchmarks
S=$OUT/w/summary.txt
t() { local n=$1 l=$2; shift 2; local t0=$(date +%s); timeout -k 5 $l "$@" > $OUT/w/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s" >> $S; }
t kernels_all 220 python3 -m pytest -q -rfE -p no:cacheprovider -n 8 tests/kernels/test_triton_paged.py tests/kernels/test_triton_ragged.py tests/kernels/test_triton_decode_quant.py tests/kernels/test_triton_gemv.py tests/kernels/test_triton_fused.py
t gpu_tiers 150 python3 -m pytest -q -rfE -p no:cacheprovider -n 8 -m gpu tests/model tests/test_cuda_graph.py tests/serve tests/caches tests/quant tests/integrations/test_hf.py --ignore=tests/serve/test_api.py
t decode1 150 python3 -m kvtier.cli bench decode_gpu --skip-hf --skip-big --skip-compile --out $OUT/w/decode_gpu.md
cd $OUT && tar czf res.tgz w
