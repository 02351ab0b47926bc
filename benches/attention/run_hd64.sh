#!/usr/bin/env bash
# One device call (< 9 min): issue 17's head_dim-64 decode variants.
# 1. sweep_hd64.py (BUDGET, default 200 s): every Gluon knob variant checked against the torch
#    reference in parallel processes, then timed at gpt-oss-120b's full-attention layer
#    (B=64 x 8k, page 16) beside SDPA bf16; best per dtype printed;
# 2. the GPU tests of tests/test_gluon_knobs.py (run_gpu_tests.sh: NPROC plain pytest
#    processes, TEST_TIMEOUT; TESTS = pytest -k expression, "none" skips them).
# Everything lands in $OUT: sweep_hd64.json/.md, worker logs, tests_*.log, tests_summary.txt.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/python:$PWD/benches/attention PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hd64-out}
mkdir -p "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > "$OUT/device.txt" 2>&1
timeout $(( ${BUDGET:-200} + 40 )) python3 benches/attention/sweep_hd64.py --out "$OUT" \
  --budget-s "${BUDGET:-200}" 2>&1 | tee "$OUT/sweep.log" | grep -v "^  File\|^    " | tail -70
echo "sweep done at +$(( $(date +%s) - T0 ))s"
if [ "${TESTS-x}" != "none" ]; then
  OUT=$OUT NPROC=${NPROC:-12} FILES=tests/test_gluon_knobs.py TESTS="${TESTS:-}" \
    TEST_TIMEOUT=${TEST_TIMEOUT:-270} bash benches/attention/run_gpu_tests.sh 2>&1 | tail -40
fi
echo "all done at +$(( $(date +%s) - T0 ))s"
