#!/usr/bin/env bash
# One device call: the gpu-marked write tests (bit-exact vs the reference), then the benchmark,
# then the SASS summary of the FP4 kernels' short path as the device's Triton compiles them.
# Run from the shipped copy's root (see HELPER_ENV.md); results go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt" 2>&1
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_write.py 2>&1 | tee "$OUT/tests.log" | tail -8
timeout 150 python3 benches/write/bench_write.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^|" | tail -14
{ for m in 3 4; do timeout 15 python3 benches/write/sass.py --mode $m --block-t 1 --warps 1 --ablate 3 | head -1; done; } > "$OUT/sass.txt" 2>&1
cat "$OUT/sass.txt"
