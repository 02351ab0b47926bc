"""Quick GPU check of the extend kernel's default paths for one dtype, printing as it goes.

For a device call too short for the whole GPU test suite (each extend test compiles several
tile variants): the geometry and data of ``test_extend_gpu`` (Llama-3.1-8B heads, heavy-tailed
K/V, page 64, ragged) and of ``test_smollm_extend_gpu`` (head_dim 64, group 3, page 16), default
plans only, against the same fp64 oracle and tolerances.

    PYTHONPATH=python:tests python benches/attention/smoke_extend_gpu.py DTYPE
"""

import sys
import time

import torch
from attention_helpers import TOL, Cache, rel_err, run_extend

dtype = sys.argv[1]
t0 = time.time()
cases = [
    ("llama", dict(lens=[600, 64, 129, 1], heads=8, d=128, page=64), 32, [100, 64, 17, 1]),
    (
        "smollm",
        dict(lens=[300, 45, 80, 1, 2, 100], heads=3, d=64, page=16),
        9,
        [17, 45, 16, 1, 1, 0],
    ),
]
for name, geo, hq, qlens in cases:
    lens = geo.pop("lens")
    cache = Cache(dtype, lens, device="cuda", heavy=dtype != "fp32", **geo)
    out, ref = run_extend(cache, hq, qlens, backend="triton", device="cuda")
    e = rel_err(out, ref)
    print(
        f"{dtype} {name} default: rel_err {e:.2e} tol {TOL[dtype]:.1e} "
        f"{'PASS' if e < TOL[dtype] else 'FAIL'} [{time.time() - t0:.0f}s]",
        flush=True,
    )
    if name == "llama":
        out, ref = run_extend(
            cache,
            hq,
            qlens,
            backend="triton",
            device="cuda",
            window=50,
            sinks=torch.linspace(-1, 1, hq),
            softcap=20.0,
        )
        e = rel_err(out, ref)
        print(
            f"{dtype} {name} window+sinks+softcap: rel_err {e:.2e} "
            f"{'PASS' if e < TOL[dtype] else 'FAIL'} [{time.time() - t0:.0f}s]",
            flush=True,
        )
