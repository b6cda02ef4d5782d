#!/bin/bash
# Session 8 device run (H100): A/B of the session-8 variants (kernels.ab_s8, --write lands winners into
# kernels/configs.py), then the full bench with whatever configs.py now holds, then the GPU tests that run the
# kernels. Usage: bash kernels/device_s8.sh STEP...   (steps: ab, warm, full, tests); logs go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    warm) (timeout 150 python -m kernels.tune_mla --warm-bench --workers 4 > "$OUT/warm.log" 2>&1 &) ;;
    ab) timeout ${AB_TIMEOUT:-170} python -m kernels.ab_s8 --write --workers 10 --compile-budget 90 --out "$OUT" ${AB_KINDS:+--kinds $AB_KINDS} 2>&1 \
          | tee "$OUT/ab.log" | grep -v "^  \[" ; cp kernels/configs.py "$OUT/configs.py" ;;
    full) timeout ${FULL_TIMEOUT:-290} python -m kernels.bench --batches 8,32 --contexts 8192,32768,131072 \
            --mla-heads 16,128 2>&1 | tee "$OUT/bench_full.log" ;;
    tests) timeout ${TESTS_TIMEOUT:-200} python -m pytest tests/test_kernels_gpu.py tests/test_kernels_device_guard.py \
             tests/test_fused_write_gpu.py tests/test_harness_gpu.py \
             --gpu -q -n 8 -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/tests.log" | tail -15 ;;
  esac
done
