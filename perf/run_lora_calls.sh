#!/usr/bin/env bash
# The GPU stage's SGMV calls measured one by one on the GPU host (perf/bench_lora_calls.py):
# builds the base-size demo and 1,024 rank-16 bench adapters under $M if absent, then
# measures the calls of one 256-row chunk; $OUT/lora-calls.{txt,json}.
#     source .gpu-bundle/activate.sh; OUT=perf/results/lora-calls bash perf/run_lora_calls.sh
set -u
M=${M:-/tmp/manylora-models}
OUT=${OUT:-perf/results/lora-calls}
mkdir -p "$M" "$OUT"
. perf/gpu_models.sh  # the checkout installed, the checkpoint and adapters under $M
timeout "${CALLS_TIMEOUT:-300}" python3 perf/bench_lora_calls.py --checkpoint "$M/demo-base" --adapters "$M/bench-adapters" \
    --rows "${ROWS:-256}" --out "$OUT/lora-calls.json" "$@" >"$OUT/lora-calls.txt" 2>&1
tail -25 "$OUT/lora-calls.txt"
