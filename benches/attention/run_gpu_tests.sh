#!/usr/bin/env bash
# GPU tests of the attention kernels only, with one PASSED/FAILED line per test as it finishes
# and the failure summary (so a run cut by its time limit still names what failed).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn-out}
mkdir -p "$OUT"
timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -v -rfE --tb=short -m gpu tests/test_attention.py \
  -n "${NPROC:-12}" -p no:cacheprovider -p no:benchmark ${TESTS:+-k "$TESTS"} > "$OUT/tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//' | tail -80
