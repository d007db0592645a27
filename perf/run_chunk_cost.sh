#!/usr/bin/env bash
# chunk_cost_tokens A/B in process on the GPU host: perf/profile_core.py interleaves the values of
# COSTS on the same engine, for calls of each size in ROWS, with 1,024 rank-16 adapters and base rows.
#     source .gpu-bundle/activate.sh; OUT=perf/results/chunk-cost bash perf/run_chunk_cost.sh
set -u
M=${M:-/tmp/manylora-models}
OUT=${OUT:-perf/results/chunk-cost}
ROWS=${ROWS:-110 1024}
COSTS=${COSTS:-32768,8192,2048}
mkdir -p "$M" "$OUT"
. perf/gpu_models.sh  # the checkout installed, the checkpoint and adapters under $M
for rows in $ROWS; do
    for flight in 1024 0; do
        name="rows$rows-adapters$flight"
        timeout "${PROFILE_TIMEOUT:-200}" python3 perf/profile_core.py --checkpoint "$M/demo-base" --adapters "$M/bench-adapters" \
            --adapters-in-flight "$flight" --rows "$rows" --ab chunk_cost_tokens --chunk-costs "$COSTS" \
            --out "$OUT/$name" >"$OUT/$name.txt" 2>&1
        echo "== $name: $(grep -h -E '^device|^GPU kernel' "$OUT/$name.txt" | sed 's/, graphs {[^}]*}//' | tr '\n' ' ')"
        grep -h "^chunk_cost_tokens" "$OUT/$name.txt" | sed 's/; vs .*: / | /'
    done
done
