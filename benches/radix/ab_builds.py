"""A/B of two kvpool builds on the replay loop, alternating, so both see the same machine load.

Each round runs, for every cell (workload:page_size), one subprocess per build (order flipped every
round) that replays the pre-generated requests `--repeats` times and reports its best loop time.
On a shared machine the load drifts within minutes; alternating keeps the comparison fair, and the
per-round ratio new/old is reported besides the minima and medians.

Usage: python benches/radix/ab_builds.py OLD_DIR NEW_DIR [--cells system_prompts:1,...]
       [--rounds 5] [--repeats 7] [--cpu] [--out FILE.json]
--cpu compares process CPU time of the loop instead of wall time (less sensitive to being
descheduled, not to sharing caches and memory bandwidth).
OLD_DIR / NEW_DIR are directories holding a `kvpool` package (e.g. a copy of python/kvpool with
its built _core.abi3.so).
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
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--cells", default="system_prompts:1,conversations:1,system_prompts:16,conversations:16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cpu", action="store_true", help="process CPU time instead of wall time")
    ap.add_argument("--out")
    args = ap.parse_args()
    builds = {"old": args.old, "new": args.new}
    cells = args.cells.split(",")
    best = {(b, c): [] for b in builds for c in cells}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for c in cells:
            w, ps = c.split(":")
            for b in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
                env = dict(os.environ, PYTHONPATH=builds[b])
                key = "loop_cpu_s" if args.cpu else "loop_s"
                out = subprocess.run([sys.executable, "-c", CODE, w, ps, str(args.repeats), HERE, key], env=env,
                                     capture_output=True, text=True, check=True).stdout
                best[(b, c)].append(min(json.loads(out)))
        load.append(os.getloadavg()[0])
    rows = []
    for c in cells:
        o, n = best[("old", c)], best[("new", c)]
        ratios = [y / x for x, y in zip(o, n)]
        rows.append({"cell": c, "old_best_per_round": o, "new_best_per_round": n,
                     "old_min": min(o), "new_min": min(n), "old_median": statistics.median(o),
                     "new_median": statistics.median(n), "new_over_old_median_ratio": statistics.median(ratios)})
        print(f"{c:18s} old min {min(o):.4f} med {statistics.median(o):.4f}   new min {min(n):.4f} "
              f"med {statistics.median(n):.4f}   new/old (median of rounds) {statistics.median(ratios):.3f}")
    print("load averages (1 min) at the start and after each round:", " ".join(f"{x:.1f}" for x in load))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"old": args.old, "new": args.new, "rounds": args.rounds, "repeats": args.repeats,
                       "metric": "loop_cpu_s" if args.cpu else "loop_s",
                       "loadavg_1min": load, "cells": rows}, f, indent=1)


if __name__ == "__main__":
    main()
