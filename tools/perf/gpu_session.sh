#!/usr/bin/env bash
# One session on a lent GPU, every figure the GPU half of the performance work needs, in one script:
#   1. make gpu-check (numerics, quick bench, a 3-task ViT-B/16 run, bf16 against fp32, learn/predict, NCCL);
#   2. the predict and train sections of the bench on CUDA (predict_vs_limit, train_step_overhead);
#   3. GPU memory against the number of tasks: the long-stream harness on CUDA, ViT-S/16 at 224 px;
#   4. a paper preset end to end (imagenet-r's settings, its first PRESET_TASKS tasks of 20 classes at
#      224 px, generated images): seconds per task and phase, peak GPU memory per task.
# Every result goes under OUT (default runs/gpu-session). Each step has its own time limit so that one slow
# step cannot eat the others' time; a step that fails is reported and the next one runs. STEPS names the
# steps to run (default: all four, about 14 minutes at their limits; drop some to fit the device time left).
#
#   bash tools/perf/gpu_session.sh                 # on the GPU machine, from the repository root
#   STEPS="bench preset" bash tools/perf/gpu_session.sh
#   DEVICE=cpu TASKS=3 bash tools/perf/gpu_session.sh   # a dry run of the plumbing on a CPU
set -u
OUT=${OUT:-runs/gpu-session}
DEVICE=${DEVICE:-cuda}
TASKS=${TASKS:-100}
PRESET_TASKS=${PRESET_TASKS:-2}
STEPS=${STEPS:-gpu-check bench long preset}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s (log: $OUT/$name.log)" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log"
}
: >"$OUT/summary.txt"
if [ "$DEVICE" = cuda ]; then
  step gpu-check 240 "$PY" tools/gpu_check.py --out "$OUT/gpu-check.json"
  step bench 180 "$PY" tools/perf/run.py --device cuda --only predict,train --out "$OUT/bench.json"
  step long 240 "$PY" tools/perf/perf_long.py --device cuda --backbone vit_s16 --img 224 --tasks "$TASKS" \
    --out "$OUT/long"
  step preset 200 "$PY" tools/perf/preset_run.py --preset imagenet-r --tasks "$PRESET_TASKS" --per-class 60 \
    --device cuda --timeout 190 --out "$OUT/preset"
else
  step gpu-check 600 "$PY" tools/gpu_check.py --device cpu --out "$OUT/gpu-check.json"
  step bench 600 "$PY" tools/perf/run.py --device cpu --tiny --only predict,train --out "$OUT/bench.json"
  step long 600 "$PY" tools/perf/perf_long.py --device cpu --tasks "$TASKS" --out "$OUT/long"
  step preset 600 "$PY" tools/perf/preset_run.py --preset imagenet-r --tasks "$PRESET_TASKS" --per-class 3 \
    --img 32 --device cpu --out "$OUT/preset"
fi
cat "$OUT/summary.txt"
