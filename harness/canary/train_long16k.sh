#!/usr/bin/env bash
# One device call: continue the long-context stress canary, then measure it with the harness.
#   harness/canary/train_long16k.sh OUT_DIR [TRAIN_SECONDS [CALL_SECONDS]]
# 1. `harness.canary.train --init` the shipped stress/gqa-long16k for TRAIN_SECONDS of training (its time budget
#    times steps 10-40 and fits the step count, so the card records a count `retrain` can repeat); needles
#    only at 10000-16000 filler characters (the short ones were learnt by the stages before), 16 of them a
#    step in rows of 16128 tokens, the short dialogues in rows of 448 and 1088 (the stage before put recall
#    chats over 448 characters in 16128-token rows: 10 of its 18 long rows were padding). Every 200 steps the
#    log gives held-out recall at 16000 characters (50 needles); at the end the card's table (100 a task).
# 2. `harness run --device cuda` on the new weights: scenarios/canary/stress in bf16 (the number of record),
#    scenarios/canary/default.yaml in bf16 (the short tasks and short needles still answered),
#    then scenarios/canary/stress with FP8 paths (error growing with context).
# Run at commit f8b1a35 it made the shipped stage 2; run again it adds a stage on top of the shipped weights.
# Each step has its own timeout, so a slow one still leaves the others' files; everything lands in OUT_DIR
# as a few tarballs and logs (the device returns at most 8 files).
set -u
out=${1:?usage: train_long16k.sh OUT_DIR [TRAIN_SECONDS [CALL_SECONDS]]}
budget=${2:-290}
deadline=${3:-525}  # seconds from the start by which everything must have ended (the device call's limit)
work=/tmp/long16k
model=$work/gqa-long16k  # the folder name is the run's model label
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv 2>&1 | tail -2
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started )) s] $*"; }

stamp "train"
timeout -s TERM $(( budget + 110 )) python3 -m harness.canary.train --arch gqa --seed 6 --out "$model" \
  --init harness/canary/weights/stress/gqa-long16k --device cuda --steps 3000 --time-budget "$budget" \
  --lr 0.0005 --warmup 50 --short-batch 96 --long-batch 16 --needle-chars 16000 --needle-min-chars 10000 \
  --widths 448,1088 --data-workers 8 --eval-per-kind 100 --eval-history gold --eval-every 200 \
  --eval-every-kinds long_context --log-every 25 2>&1 | grep -v "Loading weights\|Writing model" | tee "$out/train.log"
tar czf "$out/gqa-long16k.tgz" -C "$work" gqa-long16k && stamp "weights packed"

run() {  # name seconds harness-run-args...; cut to what is left before the deadline
  local name=$1 seconds=$2 left; shift 2
  left=$(( deadline - 10 - $(date +%s) + started ))
  (( left < seconds )) && seconds=$left
  (( seconds < 20 )) && { stamp "no time left for $name"; return; }
  stamp "harness run $name (at most $seconds s)"
  timeout -s TERM "$seconds" python3 -m harness.cli run --device cuda --model "$model" --out "$work/$name" \
    --no-progress --no-fail-on-verdict "$@" > "$work/$name.log" 2>&1
  stamp "exit $? ($name)"; tail -n 25 "$work/$name.log"
  cp "$work/$name.log" "$out/"
  [ -d "$work/$name" ] && tar czf "$out/$name.tgz" -C "$work" "$name"
}
run stress-bf16 80 --scenarios scenarios/canary/stress --paths bf16
run default-bf16 50 --scenarios scenarios/canary/default.yaml --paths bf16
run stress-fp8 150 --scenarios scenarios/canary/stress --paths bf16,fp8_e4m3,fp8_e4m3:calibrated,fp8_e5m2
stamp "done"
grep "ms/step\|held-out accuracy\|rows per step" "$out/train.log"
