"""KV-event overhead on the radix replay benchmark: events off vs on, side by side in one run.

The workloads and the per-request loop are bench_radix.py's (W1 system_prompts, W2
conversations; match_prefix, lock, cache.alloc, insert, unlock, free). Modes, alternated within
each repeat so that the machine's drift hits them alike:

- off: RadixCache(a) as in bench_radix.py;
- on: RadixCache(a, kv_events=True): every insert hashes its new pages and records a
  BlockStored, every eviction a BlockRemoved; the loop drains the events after every `--drain`
  requests (a serving step) as `take_kv_events_batch()` (O(1), the events stay in Rust);
- publish: as on, through `EventPublisher(..., cache=c).publish()`: the same drain, then the
  publisher's thread encodes the batch in Rust with the GIL released, frames and sends it
  (inproc PUB without subscriber), on the second core;
- tuples: as on, drained as `take_kv_events()` (a Python tuple per event, a Python int per
  token and hash: what a Python consumer of the events pays).

Reported per mode: the loop's wall time (best and median of the repeats), its process CPU time
(all threads), and from a separate pass with a timer around each call, ops/s of match_prefix,
insert, cache.alloc (which evicts), and of the drain (take_kv_events). Usage:
python benches/radix/bench_events.py [--repeats 7] [--drain 1] [--out FILE.json]
"""

import argparse
import gc
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_radix import WORKLOADS  # noqa: E402

import kvpool  # noqa: E402
from kvpool.events import EventPublisher  # noqa: E402

MODES = ("off", "on", "publish", "tuples")


def replay(mode, reqs, pool_tokens, ps, drain, timed, pub):
    a = kvpool.PageAllocator(pool_tokens // ps, ps)
    c = kvpool.RadixCache(a, ps) if mode == "off" else kvpool.RadixCache(a, ps, kv_events=True, hash_seed=0)
    clock = time.perf_counter_ns
    t = {"match_prefix": [], "insert": [], "alloc_with_evict": [], "drain": []}
    n_events = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for i, (prompt, full) in enumerate(reqs):
        s = clock()
        pages, node, _ = c.match_prefix(prompt)
        e = clock()
        c.lock(node)
        s2 = clock()
        new = c.alloc(-(-len(full) // ps) - len(pages))
        e2 = clock()
        c.insert(full, (pages, new))
        e3 = clock()
        c.unlock(node)
        a.free(new)
        if mode != "off" and (i + 1) % drain == 0:
            s4 = clock()
            if mode == "tuples":
                n_events += len(c.take_kv_events())
            else:
                ev = c.take_kv_events_batch()
                if pub is not None:
                    pub.publish(ev)
                n_events += len(ev)
            t["drain"].append(clock() - s4)
        if timed:
            t["match_prefix"].append(e - s)
            t["alloc_with_evict"].append(e2 - s2)
            t["insert"].append(e3 - e2)
    if mode != "off":
        n_events += len(c.take_kv_events())
    loop_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if pub is not None:
        pub.flush(60)
        cpu_s = time.process_time() - c0  # the publisher thread's encoding included
    out = {"loop_s": loop_s, "cpu_s": cpu_s, "events": n_events, "hit_rate": c.hit_tokens / max(1, c.hit_tokens + c.miss_tokens)}
    if timed:
        out["ops_per_s"] = {k: len(v) / (sum(v) / 1e9) for k, v in t.items() if v}
    return out


def report(paths):
    """Markdown tables of saved runs."""
    lines = []
    for path in paths:
        d = json.load(open(path))
        m = d["meta"]
        lines += [f"### `{os.path.basename(path)}`", "",
                  f"{m['machine']}; {m['date']}; {m['repeats']} repeats per mode, alternated; load average "
                  f"{m.get('loadavg_start', ['?'])[0]:.1f} at the start, {m['loadavg_end'][0]:.1f} at the end.", "",
                  "| workload | page | drain every | mode | loop s best | loop s median | vs off (best / median) | CPU s best | vs off CPU | extra us / request (best) | insert ops/s | match ops/s | alloc+evict ops/s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in d["results"]:
            off = r["modes"]["off"]
            for mode, x in r["modes"].items():
                ops = x["ops_per_s"]
                vs = "" if mode == "off" else f"{x['slowdown_best']:+.0%} / {x['slowdown_median']:+.0%}"
                cpu = "" if mode == "off" else f"{x['cpu_slowdown_best']:+.0%}"
                extra = "" if mode == "off" else f"{(x['cpu_s_best'] - off['cpu_s_best']) / r['requests'] * 1e6:.2f}"
                lines.append(f"| {r['workload']} | {r['page_size']} | {r['drain_every']} | {mode} | {x['loop_s_best']:.4f} | "
                             f"{x['loop_s_median']:.4f} | {vs} | {x['cpu_s_best']:.4f} | {cpu} | {extra} | "
                             f"{ops['insert']:,.0f} | {ops['match_prefix']:,.0f} | {ops['alloc_with_evict']:,.0f} |")
        lines.append("")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the markdown tables of saved runs and exit")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--drain", type=int, default=1, help="requests per take_kv_events (a serving step)")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "events_overhead.json"))
    ap.add_argument("--machine", default="CPU VM 2 cores, shared with other builds")
    args = ap.parse_args()
    if args.report:
        return report(args.report)
    load_start = os.getloadavg()
    pub = EventPublisher("inproc://bench-events", buffer_steps=1000)
    results = []
    for wname, make in WORKLOADS.items():
        reqs, pool = make()
        gc.collect()
        gc.freeze()
        for ps in args.page_sizes:
            row = {"workload": wname, "page_size": ps, "requests": len(reqs), "drain_every": args.drain, "modes": {}}
            timed = {m: replay(m, reqs, pool, ps, args.drain, True, pub if m == "publish" else None) for m in MODES}
            runs = {m: [] for m in MODES}
            for _ in range(args.repeats):
                for m in MODES:
                    runs[m].append(replay(m, reqs, pool, ps, args.drain, False, pub if m == "publish" else None))
            for m in MODES:
                loops = [r["loop_s"] for r in runs[m]]
                row["modes"][m] = {
                    "loop_s_best": min(loops), "loop_s_median": float(np.median(loops)), "loop_runs": loops,
                    "cpu_s_best": min(r["cpu_s"] for r in runs[m]), "events": runs[m][0]["events"],
                    "hit_rate": runs[m][0]["hit_rate"], "ops_per_s": timed[m]["ops_per_s"],
                }
            off = row["modes"]["off"]
            for m in MODES[1:]:
                r = row["modes"][m]
                r["slowdown_best"] = r["loop_s_best"] / off["loop_s_best"] - 1
                r["slowdown_median"] = r["loop_s_median"] / off["loop_s_median"] - 1
                r["cpu_slowdown_best"] = r["cpu_s_best"] / off["cpu_s_best"] - 1
            print(json.dumps({k: row[k] for k in ("workload", "page_size")}
                             | {m: {k: round(v, 4) for k, v in row["modes"][m].items() if k.startswith(("loop_s_", "slowdown", "cpu_"))} for m in MODES}), flush=True)
            results.append(row)
        gc.unfreeze()
    pub.close()
    meta = {"machine": args.machine, "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "repeats": args.repeats}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
