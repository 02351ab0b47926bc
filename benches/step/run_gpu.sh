#!/usr/bin/env bash
# Issue 22 (serving step) on a CUDA machine, in two calls of < 10 minutes each:
#
#   STAGE=tests OUT=$OUT bash benches/step/run_gpu.sh   # ~5-6 min: the GPU tests
#   STAGE=bench OUT=$OUT bash benches/step/run_gpu.sh   # ~4 min: host bench + serving profile
#
# tests (gpu_tests.txt): no compile growth over serving steps (test_specialization), a warmed
#   engine compiles nothing while serving (test_warmup), the fast launch (int pointers) equals
#   Triton's normal launch bit for bit (test_replay), DecodeGraph capture vs eager and no sync
#   (test_graph), GraphEngine graphs vs eager (test_serve_graph).
# bench: host_cuda.json/.txt (bench_host.py --mode cuda, bf16 and fp8_e4m3: step_metadata,
#   write_decode, graph_fill, ...); profile.json/.txt (benches/e2e/profile_serve.py, SmolLM2-135M
#   geometry: run1 and run2 in one process, warmed in the engine's constructor; init_s is the
#   constructor's time with its warm-up) and profile_cold.txt (--no-warmup: the old first run).
# Each piece has its own timeout; a failing piece does not stop the others.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-out_step}
STAGE=${STAGE:-tests}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
if [ "$STAGE" = tests ]; then
  timeout 540 $PY -m pytest -q -rA -p no:randomly -p no:cacheprovider -m gpu \
    tests/test_specialization.py tests/test_warmup.py \
    tests/test_replay.py tests/test_graph.py tests/test_serve_graph.py > "$OUT/gpu_tests.txt" 2>&1
  echo "gpu_tests: rc $?"; tail -3 "$OUT/gpu_tests.txt"
else
  timeout 60 $PY benches/step/bench_host.py --mode cuda --numpy-plan --label "H200, serve branch" \
    --out "$OUT/host_cuda.json" > "$OUT/host_cuda.txt" 2>&1
  echo "host bf16: rc $?"
  timeout 50 $PY benches/step/bench_host.py --mode cuda --dtype fp8_e4m3 --label "H200 fp8" \
    --out "$OUT/host_cuda_fp8.json" >> "$OUT/host_cuda.txt" 2>&1
  echo "host fp8: rc $?"; cat "$OUT/host_cuda.txt"
  timeout 150 $PY benches/e2e/profile_serve.py --model SmolLM2-135M --out "$OUT/profile.json" \
    > "$OUT/profile.txt" 2>&1
  echo "profile: rc $?"; head -2 "$OUT/profile.txt"
  timeout 90 $PY benches/e2e/profile_serve.py --model SmolLM2-135M --no-warmup --top 0 \
    --out "$OUT/profile_cold.json" > "$OUT/profile_cold.txt" 2>&1
  echo "profile cold: rc $?"; head -2 "$OUT/profile_cold.txt"
fi
echo "done: $(ls "$OUT")"
