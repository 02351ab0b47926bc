#!/usr/bin/env bash
# One device call: compile the benchmark's kernels in parallel (fills Triton's disk cache) while
# the GPU tests run, then time. Everything lands in $OUT (tests.log, warm.log, bench.log,
# attention.json). Env: SECTIONS, VARIANTS (JSON list), DEFAULT (JSON plan overrides), NWARM,
# TEST_TIMEOUT, BENCH_TIMEOUT, TESTS (pytest -k expression or empty for all).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn-out}
mkdir -p "$OUT"
SECTIONS=${SECTIONS:-copy,key,variants,extend,grid}
VARIANTS=${VARIANTS:-[]}
DEFAULT=${DEFAULT:-}
GRID=${GRID:-[{\}]}
EXT=${EXT:-[{\}]}
NWARM=${NWARM:-8}
B=benches/attention/bench_attention.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > "$OUT/bench.log" 2>&1
for i in $(seq 0 $((NWARM - 1))); do
  python3 $B --warm "$i/$NWARM" --sections "$SECTIONS" --variants "$VARIANTS" --default "$DEFAULT" --grid-configs "$GRID" --extend-configs "$EXT" >> "$OUT/warm.log" 2>&1 &
done
if [ "${TESTS-x}" != "none" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu tests/test_attention.py -n 6 -p no:cacheprovider -p no:benchmark \
    ${TESTS:+-k "$TESTS"} > "$OUT/tests.log" 2>&1
  tail -25 "$OUT/tests.log"
fi
wait
echo "warm done $(date +%T)"
timeout "${BENCH_TIMEOUT:-300}" python3 $B --out "$OUT" --sections "$SECTIONS" --variants "$VARIANTS" --default "$DEFAULT" --grid-configs "$GRID" --extend-configs "$EXT" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^  File\|^    " | tail -120
