#!/usr/bin/env bash
# The GPU stage's CUDA graphs on a GPU host, in one go: the GPU tests that cover them, then
# perf/profile_core.py with cuda_graphs on and off (one row and 1,024 rows; base and 1,024
# rank-16 adapters), the A/B in one run, each profile with its interleaved chunk_pipeline,
# count_gate, fused_span_scores and fused_attention A/Bs. Prints one line per profile; full tables under $OUT.
#     OUT=perf/results/graphs bash perf/run_graphs_check.sh
# PACK=1 leaves one file, $OUT.tgz, instead of the folder (a device call returns at most 8 files).
set -u
M=${M:-/tmp/manylora-models}
OUT=${OUT:-perf/results/graphs}
mkdir -p "$M" "$OUT"
. perf/gpu_models.sh  # the checkout installed, the checkpoint and adapters under $M
if [ "${TESTS:-1}" = 1 ]; then
    python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests/engine/test_cuda_graphs.py tests/engine/test_gpu_memory.py \
        tests/engine/test_dense_heads.py tests/lora/test_lora_fidelity.py tests/kernels/test_span_scores.py \
        tests/kernels/test_launch_config.py tests/kernels/test_disentangled_attention.py tests/engine/test_fused_attention.py} >"$OUT/pytest.txt" 2>&1
    tail -3 "$OUT/pytest.txt"
fi
for rows in ${ROWS:-1 1024}; do
    for adapters in 0 1024; do
        for graphs in ${GRAPHS:-on off}; do
            name="rows$rows-adapters$adapters-graphs-$graphs"
            extra=()
            [ "$adapters" = 0 ] || extra=(--adapters "$M/bench-adapters" --adapters-in-flight "$adapters")
            python3 perf/profile_core.py --checkpoint "$M/demo-base" "${extra[@]}" --rows "$rows" \
                --cuda-graphs "$graphs" ${PROFILE_ARGS:-} --out "$OUT/$name" >"$OUT/$name.txt" 2>&1
            echo "$name: $(grep -h -E '^device|^GPU kernel|^chunk_pipeline|^count_gate|^fused_span_scores|^fused_attention' "$OUT/$name.txt" | sed 's/, graphs {[^}]*}//' | tr '\n' ' ')"
        done
    done
done
if [ "${PACK:-0}" = 1 ]; then
    tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && rm -rf "$OUT"
fi
