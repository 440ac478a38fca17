#!/usr/bin/env bash
set -u
mkdir -p $OUT/w
export PYTHONPATH=$PWD/src:$PWD/benchmarks
S=$OUT/w/summary.txt
t() { local n=$1 l=$2; shift 2; local t0=$(date +%s); timeout -k 5 $l "$@" > $OUT/w/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s" >> $S; }
t sweep 90 python3 benchmarks/tools/split_sweep.py --defaults-only --out $OUT/w --name pdl
t decode1 120 python3 -m kvtier.cli bench decode_gpu --skip-hf --skip-big --skip-compile --out $OUT/w/decode_gpu.md
t kernels_all 230 python3 -m pytest -q -rfE -p no:cacheprovider -n 8 tests/kernels/test_triton_paged.py tests/kernels/test_triton_ragged.py tests/kernels/test_triton_decode_quant.py tests/kernels/test_reference.py tests/kernels/test_paged_kernels.py tests/quant/test_fp8.py tests/caches/test_paged_quant.py
cd $OUT && tar czf res.tgz w
