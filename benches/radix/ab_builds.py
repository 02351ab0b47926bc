"""A/B of kvpool builds (and bench harnesses) on the replay loop, alternating, so all see the same
machine load.

Each round runs, for every cell (workload:page_size), one subprocess per configuration (order
reversed every other round) that generates the requests, replays them `--repeats` times and
reports its best loop time. On a shared machine the load drifts within minutes; alternating keeps
the comparison fair. Reported per configuration and cell: the per-round bests, their minimum and
median, and the median over rounds of the ratio to the first configuration.

Usage: python benches/radix/ab_builds.py OLD_DIR NEW_DIR [--cells system_prompts:1,...]
       [--rounds 5] [--repeats 7] [--cpu] [--out FILE.json]
   or: python benches/radix/ab_builds.py --config NAME=KVPOOL_DIR[:BENCH_DIR] --config ... [...]
KVPOOL_DIR holds a `kvpool` package (e.g. a copy of python/kvpool with its built _core.abi3.so);
BENCH_DIR holds the bench_radix.py (and pyref.py) to replay with, default this directory (a
harness of another commit: `git show REV:benches/radix/bench_radix.py > DIR/bench_radix.py`).
--cpu compares process CPU time of the loop instead of wall time (less sensitive to being
descheduled, not to sharing caches and memory bandwidth).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CODE = r"""
import gc, json, sys
sys.path.insert(0, sys.argv[4])
import bench_radix as b
w, ps, reps, key = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
reqs, pool = b.WORKLOADS[w]()
gc.collect(); gc.freeze()
print(json.dumps([b.replay("kvpool", reqs, pool, ps, timed=False)[key] for _ in range(reps)]))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", nargs="?")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--config", action="append", default=[],
                    metavar="NAME=KVPOOL_DIR[:BENCH_DIR]")
    ap.add_argument("--cells", default="system_prompts:1,conversations:1,system_prompts:16,conversations:16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cpu", action="store_true", help="process CPU time instead of wall time")
    ap.add_argument("--out")
    args = ap.parse_args()
    configs = {}
    if args.old and args.new:
        configs = {"old": (args.old, HERE), "new": (args.new, HERE)}
    for c in args.config:
        name, spec = c.split("=", 1)
        kv, _, bench = spec.partition(":")
        configs[name] = (kv, bench or HERE)
    if len(configs) < 2:
        ap.error("give OLD_DIR NEW_DIR or at least two --config")
    names = list(configs)
    cells = args.cells.split(",")
    best = {(b, c): [] for b in names for c in cells}
    load = [os.getloadavg()[0]]
    key = "loop_cpu_s" if args.cpu else "loop_s"
    for r in range(args.rounds):
        for c in cells:
            w, ps = c.split(":")
            for b in (names if r % 2 == 0 else names[::-1]):
                kv, bench = configs[b]
                env = dict(os.environ, PYTHONPATH=kv)
                cmd = [sys.executable, "-c", CODE, w, ps, str(args.repeats), bench, key]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                     check=True).stdout
                best[(b, c)].append(min(json.loads(out)))
        load.append(os.getloadavg()[0])
    rows = []
    for c in cells:
        base = best[(names[0], c)]
        row = {"cell": c}
        line = f"{c:18s}"
        for b in names:
            v = best[(b, c)]
            ratio = statistics.median([y / x for x, y in zip(base, v, strict=True)])
            row[b] = {"best_per_round": v, "min": min(v), "median": statistics.median(v),
                      f"over_{names[0]}_median_ratio": ratio}
            line += f"  {b}: min {min(v):.4f} med {statistics.median(v):.4f}"
            if b != names[0]:
                line += f" ({ratio:.3f}x {names[0]})"
        rows.append(row)
        print(line)
    print("load averages (1 min) at the start and after each round:",
          " ".join(f"{x:.1f}" for x in load))
    if args.out:
        with open(args.out, "w") as f:
            cfg = {b: {"kvpool": kv, "bench": bench} for b, (kv, bench) in configs.items()}
            json.dump({"configs": cfg,
                       "rounds": args.rounds, "repeats": args.repeats, "metric": key,
                       "loadavg_1min": load, "cells": rows}, f, indent=1)


if __name__ == "__main__":
    main()
