#!/usr/bin/env bash
# One device call: the gpu-marked write tests (bit-exact vs the reference), then the benchmark.
# Run from the shipped copy's root (see HELPER_ENV.md); results go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt" 2>&1
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_write.py 2>&1 | tee "$OUT/tests.log" | tail -15
timeout 280 python3 benches/write/bench_write.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^|" | tail -12
