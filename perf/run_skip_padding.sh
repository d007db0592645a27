#!/usr/bin/env bash
# lora_skip_padding on the GPU host, one device call (~8 minutes): its GPU tests while the models
# build, then perf/profile_core.py's interleaved A/B (same rows in both arms, each arm's GPU kernel
# time) for calls of each size in ROWS with 1,024 rank-16 adapters (ROWS="" skips it); with SERVER=1
# also the server A/B of DESIGNS (default: pipeline against pipeline-skip-padding; LoRA uniform,
# c=1,024 and 3,000 req/s; ~2.5 minutes a design). The GPU tests include core_process's worker.
#     source .gpu-bundle/activate.sh; OUT=perf/results/skip-padding bash perf/run_skip_padding.sh
#     ROWS= SERVER=1 DESIGNS="pipeline pipeline-core-process" bash perf/run_skip_padding.sh
set -u
M=${M:-/tmp/manylora-models}
OUT=${OUT:-perf/results/skip-padding}
ROWS=${ROWS-150 350}
mkdir -p "$M" "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
( timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q tests/lora/test_lora_fidelity.py tests/engine/test_cuda_graphs.py \
    tests/kernels/test_sgmv_meta.py tests/kernels/test_sgmv_lora_apply.py tests/engine/test_decode.py \
    tests/engine/test_core_process.py \
    >"$OUT/gpu-tests.txt" 2>&1; echo "rc $?" >>"$OUT/gpu-tests.txt" ) &
tests=$!
SKIP_INSTALL=1 . perf/gpu_models.sh  # the checkpoint and adapters under $M
wait "$tests"
echo "== GPU tests: $(tail -2 "$OUT/gpu-tests.txt" | tr '\n' ' ')"
for rows in $ROWS; do
    name="rows$rows"
    timeout "${PROFILE_TIMEOUT:-150}" python3 perf/profile_core.py --checkpoint "$M/demo-base" --adapters "$M/bench-adapters" \
        --adapters-in-flight 1024 --rows "$rows" --repeats 10 --ab lora_skip_padding --out "$OUT/$name" >"$OUT/$name.txt" 2>&1
    echo "== $name: $(grep -h -E '^GPU kernel' "$OUT/$name.txt" | tr '\n' ' ')"
    grep -h "^lora_skip_padding" "$OUT/$name.txt"
done
if [ "${SERVER:-0}" = 1 ]; then
    export TRITONSERVER=${TRITONSERVER:-$(command -v tritonserver)}
    timeout "${SERVER_TIMEOUT:-420}" python3 perf/bench_server.py --checkpoint "$M/demo-base" --adapters "$M/bench-adapters" \
        --design ${DESIGNS:-pipeline pipeline-skip-padding} --front-instances 64 --gpu-slots 1024 --host-slots 1024 --modes lora \
        --distributions uniform --concurrency 1024 --rates 3000 --warmup-open --requests 1024 --interval-ms 3000 \
        --max-trials 3 --warmup-ms 4000 --out "$OUT/server-ab.jsonl" >"$OUT/server-ab.txt" 2>&1
    tail -12 "$OUT/server-ab.txt"
fi
