# Sourced by the perf/run_*.sh scripts on a GPU host: installs this checkout (editable, no
# dependencies: the GPU bundle has them) and builds, when absent, what they measure with under
# $M: the base-size demo checkpoint and 1,024 rank-16 bench adapters. Never committed: generated.
# SKIP_INSTALL=1: the caller installed the checkout already (tests may be importing it meanwhile).
M=${M:-/tmp/manylora-models}
mkdir -p "$M"
[ "${SKIP_INSTALL:-0}" = 1 ] || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
[ -d "$M/demo-base" ] || python3 -m manylora.demo --size base --out "$M/demo-base" >/dev/null
[ -d "$M/bench-adapters" ] || python3 perf/bench_engine.py --checkpoint "$M/demo-base" --adapters "$M/bench-adapters" \
    --make-adapters 1024 --modes --out /dev/null >/dev/null 2>&1
