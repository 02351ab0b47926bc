#!/usr/bin/env bash
# GPU tests of the attention kernels without pytest-xdist (it stalled on the device): the
# collected test ids are dealt round-robin to NPROC plain pytest processes (default 4), each
# test under a KVPOOL_TEST_LIMIT-second limit (pytest_alarm.py), the whole under TEST_TIMEOUT.
# One PASSED/FAILED line per test with its duration lands in $OUT/tests_<i>.log.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/python:$PWD/benches/attention PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn-out}
NPROC=${NPROC:-4}
FILES=${FILES:-tests/test_attention.py tests/test_attention_decode.py tests/test_attention_extend.py tests/test_attention_plans.py tests/test_attention_checks.py tests/test_attention_smollm.py}
mkdir -p "$OUT"
python3 -m pytest -q --collect-only -m gpu $FILES ${TESTS:+-k "$TESTS"} -p no:cacheprovider \
  2>/dev/null | grep "::" > "$OUT/test_ids.txt"
echo "$(wc -l < "$OUT/test_ids.txt") GPU tests in $NPROC processes"
for i in $(seq 0 $((NPROC - 1))); do
  awk -v n="$NPROC" -v i="$i" 'NR % n == i' "$OUT/test_ids.txt" > "$OUT/ids_$i.txt"
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -v -rfE --tb=short -p pytest_alarm \
    -p no:cacheprovider -p no:randomly --durations=0 -m gpu $(cat "$OUT/ids_$i.txt") \
    > "$OUT/tests_$i.log" 2>&1 &
done
wait
grep -hE "^tests/.*::.* (PASSED|FAILED|ERROR)" "$OUT"/tests_*.log | sed 's/ *\[ *[0-9]*%\]//' \
  > "$OUT/tests_summary.txt"
echo "passed $(grep -c PASSED "$OUT/tests_summary.txt"), failed $(grep -cE "FAILED|ERROR" "$OUT/tests_summary.txt")"
grep -E "FAILED|ERROR" "$OUT/tests_summary.txt"
grep -hE "^[0-9.]+s (call|setup)" "$OUT"/tests_*.log | sort -rn | head -15
