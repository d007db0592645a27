#!/usr/bin/env bash
# Where a GPU session's first minutes go: build the base demo checkpoint and 1,024 rank-16
# adapters on the GPU host, time engine start-up with all of them preloaded (cProfile of the
# constructor), profile one batch with and without adapters, and run the kernel and store
# tests on the real GPU, then the per-linear LoRA benchmark (LINEAR_SWEEP=1: with its config
# sweep). Results land in $OUT (default perf/results).
#
#   source .gpu-bundle/activate.sh; bash perf/run_probe.sh
set -uo pipefail  # stages are independent: one failing still lets the next report
OUT=${OUT:-perf/results}
MODELS=${MODELS:-/tmp/manylora-models}
ADAPTERS=${ADAPTERS:-1024}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-200}
mkdir -p "$OUT" "$MODELS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
[ -d "$MODELS/demo-base" ] || /usr/bin/time -f "demo-base built in %e s" python3 -m manylora.demo --size base --out "$MODELS/demo-base"
[ -d "$MODELS/bench-adapters" ] || /usr/bin/time -f "adapters made in %e s" python3 perf/bench_engine.py \
  --checkpoint "$MODELS/demo-base" --adapters "$MODELS/bench-adapters" --make-adapters "$ADAPTERS" --modes --out /dev/null
timeout "$STAGE_TIMEOUT" python3 perf/profile_engine.py --checkpoint "$MODELS/demo-base" --adapters "$MODELS/bench-adapters" \
  --adapters-in-flight "$ADAPTERS" --out "$OUT/profile" 2>&1 | tee "$OUT/profile-lora.txt" | grep -v "^ " | head -120
if [ -z "${SKIP_BASE:-}" ]; then
  timeout "$STAGE_TIMEOUT" python3 perf/profile_engine.py --checkpoint "$MODELS/demo-base" --out "$OUT/profile" \
    > "$OUT/profile-base.txt" 2>&1
  grep -E "^base|forward ms" "$OUT/profile-base.txt"
fi
[ -n "${SKIP_TESTS:-}" ] || timeout "$STAGE_TIMEOUT" python3 -m pytest -q -x tests/kernels tests/lora/test_store.py 2>&1 | tail -5
# one linear per encoder shape: cuBLAS, the update after / written first
[ -n "${SKIP_LINEAR:-}" ] || timeout "$STAGE_TIMEOUT" python3 perf/bench_lora_linear.py ${LINEAR_SWEEP:+--sweep} \
  --out "$OUT/lora-linear.jsonl" 2>&1 | grep -v Warn | tail -30
