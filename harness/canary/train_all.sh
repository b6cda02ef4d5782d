#!/usr/bin/env bash
# Train the three canaries one after another on one GPU and pack each into OUT_DIR/<arch>.tar.gz.
#   harness/canary/train_all.sh OUT_DIR [GQA_SECONDS MLA_SECONDS HYBRID_SECONDS]
# An arch given 0 seconds is skipped (so one lease can train some and a later one the rest).
# Each run times its first steps and fits its step count to its seconds (the model card records the
# count, so `python -m harness.canary.train --steps N` with the card's options reproduces it). A run
# still going at its hard limit gets SIGTERM and saves its weights as they are.
# Runs do not share the GPU: concurrent processes time-slice it (tried: 3x slower per step each).
# Measured on lent H100s (launches cost 15-200 us there; the probe below prints what they cost now):
# compiled steps of ~100k tokens took 65-90 ms (gqa), 82-124 ms (mla), 179 ms (hybrid, which trains
# through harness/canary/delta_rule.py: one graph, no breaks) against 660 ms for the hybrid eager.
# Compiling costs one graph per row width: ~45-90 s for gqa/mla, 308 s for the hybrid with 3 widths,
# all inside the time budget, so short budgets (or --init continuations) want fewer --widths.
# Continuing (--init) starts a fresh AdamW: at lr 2e-3 / warm-up 40 the hybrid's loss went 0.17 -> 6.7 within
# 300 steps and never recovered. lr 1e-3 / warm-up 100 with an arithmetic-heavy --mix took its arithmetic from
# 6% to 93% (harness run) in 2500 steps, and 1300 more at 5e-4 to 95%. The shipped cards list every stage;
# `python -m harness.canary.retrain` repeats them.
# Inductor's cache (TORCHINDUCTOR_CACHE_DIR) cut a repeated hybrid compile from ~260 s to ~20 s on one machine.
set -u
out=${1:?usage: train_all.sh OUT_DIR [GQA_SECONDS MLA_SECONDS HYBRID_SECONDS]}
declare -A budget=([gqa]=${2:-300} [mla]=${3:-300} [hybrid]=${4:-300})
declare -A extra=([gqa]="" [mla]="" [hybrid]="--widths 256,1024")
work=$(mktemp -d)
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
python3 - <<'PY'
import os, time, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(),
      "CUDA_LAUNCH_BLOCKING", os.environ.get("CUDA_LAUNCH_BLOCKING"), "cpus", len(os.sched_getaffinity(0)))
t = time.perf_counter(); sum(range(10**7)); print(f"python sum(1e7) {time.perf_counter() - t:.2f} s")
x = torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(2000): x.add_(1)
torch.cuda.synchronize(); print(f"kernel launch {1e6 * (time.perf_counter() - t) / 2000:.0f} us")
t = time.perf_counter()
for _ in range(200): x.add_(1); torch.cuda.synchronize()
print(f"launch + sync {1e6 * (time.perf_counter() - t) / 200:.0f} us")
PY
nvidia-smi --query-gpu=name,mig.mode.current,utilization.gpu,clocks.sm --format=csv 2>&1 | tail -2
for arch in gqa mla hybrid; do
  [ "${budget[$arch]}" = 0 ] && continue
  timeout -k 15 $((budget[$arch] + 60)) python3 -m harness.canary.train --arch "$arch" --steps 100000 \
    --time-budget "${budget[$arch]}" --seed 0 --out "$work/$arch" --device cuda --short-batch 192 --long-batch 24 \
    --eval-history gold --compile --data-workers 6 ${extra[$arch]} >"$out/train-$arch.log" 2>&1
  echo "$arch exit $? at ${SECONDS}s"
  [ -d "$work/$arch" ] && tar -C "$work" -czf "$out/$arch.tar.gz" "$arch"
  grep -h "accuracy\|ms/step\|SIGTERM\|Error" "$out/train-$arch.log" | tail -4
done
ls -la "$out"
