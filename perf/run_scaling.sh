#!/usr/bin/env bash
# One GPU against two, on one two-GPU host, in one session (issue #8): the base demo
# checkpoint and 1,024 rank-16 adapters are built on the GPU host, then a short engine
# comparison (no LoRA / ManyLoRA / PEFT hot-swap at 1,024 adapters), then the server
# benchmark (tritonserver + perf_analyzer) with INSTANCES per GPU on GPU 0, then on GPUs 0
# and 1 at twice the concurrency. Results land in $OUT (default perf/results).
#
#   source .gpu-bundle/activate.sh; bash perf/run_scaling.sh
set -uo pipefail  # stages are independent: one failing still lets the next report
OUT=${OUT:-perf/results}
MODELS=${MODELS:-/tmp/manylora-models}
ADAPTERS=${ADAPTERS:-1024}
INSTANCES=${INSTANCES:-4}
CONCURRENCY=${CONCURRENCY:-256}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-240}
mkdir -p "$OUT" "$MODELS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TRITONSERVER=${TRITONSERVER:-$(command -v tritonserver || true)}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
/usr/bin/time -f "demo-base built in %e s" python3 -m manylora.demo --size base --out "$MODELS/demo-base"
/usr/bin/time -f "adapters made in %e s" python3 perf/bench_engine.py --checkpoint "$MODELS/demo-base" \
  --adapters "$MODELS/bench-adapters" --make-adapters "$ADAPTERS" --modes --out /dev/null
if [ -z "${SKIP_ENGINE:-}" ]; then
  timeout "$STAGE_TIMEOUT" python3 perf/bench_engine.py --checkpoint "$MODELS/demo-base" --adapters "$MODELS/bench-adapters" \
    --adapters-in-flight "$ADAPTERS" --distributions uniform --batch 256 --batches 3 --warmup 1 \
    --gpu-slots "$ADAPTERS" --host-slots "$ADAPTERS" --hotswap-seconds 10 --out "$OUT/engine.jsonl"
fi
for gpus in 0 0,1; do
  n=$(( $(tr -cd , <<<"$gpus" | wc -c) + 1 ))
  timeout "$STAGE_TIMEOUT" python3 perf/bench_server.py --checkpoint "$MODELS/demo-base" --adapters "$MODELS/bench-adapters" \
    --instances "$INSTANCES" --gpus "$gpus" --gpu-slots "$ADAPTERS" --host-slots "$ADAPTERS" \
    --concurrency $(( CONCURRENCY * n )) --requests 1024 --interval-ms 5000 --out "$OUT/server-${n}gpu.jsonl"
done
