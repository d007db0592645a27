#!/usr/bin/env bash
# One H200 session end to end: build the base demo checkpoint and 1,024 rank-16 adapters on
# the GPU host (never committed), then the in-process engine benchmark and the server
# benchmark (tritonserver + perf_analyzer). Results land in $OUT (default perf/results).
#
#   source .gpu-bundle/activate.sh; bash perf/run_h200.sh
#
# Knobs (environment): ENGINE_MODES, IN_FLIGHT, DISTRIBUTIONS, ENGINE_BATCHES, ROUNDS,
# INTERLEAVE=1 (engine cases batch by batch), SERVER_MODES ("base lora base lora": rounds),
# INSTANCES, GPUS, CPU_THREADS, CONCURRENCY, INTERVAL_MS, STAGE_TIMEOUT, ADAPTERS, MODELS, OUT.
# The settings of the fifth session's tables (that session ran the two benchmarks directly,
# with the commands README.md gives):
#   ENGINE_MODES="base manylora" ROUNDS=3 INTERLEAVE=1 SERVER_MODES="base lora base lora" \
#     CONCURRENCY=512 INTERVAL_MS=4000 bash perf/run_h200.sh
set -uo pipefail  # stages are independent: one failing still lets the next report
OUT=${OUT:-perf/results}
MODELS=${MODELS:-/tmp/manylora-models}
ADAPTERS=${ADAPTERS:-1024}
mkdir -p "$OUT" "$MODELS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TRITONSERVER=${TRITONSERVER:-$(command -v tritonserver || true)}  # the GPU bundle / NGC image
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"

STAGE_TIMEOUT=${STAGE_TIMEOUT:-420}
[ -d "$MODELS/demo-base" ] || /usr/bin/time -f "demo-base built in %e s" python3 -m manylora.demo --size base --out "$MODELS/demo-base"
timeout "$STAGE_TIMEOUT" python3 perf/bench_engine.py --modes ${ENGINE_MODES:-base manylora hotswap peft-mixed} --checkpoint "$MODELS/demo-base" --adapters "$MODELS/bench-adapters" \
  --make-adapters "$ADAPTERS" --adapters-in-flight ${IN_FLIGHT:-1 8 32 128 $ADAPTERS} --distributions ${DISTRIBUTIONS:-uniform zipf} \
  --batch 256 --batches ${ENGINE_BATCHES:-4} --warmup 2 --rounds ${ROUNDS:-1} ${INTERLEAVE:+--interleave} --hotswap-at "$ADAPTERS" --gpu-slots "$ADAPTERS" --host-slots "$ADAPTERS" \
  --hotswap-seconds ${HOTSWAP_SECONDS:-15} --out "$OUT/engine.jsonl"
timeout "$STAGE_TIMEOUT" python3 perf/bench_server.py --checkpoint "$MODELS/demo-base" --adapters "$MODELS/bench-adapters" \
  --instances ${INSTANCES:-4} ${GPUS:+--gpus $GPUS} --gpu-slots "$ADAPTERS" --host-slots "$ADAPTERS" --modes ${SERVER_MODES:-base lora} \
  --cpu-threads ${CPU_THREADS:-auto} --concurrency ${CONCURRENCY:-256 512} --requests 1024 --interval-ms ${INTERVAL_MS:-5000} --out "$OUT/server.jsonl"
