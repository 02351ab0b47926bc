"""Retention priorities: the radix replay (W1 system_prompts, W2 conversations of bench_radix.py)
with priorities off and on, and evict calls/s on a tree of 10^5 leaves.

Replay: bench_radix's loop per request (match_prefix, lock, cache.alloc, insert, unlock, free).
"off" is the plain insert. "on" passes `insert(..., priority=50, retention_s=3600)` on the default
monotonic clock: every node carries a priority with an expiry (indexed, renewed by every hit,
re-keyed), but one priority for all keeps the eviction order of "off", so the two do the same
work and the difference is the cost of priorities. "mixed" passes `priority=p, retention_s=0.05`
with p cycling 0, 20, 50, 80 over the requests: priorities then reorder eviction and expire
during the replay, which changes what is cached (its hit rate is reported: the work differs, so
its time is no overhead figure). The modes run interleaved (order alternating) in one process
per (workload, page size), best loop of
`--repeats` each, as wall time and as the thread's CPU time (the machine is shared: CPU time is
what the loop itself spent); `--base PATH` also times the same loop on another build of kvpool (the
python/ directory of a checkout without retention) in its own subprocess.

Evict: 10^5 one-page leaves (page size 16, distinct first tokens), then `evict(16)` calls, each
evicting one leaf, timed over 20,000 calls. "off": all priority 0; "same": all priority 50 with
retentions log-uniform in 1 s..1,000 s (the cost of the expiry index, the order as "off"); "on":
random priorities 0..100 with those retentions, the clock still; "sorted": the same leaves
inserted in their eviction order, so that eviction walks the node slots in memory order as "off"
does (on minus sorted is the cache-miss cost of evicting in an order unrelated to memory, not
work); "expiring": "on" with a fake clock that advances 1 ms per call, so about 40% of the
leaves' priorities decay during the run (each decay re-keys a leaf). All read the clock through a
Python `now=` callable. calls/s from the summed per-call wall times, and per CPU second of the
whole loop.

Usage: python benches/radix/bench_retention.py [--quick] [--base /path/to/other/python]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MACHINE = "CPU VM 2 cores, shared with other builds"


def replay(reqs, pool, ps, mode):
    import kvpool

    a = kvpool.PageAllocator(pool // ps, ps)
    c = kvpool.RadixCache(a, ps)
    prios = (0, 20, 50, 80)
    t0, c0 = time.perf_counter(), time.thread_time()
    if mode == "mixed":
        for i, (prompt, full) in enumerate(reqs):
            pages, node, _ = c.match_prefix(prompt)
            c.lock(node)
            new = c.alloc(-(-len(full) // ps) - len(pages))
            c.insert(full, (pages, new), priority=prios[i % 4], retention_s=0.05)
            c.unlock(node)
            a.free(new)
    elif mode == "on":
        for prompt, full in reqs:
            pages, node, _ = c.match_prefix(prompt)
            c.lock(node)
            new = c.alloc(-(-len(full) // ps) - len(pages))
            c.insert(full, (pages, new), priority=50, retention_s=3600.0)
            c.unlock(node)
            a.free(new)
    else:
        for prompt, full in reqs:
            pages, node, _ = c.match_prefix(prompt)
            c.lock(node)
            new = c.alloc(-(-len(full) // ps) - len(pages))
            c.insert(full, (pages, new))
            c.unlock(node)
            a.free(new)
    dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
    stats = c.stats() if hasattr(c, "stats") else {}
    return dt, cpu, c.hit_tokens / max(1, c.hit_tokens + c.miss_tokens), stats


def child_replay(workload, ps, repeats, modes):
    import gc

    from bench_radix import WORKLOADS

    reqs, pool = WORKLOADS[workload]()
    gc.collect()
    gc.freeze()
    out = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    info = {}
    replay(reqs, pool, ps, "off")  # warm-up
    for i in range(repeats):
        for m in modes if i % 2 == 0 else modes[::-1]:  # alternate the order
            dt, t, hit, stats = replay(reqs, pool, ps, m)
            out[m].append(dt)
            cpu[m].append(t)
            info[m] = {"hit_rate": hit, "stats": {k: v for k, v in stats.items() if k != "evicted_tokens_by_priority"},
                       "evicted_tokens_by_priority": {str(k): v for k, v in stats.get("evicted_tokens_by_priority", {}).items()}}
    print(json.dumps({"workload": workload, "page_size": ps, "loops": out, "loops_cpu": cpu, "info": info}))


def child_evict(n_leaves, calls, mode):
    import kvpool

    ps = 16
    t = [0.0]
    a = kvpool.PageAllocator(n_leaves + 16, ps)
    c = kvpool.RadixCache(a, ps, now=lambda: t[0])
    rng = np.random.default_rng(3)
    base = np.arange(ps, dtype=np.int32)
    t_build = time.perf_counter()
    pages = a.alloc(n_leaves)
    prios = rng.integers(0, 101, n_leaves)
    rets = 10.0 ** rng.uniform(0, 3, n_leaves)
    # "sorted": the same leaves inserted in their eviction order (slots follow it in memory).
    order = np.lexsort((np.arange(n_leaves), prios)) if mode == "sorted" else np.arange(n_leaves)
    for i in order:
        toks = base + i * ps
        if mode == "off":
            c.insert(toks, pages[i : i + 1])
        elif mode == "same":
            c.insert(toks, pages[i : i + 1], priority=50, retention_s=float(rets[i]))
        else:
            c.insert(toks, pages[i : i + 1], priority=int(prios[i]), retention_s=float(rets[i]))
    a.free(pages)
    t_build = time.perf_counter() - t_build
    clock = time.perf_counter_ns
    ts = np.empty(calls)
    c0 = time.thread_time()
    for k in range(calls):
        t[0] += 0.001 if mode == "expiring" else 0.0
        s = clock()
        c.evict(ps)
        ts[k] = clock() - s
    cpu = time.thread_time() - c0
    stats = c.stats()
    print(json.dumps({"mode": mode, "leaves": n_leaves, "calls": calls,
                      "calls_per_s": calls / (ts.sum() / 1e9), "calls_per_cpu_s": calls / cpu, "p50_us": float(np.median(ts)) / 1e3,
                      "p99_us": float(np.percentile(ts, 99)) / 1e3, "build_s": t_build,
                      "retention_expiries": stats["retention_expiries"], "left": c.num_nodes}))


def run(args, env=None):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], check=True, capture_output=True, text=True,
                         env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--base", help="python/ directory of a kvpool build without retention, timed the same way")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "retention.json"))
    ap.add_argument("--child-replay", nargs=3, metavar=("WORKLOAD", "PAGE_SIZE", "MODES"))
    ap.add_argument("--child-evict", nargs=3, metavar=("LEAVES", "CALLS", "MODE"))
    a = ap.parse_args()
    if a.child_replay:
        w, ps, modes = a.child_replay
        child_replay(w, int(ps), a.repeats, modes.split(","))
        return
    if a.child_evict:
        n, calls, on = a.child_evict
        child_evict(int(n), int(calls), on)
        return
    repeats = 2 if a.quick else a.repeats
    load0 = os.getloadavg()
    res = {"machine": {"kind": MACHINE, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version(), "loadavg_start": load0},
           "replay": [], "replay_base": [], "evict": []}
    for w in ("system_prompts", "conversations"):
        for ps in (1, 16):
            r = run(["--child-replay", w, str(ps), "off,on,mixed", "--repeats", str(repeats)])
            off, on = min(r["loops"]["off"]), min(r["loops"]["on"])
            coff, con = min(r["loops_cpu"]["off"]), min(r["loops_cpu"]["on"])
            r.update(off_best_s=off, on_best_s=on, on_vs_off=on / off, off_best_cpu_s=coff, on_best_cpu_s=con,
                     on_vs_off_cpu=con / coff)
            res["replay"].append(r)
            cmix = min(r["loops_cpu"]["mixed"])
            r.update(mixed_best_cpu_s=cmix)
            hits = {m: round(r["info"][m]["hit_rate"], 3) for m in ("off", "on", "mixed")}
            print(f"{w:15s} ps={ps:2d} wall off {off:.4f}s on {on:.4f}s on/off {on / off:.3f} | "
                  f"CPU off {coff:.4f}s on {con:.4f}s on/off {con / coff:.3f} | mixed CPU {cmix:.4f}s | hit {hits}",
                  flush=True)
            if a.base:
                env = dict(os.environ, PYTHONPATH=a.base + os.pathsep + HERE)
                b = run(["--child-replay", w, str(ps), "off", "--repeats", str(repeats)], env=env)
                b["off_best_s"], b["off_best_cpu_s"] = min(b["loops"]["off"]), min(b["loops_cpu"]["off"])
                res["replay_base"].append(b)
                print(f"{'':15s}        base build: wall {b['off_best_s']:.4f}s CPU {b['off_best_cpu_s']:.4f}s", flush=True)
    n, calls = (20_000, 5_000) if a.quick else (100_000, 20_000)
    for mode in ("off", "same", "on", "sorted", "expiring"):
        r = run(["--child-evict", str(n), str(calls), mode])
        res["evict"].append(r)
        print(f"evict {r['mode']:8s} {r['leaves']} leaves: {r['calls_per_s']:,.0f} calls/s "
              f"({r['calls_per_cpu_s']:,.0f} per CPU s) p50 {r['p50_us']:.2f}us "
              f"p99 {r['p99_us']:.2f}us expiries {r['retention_expiries']}", flush=True)
    res["machine"]["loadavg_end"] = os.getloadavg()
    if not a.quick:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
