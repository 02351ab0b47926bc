#!/usr/bin/env bash
# One call on the H200 for issue 17: the new GPU tests (MLA at DeepSeek shapes, every bundled
# model's per-rank geometry) and/or the per-model decode benchmark. Results under $OUT:
#   tests:  tests_summary.txt (one PASSED/FAILED line per test), tests_<i>.log
#   bench:  models.json (one record per model, tp, dtype, page, B, L), models.md (the table),
#           bench_stdout.txt
# Usage: OUT=/path benches/attention/run_gpu_mla.sh [tests|bench|all] (default all: ~9 min;
# run "tests" and "bench" as two calls to stay inside a 10-minute command limit).
# Bench subset: MODELS=deepseek-v3,kimi-k2 DTYPES=bf16,fp8_e4m3 SHAPES=64x8192 BUDGET_S=300;
# MLA tile sweep first (records with "variant"): MLA_SWEEP=16:4:32,32:4:32,32:8:32,64:8:32,64:8:64.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/python:$PWD/benches/attention PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn-out}
PHASE=${1:-all}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  >> "$OUT/gpu.txt" 2>&1
if [ "$PHASE" = tests ] || [ "$PHASE" = all ]; then
  FILES="tests/test_mla.py tests/test_attention_models.py" TEST_TIMEOUT=${TEST_TIMEOUT:-300} \
    NPROC=${NPROC:-4} OUT="$OUT" benches/attention/run_gpu_tests.sh
fi
if [ "$PHASE" = bench ] || [ "$PHASE" = all ]; then
  timeout "${BENCH_TIMEOUT:-540}" python3 benches/attention/bench_models.py --out "$OUT" \
    ${MODELS:+--models "$MODELS"} ${DTYPES:+--dtypes "$DTYPES"} ${SHAPES:+--shapes "$SHAPES"} \
    ${MLA_SWEEP:+--mla-sweep "$MLA_SWEEP"} --reps "${REPS:-25}" --budget-s "${BUDGET_S:-420}" > "$OUT/bench_stdout.txt" 2>&1
  echo "bench exit $?; $(grep -c '"time_ms"' "$OUT/models.json" 2>/dev/null) points," \
    "$(grep -c '"error"' "$OUT/models.json" 2>/dev/null) errors"
  cat "$OUT/models.md" 2>/dev/null | head -80
fi
