#!/bin/bash
# Device run (H100): bash kernels/device.sh STEP...; logs go to $OUT. Steps:
#   ab     python -m kernels.ab --write (kernels/ab.py's candidates; a winner lands in kernels/configs.py)
#   warm   compile the bench's MLA rows in the background (python -m kernels.tune_mla --warm-bench)
#   tune   the MLA launch sweep (python -m kernels.tune_mla --write)
#   full   python -m kernels.bench --batches 8,32 --contexts 8192,32768,131072 --mla-heads 16,128
#   host   python -m kernels.host_cost
#   tests  the GPU tests that run the kernels (TESTS_K: a -k filter)
# kernels/configs.py as it stands at the end is copied to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    warm) (timeout 150 python -m kernels.tune_mla --warm-bench --workers 4 > "$OUT/warm.log" 2>&1 &) ;;
    ab) timeout ${AB_TIMEOUT:-170} python -m kernels.ab --write --workers 10 --compile-budget 90 --out "$OUT" ${AB_KINDS:+--kinds $AB_KINDS} 2>&1 \
          | tee "$OUT/ab.log" | grep -v "^  \[" ;;
    tune) timeout ${TUNE_TIMEOUT:-250} python -m kernels.tune_mla --kinds ${TUNE_KINDS:-mla_fp8,mla_fp8_many_heads} \
            --workers 14 --job-timeout 160 --out "$OUT" --write 2>&1 | tee "$OUT/tune_mla.log" | grep -v "^  \[" ;;
    full) timeout ${FULL_TIMEOUT:-290} python -m kernels.bench --batches 8,32 --contexts 8192,32768,131072 \
            --mla-heads 16,128 2>&1 | tee "$OUT/bench_full.log" ;;
    host) timeout 120 python -m kernels.host_cost 2>&1 | tee "$OUT/host_cost.log" | grep -v "^ *$" | cut -c1-150 ;;
    tests) timeout ${TESTS_TIMEOUT:-200} python -m pytest tests/test_kernels_gpu.py tests/test_kernels_device_guard.py \
             tests/test_fused_write_gpu.py tests/test_harness_gpu.py \
             --gpu -q -n 8 -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/tests.log" | tail -15 ;;
  esac
done
cp kernels/configs.py "$OUT/configs.py" 2>/dev/null
