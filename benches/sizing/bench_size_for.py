"""Time `kvpool.size_for` on bundled models after import (issue target: under 1 ms).

Usage: python benches/sizing/bench_size_for.py [--out benches/sizing/results]
Writes size_for.json and size_for.md. Spec parsing (reading the bundled JSON) is timed
separately from planning with a ready ModelSpec.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import kvpool
from kvpool.config import bundled_models


def timeit(fn, n=200):
    fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6, max(samples) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    rows = []
    for name in bundled_models():
        spec = kvpool.ModelSpec.from_pretrained(name)
        p50_name, _ = timeit(lambda: kvpool.size_for(name, "nvfp4", gpu="H200", weights=0))
        p50_spec, worst = timeit(lambda: kvpool.size_for(spec, "nvfp4", gpu="H200", weights=0))
        p50_all, _ = timeit(lambda: kvpool.compare(spec, gpu="H200", weights=0), n=50)
        rows.append({"model": name, "size_for_by_name_us": round(p50_name, 1),
                     "size_for_spec_us": round(p50_spec, 1), "size_for_spec_max_us": round(worst, 1),
                     "compare_7_dtypes_us": round(p50_all, 1)})
    machine = (f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores "
               f"(the project's CPU sandbox), Python {platform.python_version()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "size_for.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    lines = [f"# size_for timing (median of 200 calls, microseconds)\n", f"Machine: {machine}\n",
             "| model | by name (parse + plan) | with a ModelSpec | worst | compare (7 dtypes) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['size_for_by_name_us']} | {r['size_for_spec_us']} | "
              f"{r['size_for_spec_max_us']} | {r['compare_7_dtypes_us']} |" for r in rows]
    (out / "size_for.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
