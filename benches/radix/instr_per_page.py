"""Instructions per page of the replay loop, counted by callgrind (immune to the shared machine's load).

For each (workload, page size) the replay of bench_radix.py runs under valgrind --tool=callgrind
once with one pass and once with two passes over the same pre-generated requests; the difference
is exactly one replay loop (plus one allocator/cache construction, a few million instructions).
Reported: instructions of the whole loop (Python, numpy and kvpool) and of the kvpool calls alone
(inclusive cost of PyO3's trampoline), per page of the requests' full sequences and per page newly
stored (not matched). glibc's `rep movsb` copies count one instruction per byte under valgrind,
so the vector copy loops are forced (GLIBC_TUNABLES) to keep copies comparable with the rest.

Usage: python benches/radix/instr_per_page.py [--pythonpath DIR] [--label NAME] [--out FILE.json]
(needs valgrind and callgrind_annotate on PATH; about a minute per cell).
"""

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_radix  # noqa: E402

TUNABLES = "glibc.cpu.x86_rep_movsb_threshold=100000000:glibc.cpu.x86_rep_stosb_threshold=100000000"
TRAMPOLINE = "pyo3::impl_::trampoline::trampoline ["


def child(workload, ps, passes):
    reqs, pool = bench_radix.WORKLOADS[workload]()
    # As bench_radix's children: the permanent requests stay out of the cyclic GC's way.
    gc.collect()
    gc.freeze()
    hit = 0
    for _ in range(passes):
        r = bench_radix.replay("kvpool", reqs, pool, ps, timed=False)
        hit = r["hit_rate"]
    prompt = sum(len(p) for p, _ in reqs)
    pages = sum(-(-len(f) // ps) for _, f in reqs)
    print(json.dumps({"request_pages": pages, "hit_pages": round(hit * prompt) // ps}))


def totals(path):
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                         capture_output=True, text=True, check=True).stdout
    total = int(re.search(r"([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", out).group(1).replace(",", ""))
    calls = max((int(line.split()[0].replace(",", "")) for line in out.splitlines() if TRAMPOLINE in line),
                default=0)
    return total, calls


def cell(workload, ps, env):
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for passes in (1, 2):
            f = os.path.join(tmp, f"cg.{passes}")
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={f}", sys.executable,
                   os.path.abspath(__file__), "--child", workload, str(ps), str(passes)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            res[passes] = (totals(f), json.loads(out.strip().splitlines()[-1]))
    (t1, k1), info = res[1]
    (t2, k2), _ = res[2]
    loop, calls = t2 - t1, k2 - k1
    pages, new = info["request_pages"], info["request_pages"] - info["hit_pages"]
    return {"workload": workload, "page_size": ps, "loop_instructions": loop, "kvpool_call_instructions": calls,
            "request_pages": pages, "new_pages": new,
            "loop_per_page": loop / pages, "kvpool_per_page": calls / pages,
            "loop_per_new_page": loop / new, "kvpool_per_new_page": calls / new}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=3, metavar=("WORKLOAD", "PAGE_SIZE", "PASSES"))
    ap.add_argument("--pythonpath", help="directory holding the kvpool package to measure")
    ap.add_argument("--label", default="")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        w, ps, n = args.child
        child(w, int(ps), int(n))
        return
    # One BLAS thread: OpenBLAS's idle threads spin, and callgrind would count their loops.
    env = dict(os.environ, GLIBC_TUNABLES=TUNABLES, OPENBLAS_NUM_THREADS="1")
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    rows = []
    for w in bench_radix.WORKLOADS:
        for ps in (1, 16):
            r = cell(w, ps, env)
            rows.append(r)
            print(f"{args.label} {w:15s} ps={ps:2d} loop {r['loop_instructions'] / 1e6:7.1f}M "
                  f"kvpool calls {r['kvpool_call_instructions'] / 1e6:7.1f}M  per page {r['loop_per_page']:.1f} / "
                  f"{r['kvpool_per_page']:.1f}  per new page {r['loop_per_new_page']:.1f} / "
                  f"{r['kvpool_per_new_page']:.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"label": args.label, "cells": rows}, f, indent=1)


if __name__ == "__main__":
    main()
