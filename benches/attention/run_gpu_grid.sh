#!/usr/bin/env bash
# Issue 17's benchmark grid (bench_grid.py) on the H200, in two device calls of < 9 min each:
#   call 1:  OUT=... benches/attention/run_gpu_grid.sh 0/2     (the first of two balanced shards)
#   then copy $OUT/models.json (and flashinfer.json) into $RUN_DIR of the working tree
#   call 2:  OUT=... benches/attention/run_gpu_grid.sh 0/1     (everything not yet in models.json)
# Points already in $RUN_DIR/models.json are skipped, so call 2 also finishes a cut call 1.
# FLASHINFER=1 (carry ".whl", see flashinfer_wheelhouse.py): install FlashInfer from the
# wheelhouse into /tmp/flashinfer without network and time it after kvpool's points, within the
# same budget (flashinfer.json). Subsets: MODELS=deepseek-v3,kimi-k2 DTYPES=bf16 SHAPES=64x8192.
# Results under $OUT: models.json, flashinfer.json, grid_<shard>.txt (stdout), RESULTS.md (the
# grid's section alone), models.png, gpu.txt.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/python:$PWD/benches/attention PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn-out}
RUN_DIR=${RUN_DIR:-benches/attention/results/run13_h200}
SHARD=${1:-0/1}
mkdir -p "$OUT" "$RUN_DIR"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  >> "$OUT/gpu.txt" 2>&1
extra=""
if [ "${FLASHINFER:-0}" = 1 ]; then
  [ -d /usr/local/cuda/bin ] && export PATH=$PATH:/usr/local/cuda/bin
  bash benches/attention/install_flashinfer.sh .whl /tmp/flashinfer > "$OUT/flashinfer_install.txt" 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/flashinfer PATH=$PATH:/tmp/flashinfer/bin
  extra="--flashinfer"
fi
log="$OUT/grid_${SHARD/\//of}.txt"
timeout "${BENCH_TIMEOUT:-530}" python3 benches/attention/bench_grid.py --out "$RUN_DIR" \
  --shard "$SHARD" --budget-s "${BUDGET_S:-480}" --reps "${REPS:-25}" $extra \
  ${MODELS:+--models "$MODELS"} ${DTYPES:+--dtypes "$DTYPES"} ${SHAPES:+--shapes "$SHAPES"} \
  > "$log" 2>&1
echo "grid exit $?"
cp "$RUN_DIR"/models.json "$OUT/" 2>/dev/null
cp "$RUN_DIR"/flashinfer.json "$OUT/" 2>/dev/null
python3 benches/attention/grid_report.py "$RUN_DIR" --md "$OUT/RESULTS.md" --png "$OUT/models.png" \
  > /dev/null 2>> "$log"
grep -E "^(done|budget|skip|[0-9]+ geometries)" "$log"
echo "$(grep -c '"time_ms"' "$OUT/models.json" 2>/dev/null) timed records," \
  "$(grep -c '"error"' "$OUT/models.json" 2>/dev/null) errors"
head -40 "$OUT/RESULTS.md" 2>/dev/null
