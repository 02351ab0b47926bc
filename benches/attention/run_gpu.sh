#!/usr/bin/env bash
# One device call: compile the benchmark's kernels in parallel (fills Triton's disk cache) while
# the GPU tests run (run_gpu_tests.sh: plain pytest processes, a time limit per test), then time.
# Everything lands in $OUT (tests_*.log, warm.log, bench.log, attention.json; read/ for the
# optional second pass with a read-only L2 flush). Env: SECTIONS, VARIANTS (JSON list), DEFAULT
# (JSON plan overrides), DTYPES (comma list), GRID, EXT (JSON lists), NWARM, TEST_TIMEOUT, BENCH_TIMEOUT,
# TESTS (pytest -k expression; "none" skips the tests), READ_SECTIONS/READ_DTYPES (second pass).
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
DTYPES=${DTYPES:-fp32,bf16,fp16,fp8_e4m3,fp8_e5m2,nvfp4,fp4_mx_block16}
B=benches/attention/bench_attention.py
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > "$OUT/bench.log" 2>&1
for i in $(seq 0 $((NWARM - 1))); do
  timeout "${WARM_TIMEOUT:-200}" python3 $B --warm "$i/$NWARM" --sections "$SECTIONS" --variants "$VARIANTS" --dtypes "$DTYPES" \
    --default "$DEFAULT" --grid-configs "$GRID" --extend-configs "$EXT" >> "$OUT/warm.log" 2>&1 &
done
if [ "${TESTS-x}" != "none" ]; then
  OUT=$OUT bash benches/attention/run_gpu_tests.sh > "$OUT/tests_out.txt" 2>&1
  cat "$OUT/tests_out.txt"
fi
echo "tests done at +$(( $(date +%s) - T0 ))s"
wait
echo "warm done at +$(( $(date +%s) - T0 ))s"
timeout "${BENCH_TIMEOUT:-300}" python3 $B --out "$OUT" --sections "$SECTIONS" --variants "$VARIANTS" --dtypes "$DTYPES" \
  --default "$DEFAULT" --grid-configs "$GRID" --extend-configs "$EXT" 2>&1 | tee -a "$OUT/bench.log" \
  | grep -v "^  File\|^    " | tail -150
if [ -n "${READ_SECTIONS:-}" ]; then
  mkdir -p "$OUT/read"
  timeout "${READ_TIMEOUT:-60}" python3 $B --out "$OUT/read" --flush read --sections "$READ_SECTIONS" \
    --dtypes "${READ_DTYPES:-bf16,fp8_e4m3,nvfp4}" --default "$DEFAULT" 2>&1 | tee "$OUT/read/bench.log" \
    | grep -v "^  File\|^    " | tail -40
fi
echo "all done at +$(( $(date +%s) - T0 ))s"
# the device tool returns few files: logs go back in one archive
cd "$OUT" && tar czf logs.tgz --remove-files tests_*.log ids_*.txt test_ids.txt warm.log tests_out.txt \
  2>/dev/null; ls "$OUT"
