#!/usr/bin/env bash
# Issue 22 on a CUDA machine, one call: the host-cost bench (CUDA launches), the DecodeGraph GPU
# tests (30-layer capture vs eager, no sync under set_sync_debug_mode), and kvpool vs
# transformers' continuous batching. Writes under $OUT (default ./out_step):
#   host_cuda.json, host_cuda.txt     bench_host.py --mode cuda (bf16) and host_cuda_fp8.json
#   gpu_tests.txt                     pytest -m gpu tests/test_graph.py tests/test_replay.py
# (benches/e2e/run_gpu.sh runs all of this and serve.py --cuda-graph, with a summary)
#   vs_transformers/throughput.json   one record per system/model/dtype, and log.txt
# Each stage has its own timeout; the whole script stays under ~9.5 minutes.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-out_step}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python}
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
timeout 60 $PY benches/step/bench_host.py --mode cuda --numpy-plan --label "H200, after" \
  --out "$OUT/host_cuda.json" > "$OUT/host_cuda.txt" 2>&1
timeout 45 $PY benches/step/bench_host.py --mode cuda --dtype fp8_e4m3 --label "H200 fp8" \
  --out "$OUT/host_cuda_fp8.json" >> "$OUT/host_cuda.txt" 2>&1
timeout 120 $PY -m pytest -q -m gpu tests/test_graph.py tests/test_replay.py -rA > "$OUT/gpu_tests.txt" 2>&1
timeout 330 $PY benches/e2e/bench_vs_transformers.py --out "$OUT/vs_transformers" \
  --budget-s 280 > "$OUT/vs_transformers.txt" 2>&1
echo "done: $(ls "$OUT")"
