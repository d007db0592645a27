#!/usr/bin/env bash
# Retune the SGMV launch table on the GPU host for the GPU stage's real chunks (segments of one
# row each, SEGMENT tokens, adapters cycling) and measure it in process, same call:
#   1. perf/bench_kernels.py --sweep over the token buckets of the server's chunks (TOKENS) and
#      GLiNER2-base's widths (768, 3072): $OUT/swept.json
#   2. the committed table with the swept entries merged in: $OUT/new.json
#   3. perf/profile_core.py (1,024 rows, 1,024 rank-16 adapters) with the committed table, the
#      merged one, and the committed one again (the noise beside the difference):
#      $OUT/{old,new,old2}.txt and their kernel tables
#     source .gpu-bundle/activate.sh; OUT=perf/results/sgmv bash perf/run_sgmv_sweep.sh
# SWEPT=swept.json skips the sweep and profiles that table's entries merged in.
set -u
M=${M:-/tmp/manylora-models}
OUT=${OUT:-perf/results/sgmv}
TOKENS=${TOKENS:-4096 16384 32768}
SEGMENT=${SEGMENT:-128}
mkdir -p "$M" "$OUT"
. perf/gpu_models.sh  # the checkout installed, the checkpoint and adapters under $M
TABLE=kernels/configs/NVIDIA_H200.json
cp "$TABLE" "$OUT/old.json"
cp "$OUT/old.json" "$OUT/old2.json"
trap 'cp "$OUT/old.json" "$TABLE"' EXIT  # the committed table back, however the script ends
if [ -n "${SWEPT:-}" ]; then  # a table an earlier sweep wrote: only the profiles
    cp "$SWEPT" "$OUT/swept.json"
else
    timeout "${SWEEP_TIMEOUT:-300}" python3 perf/bench_kernels.py --sweep "$OUT/swept.json" --sweep-tokens $TOKENS \
        --sweep-hidden 768 3072 --sweep-segment-tokens "$SEGMENT" >"$OUT/sweep.txt" 2>&1
    grep -E "^sgmv" "$OUT/sweep.txt" | tail -12
fi
python3 - "$OUT/old.json" "$OUT/swept.json" "$OUT/new.json" <<'PY'
import json, sys
sys.path.insert(0, "perf")
from bench_kernels import format_table
old, swept = (json.load(open(p)) for p in sys.argv[1:3])
for op, entries in swept.items():
    if op != "_about":
        old[op].update(entries)
old["_about"] += " Buckets " + ", ".join(k for k in swept["sgmv_expand"] if "h*" in k) + ": " + swept["_about"]
open(sys.argv[3], "w").write(format_table(old))  # new.json: the loop below reads it
PY
for arm in old new old2; do
    cp "$OUT/$arm.json" "$TABLE"
    timeout "${PROFILE_TIMEOUT:-150}" python3 perf/profile_core.py --checkpoint "$M/demo-base" --adapters "$M/bench-adapters" \
        --adapters-in-flight 1024 --rows 1024 --out "$OUT/$arm" >"$OUT/$arm.txt" 2>&1
    echo "$arm: $(grep -h -E '^device|^GPU kernel' "$OUT/$arm.txt" | sed 's/, graphs {[^}]*}//' | tr '\n' ' ')"
    grep -h -E "_sgmv_(expand|shrink)_kernel" "$OUT/$arm/core-kernels.txt" | awk '{print "   ", $1, $(NF-4), $(NF-1), $NF}'
done
