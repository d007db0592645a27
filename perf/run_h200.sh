#!/usr/bin/env bash
# One H200 session end to end: build the base demo checkpoint and 1,024 rank-16 adapters on
# the GPU host (never committed), then the in-process engine benchmark (ENGINE=0 skips it; the
# adapters are still made) and the server benchmark (tritonserver + perf_analyzer): for each
# design in DESIGNS, base and lora over ADAPTERS adapters (uniform and Zipf), closed loop at
# CONCURRENCY, open loop at OPEN_FRACTIONS of each mode's saturation, light load (concurrency 1),
# with GPU busy share and host CPU per request per stage. Results land in $OUT (default
# perf/results): engine.jsonl, server.jsonl (one row per phase), server.txt (the log and table).
#
#   source .gpu-bundle/activate.sh; ENGINE=0 bash perf/run_h200.sh
#     one design: 3 modes x (warm-up + 3 closed + 2 open loads) + 2 light loads, 3 windows of 4 s
#     each: ~4.5 min of measurement (bench_server prints its estimate) + server start + setup
#   the A/B of both designs in one call (~2 x 2.2 min of measurement + two server starts):
#   ENGINE=0 DESIGNS="single pipeline" SERVER_DISTRIBUTIONS=uniform INTERVAL_MS=3000 CONCURRENCY="256 1024" \
#     SERVER_TIMEOUT=500 bash perf/run_h200.sh
#
# Knobs (environment):
#   engine: ENGINE (0 = skip), ENGINE_MODES, IN_FLIGHT, DISTRIBUTIONS, ENGINE_BATCHES, ROUNDS,
#     INTERLEAVE=1 (engine cases batch by batch), HOTSWAP_SECONDS, STAGE_TIMEOUT
#   server: DESIGNS ("pipeline", "single" or "single pipeline": one server each, in order),
#     FRONT_INSTANCES, FRONT_INFLIGHT, CORE_INSTANCES, FRONT_MAX_BATCH, CORE_MAX_BATCH (pipeline), INSTANCES
#     (single design's GPU instances per GPU, default 4), GPUS, CPU_THREADS, SERVER_MODES
#     ("base lora base lora": rounds), SERVER_DISTRIBUTIONS, CONCURRENCY, OPEN_FRACTIONS,
#     LIGHT (0 = no light load), INTERVAL_MS, SERVER_TIMEOUT (bench_server skips the phases
#     that would end less than 30 s before it, so that its table still prints)
#   both: ADAPTERS, MODELS, OUT
# The settings of the fifth session's tables (that session ran the two benchmarks directly,
# with the commands README.md gives; the single design, closed loop only):
#   ENGINE_MODES="base manylora" ROUNDS=3 INTERLEAVE=1 DESIGNS=single SERVER_MODES="base lora base lora" \
#     SERVER_DISTRIBUTIONS=uniform OPEN_FRACTIONS= LIGHT=0 CONCURRENCY=512 INTERVAL_MS=4000 bash perf/run_h200.sh
set -uo pipefail  # stages are independent: one failing still lets the next report
OUT=${OUT:-perf/results}
MODELS=${MODELS:-/tmp/manylora-models}
ADAPTERS=${ADAPTERS:-1024}
mkdir -p "$OUT" "$MODELS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TRITONSERVER=${TRITONSERVER:-$(command -v tritonserver || true)}  # the GPU bundle / NGC image
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; echo "cpus: $(nproc)"; } | tee "$OUT/machine.txt"

STAGE_TIMEOUT=${STAGE_TIMEOUT:-420}
[ -d "$MODELS/demo-base" ] || /usr/bin/time -f "demo-base built in %e s" python3 -m manylora.demo --size base --out "$MODELS/demo-base"
if [ "${ENGINE:-1}" != 0 ]; then
  timeout "$STAGE_TIMEOUT" python3 perf/bench_engine.py --modes ${ENGINE_MODES:-base manylora hotswap peft-mixed} --checkpoint "$MODELS/demo-base" --adapters "$MODELS/bench-adapters" \
    --make-adapters "$ADAPTERS" --adapters-in-flight ${IN_FLIGHT:-1 8 32 128 $ADAPTERS} --distributions ${DISTRIBUTIONS:-uniform zipf} \
    --batch 256 --batches ${ENGINE_BATCHES:-4} --warmup 2 --rounds ${ROUNDS:-1} ${INTERLEAVE:+--interleave} --hotswap-at "$ADAPTERS" --gpu-slots "$ADAPTERS" --host-slots "$ADAPTERS" \
    --hotswap-seconds ${HOTSWAP_SECONDS:-15} --out "$OUT/engine.jsonl"
else  # no engine benchmark: only its --make-adapters (no modes), reusing adapters already made
  /usr/bin/time -f "adapters made in %e s" python3 perf/bench_engine.py --checkpoint "$MODELS/demo-base" \
    --adapters "$MODELS/bench-adapters" --make-adapters "$ADAPTERS" --modes --out /dev/null
fi

SERVER_TIMEOUT=${SERVER_TIMEOUT:-480}
timeout "$SERVER_TIMEOUT" python3 perf/bench_server.py --checkpoint "$MODELS/demo-base" --adapters "$MODELS/bench-adapters" \
  --design ${DESIGNS:-pipeline} ${FRONT_INSTANCES:+--front-instances $FRONT_INSTANCES} ${CORE_INSTANCES:+--core-instances $CORE_INSTANCES} \
  ${FRONT_MAX_BATCH:+--front-max-batch $FRONT_MAX_BATCH} ${CORE_MAX_BATCH:+--core-max-batch $CORE_MAX_BATCH} \
  ${FRONT_INFLIGHT:+--front-inflight $FRONT_INFLIGHT} \
  --instances ${INSTANCES:-4} ${GPUS:+--gpus $GPUS} --gpu-slots "$ADAPTERS" --host-slots "$ADAPTERS" --cpu-threads ${CPU_THREADS:-auto} \
  --modes ${SERVER_MODES:-base lora} --distributions ${SERVER_DISTRIBUTIONS:-uniform zipf} \
  --concurrency ${CONCURRENCY:-256 512 1024} --open-fractions ${OPEN_FRACTIONS-0.35 0.7} $([ "${LIGHT:-1}" = 0 ] || echo --light-load) \
  --requests 1024 --interval-ms ${INTERVAL_MS:-4000} --max-trials 3 --warmup-ms ${WARMUP_MS:-4000} \
  --time-budget-s $(( SERVER_TIMEOUT - 30 )) --out "$OUT/server.jsonl" 2>&1 | tee -a "$OUT/server.txt"
