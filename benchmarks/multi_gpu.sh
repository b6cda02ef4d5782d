#!/bin/bash
# Issue 42's measurements on one host of several GPUs, one step a device call (each under its own timeout; a lent
# machine takes 10 minutes a command): bash benchmarks/multi_gpu.sh STEP... ; logs go to $OUT (default: .).
#   tests    every multigpu-marked test (data-parallel, layer-sharded and tensor-parallel records, Ray actors per GPU)
#   dp       `harness run` on cuda:0 against cuda:all, the default set and one 8x larger (benchmarks/data_parallel.py)
#   rows     data-parallel decode rows, 1 and N GPUs, 8B-shaped, --new 32 and 64 (benchmarks/scale_bench.py --gpus N)
#   sharded  the 70B-shaped model layer-sharded over N GPUs: plain generate b8, one at a time, batched b8
#   sharded-graph  its batched b8 rows alone (graph decode, one graph per GPU a step), 128 tokens, two rounds
#   tp       the gqa canary's default set on one GPU and tensor-parallel over two (whole process), and the TP=2 noise
#            floor of the three canaries (benchmarks/tp_compare.py)
#   ray      the default set through Ray actors, one per GPU, against the local per-GPU pool (data_parallel.py)
# GPUS (default: every GPU torch sees) sets N. The done-when bars are in issue 42; BENCHMARKS.md keeps the tables.
set -o pipefail
export PYTHONUNBUFFERED=1 TIMEFORMAT="wall %R s"
OUT=${OUT:-.}
GPUS=${GPUS:-$(python -c "import torch; print(torch.cuda.device_count())")}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
for step in "$@"; do
  echo "=== $step $(date -u +%T), $GPUS GPUs"
  case $step in
    # the files that hold multigpu tests only (the endpoint tests' modules skip on the lent machines, which lack
    # the '[test]' extra's starlette and openai; collecting them there would only import them)
    tests) timeout 500 python -m pytest $(grep -l "mark.multigpu" tests/test_*.py) -m multigpu --gpu -q \
             -p no:cacheprovider 2>&1 | tee "$OUT/multigpu_tests.log" | tail -15 ;;
    dp) timeout 560 python benchmarks/data_parallel.py --devices cuda:0 cuda:all --sets 1 8 2>&1 | tee "$OUT/dp.log" ;;
    rows) for new in 32 64; do
            timeout 270 python benchmarks/scale_bench.py --configs "" --gpus "$GPUS" --new $new 2>&1 \
              | tee "$OUT/rows_$new.log" | grep "^|"
          done ;;
    sharded) timeout 560 python benchmarks/scale_bench.py --configs "" --gpus "$GPUS" --no-data-parallel --sharded 70b --new 32 2>&1 \
               | tee "$OUT/sharded.log" | grep "^|\|built" ;;
    # the batched rows alone, 128 tokens (each batch captures its graphs: 32 tokens leave that in the step), two rounds
    sharded-graph) timeout 300 python benchmarks/scale_bench.py --configs "" --gpus "$GPUS" --no-data-parallel \
                     --sharded 70b --sharded-batched-only --rounds 2 --new 128 2>&1 | tee "$OUT/sharded_graph.log" \
                     | grep "^|" ;;
    tp) for spec in "--device cuda:0" "--device cuda:0,1 --shard tensor"; do
          echo "--- gqa default set, $spec"
          ( time timeout 250 python -m harness.cli run --models gqa $spec --out "$(mktemp -d)/run" --no-progress \
              > "$OUT/tp_run.log" 2>&1; echo "rc $?" ) 2>&1
          grep -a "run complete" "$OUT/tp_run.log"
        done
        timeout 200 python benchmarks/tp_compare.py --device cuda:0,1 harness/canary/weights/{gqa,mla,hybrid} 2>&1 \
          | tee "$OUT/tp_compare.log" | tail -20 ;;
    ray) timeout 560 python benchmarks/data_parallel.py --devices cuda:all --sets 1 8 --executor ray 2>&1 \
           | tee "$OUT/ray.log" ;;
    *) echo "unknown step $step (tests, dp, rows, sharded, sharded-graph, tp, ray)"; exit 2 ;;
  esac
done
