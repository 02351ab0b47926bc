#!/usr/bin/env bash
# One device call (< 8 min): the Gluon head_dim 64/256 and group-16 kernels (issue 17).
# 1. compile every point's kernels in NWARM parallel processes (fills Triton's cache) while
#    the GPU tests of tests/test_gluon_geometries.py run (run_gpu_tests.sh: NPROC plain pytest
#    processes; TESTS = pytest -k expression, "none" skips them; default: page 16 only);
# 2. time every point in one process (bench_gluon_geometries.py: default plan, generic kernel,
#    SDPA bf16, rel diff default vs generic).
# Env: OUT, DTYPES (comma list), MODELS, SHAPES, NWARM (8), NPROC (4), TESTS, WARM_TIMEOUT (200),
# TEST_TIMEOUT (200), BENCH_TIMEOUT (240): at most ~7.5 minutes in all.
# Everything lands in $OUT: bench.log, gluon_geometries.json/.md, logs.tgz (warm + test logs).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gluon-out}
mkdir -p "$OUT"
B=benches/attention/bench_gluon_geometries.py
ARGS=(--dtypes "${DTYPES:-bf16,fp8_e4m3,nvfp4,fp8_e5m2,fp4_mx_block16}" --shapes "${SHAPES:-64x8192}")
[ -n "${MODELS:-}" ] && ARGS+=(--models "$MODELS")
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > "$OUT/bench.log" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  >> "$OUT/bench.log" 2>&1
NWARM=${NWARM:-8}
for i in $(seq 0 $((NWARM - 1))); do
  timeout "${WARM_TIMEOUT:-200}" python3 $B --warm "$i/$NWARM" "${ARGS[@]}" > "$OUT/warm_$i.log" 2>&1 &
done
if [ "${TESTS-x}" != "none" ]; then
  OUT=$OUT NPROC=${NPROC:-4} FILES=tests/test_gluon_geometries.py TESTS="${TESTS:-page16 or default_plan}" \
    TEST_TIMEOUT=${TEST_TIMEOUT:-200} bash benches/attention/run_gpu_tests.sh > "$OUT/tests_out.txt" 2>&1
  cat "$OUT/tests_out.txt"
fi
wait
echo "warm and tests done at +$(( $(date +%s) - T0 ))s"
grep -h "Error\|error" "$OUT"/warm_*.log | sort | uniq -c | head -20
timeout "${BENCH_TIMEOUT:-240}" python3 $B --out "$OUT" "${ARGS[@]}" 2>&1 | tee -a "$OUT/bench.log" \
  | grep -v "^  File\|^    " | tail -60
echo "all done at +$(( $(date +%s) - T0 ))s"
cd "$OUT" && tar czf logs.tgz --remove-files warm_*.log tests_*.log ids_*.txt test_ids.txt 2>/dev/null
ls "$OUT"
