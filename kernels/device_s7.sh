#!/bin/bash
# Session 7 device run (H100): sweep the widened-fp8 variants with graph timing, then GPU tests and tables.
# Usage: bash kernels/device_s7.sh STEP...   (steps: tune, tests, quick, full, gqa); logs go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    tune) timeout 250 python -m kernels.tune_mla --kinds mla_fp8,mla_fp8_many_heads,mla_bf16,mla_bf16_many_heads \
            --workers 14 --job-timeout 160 --out "$OUT" --write 2>&1 | tee "$OUT/tune_mla.log" | grep -v "^  \[" ;;
    gqa) timeout 110 python -m kernels.tune --kinds gqa_fp8 --quick 2>&1 | tee "$OUT/tune_gqa.log" ;;
    mlatests) timeout 200 python -m pytest tests/test_kernels_gpu.py --gpu -q -p no:cacheprovider -k "${MLA_K:-mla}" 2>&1 | tee "$OUT/mlatests.log" | tail -8 ;;
    tests) timeout ${TESTS_TIMEOUT:-300} python -m pytest tests/test_kernels_gpu.py tests/test_kernels_device_guard.py --gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    quick) timeout 150 python -m kernels.bench --quick 2>&1 | tee "$OUT/bench_quick.log" ;;
    ab) timeout 200 python - <<'PY' 2>&1 | tee "$OUT/ab.log"
import torch
from kernels.tune import _timer
base = dict(prefetch=False, tma=True, swap=False, num_stages=5)
h64 = dict(base, block_n=32, num_warps=8, block_h=64)
cands = {"fp8 widen h64 32/8/5": ("mla_fp8_many_heads", dict(h64, widen=True)),
         "fp8 split widen h64 32/8/5": ("mla_fp8_many_heads", dict(h64, widen=True, split_latent=True)),
         "bf16 h64 32/8/5": ("mla_bf16_many_heads", h64)}
for batch in (8, 32):
    timers = {kind: _timer(kind, batch, 32768, 128) for kind in ("mla_fp8_many_heads", "mla_bf16_many_heads")}
    for rnd in (1, 2):
        for label, (kind, cfg) in cands.items():
            print(f"round {rnd} batch {batch} 32k 128 heads {label}: " + "  ".join(
                f"pps {pps}: {timers[kind](cfg, pps):.4f}" for pps in (1, 2, 4)), flush=True)
    timers = None
    torch.cuda.empty_cache()
PY
    ;;
    host) timeout 120 python -m kernels.host_cost 2>&1 | tee "$OUT/host_cost.log" | grep -v "^ *$" | cut -c1-150 ;;
    mla) timeout ${MLA_TIMEOUT:-400} python -m kernels.bench --no-gqa --batches 8,32 --contexts 8192,32768,131072 --mla-heads ${MLA_HEADS:-16,128} 2>&1 | tee "$OUT/bench_mla.log" ;;
    full) timeout 500 python -m kernels.bench --batches 8,32 --contexts 8192,32768,131072 --mla-heads 16,128 2>&1 | tee "$OUT/bench_full.log" ;;
  esac
done
cp kernels/configs.py "$OUT/configs.py" 2>/dev/null
