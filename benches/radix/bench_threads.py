"""Two Python threads on long `match_prefix` calls: does the GIL release let them overlap?

Setup: two radix caches (one per thread: a cache's calls take its mutex, so calls on one cache
serialize whatever the GIL does; a scheduler per model replica or per GPU has its own), each
holding one cached sequence of `--tokens` tokens at page_size 1 (the longest walk per token).
Timed: `--calls` full-length `match_prefix` calls per thread, first one thread (the other idle),
then both at once. Ratio = throughput of two threads / throughput of one (2.0 = perfect overlap;
about 1.0 when the GIL is held, as before issue 18).

Also measured: `gil_ticks` (steps of a GIL-yielding thread during long calls with the switch
interval at 30 s: shows the release whatever the load), one thread's CPU time / wall time (below
1.0 the machine is oversubscribed and the ratio cannot reach 2), and the longest stall of a "ticker" thread (sleeps 1 ms in a loop, records the longest
gap) while the main thread runs one long `match_prefix`: the GIL held through the call shows as a
stall of the call's length.

Usage: python benches/radix/bench_threads.py [--tokens 4194304] [--calls 8] [--rounds 3]
       [--out benches/radix/results/threads-<machine>.json]
"""

import argparse
import json
import os
import platform
import threading
import time

import numpy as np

import kvpool


def make_cache(tokens: np.ndarray) -> kvpool.RadixCache:
    a = kvpool.PageAllocator(len(tokens) + 1, 1)
    c = kvpool.RadixCache(a)
    p = c.alloc(len(tokens))
    c.insert(tokens, p)
    a.free(p)
    return c


def run(caches, tokens, calls: int) -> float:
    """Seconds for every cache in `caches` to run `calls` matches, one thread each."""
    start = threading.Barrier(len(caches) + 1)

    def work(c):
        start.wait()
        for _ in range(calls):
            c.match_prefix(tokens)

    threads = [threading.Thread(target=work, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def ticker_stall(cache, tokens) -> float:
    """Longest gap (ms) a 1 ms ticker thread sees while one match_prefix runs."""
    stop = threading.Event()
    gaps = []

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=tick)
    t.start()
    time.sleep(0.02)
    gaps.clear()
    cache.match_prefix(tokens)
    time.sleep(0.005)
    stop.set()
    t.join()
    return 1e3 * max(gaps)


def gil_ticks(cache, tokens, calls: int = 20) -> int:
    """Steps a thread that yields the GIL at every step makes while another runs `calls` long
    matches, with the switch interval at 30 s (no forced hand-over): 0-1 when the calls hold the
    GIL, hundreds when they release it. Independent of free cores, unlike the ratio."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    ticks, started, done = [0], threading.Event(), threading.Event()

    def b():
        started.set()
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0)

    def a():
        started.wait()
        for _ in range(calls):
            cache.match_prefix(tokens)
        done.set()

    ts = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    sys.setswitchinterval(old)
    return ticks[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1 << 22)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1 << 30, args.tokens, dtype=np.int32)
    caches = [make_cache(tokens), make_cache(tokens)]
    run(caches[:1], tokens, 1)  # warm
    rounds = []
    for _ in range(args.rounds):
        t1 = run(caches[:1], tokens, args.calls)
        t2 = run(caches, tokens, args.calls)
        rounds.append({"one_thread_s": t1, "two_threads_s": t2, "ratio": 2 * t1 / t2})
        print(f"1 thread {t1:.3f} s, 2 threads {t2:.3f} s: ratio {2 * t1 / t2:.2f}", flush=True)
    stall = [ticker_stall(caches[0], tokens) for _ in range(3)]
    ticks = gil_ticks(caches[0], tokens)
    cpu0, w0 = time.process_time(), time.perf_counter()
    run(caches[:1], tokens, args.calls)
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - w0)
    print(f"GIL-yielding thread steps during 20 long calls: {ticks}; one thread's CPU/wall {cpu_share:.2f}")
    per_call = min(r["one_thread_s"] for r in rounds) / args.calls
    print(f"match_prefix of {args.tokens} tokens: {1e3 * per_call:.1f} ms; ticker stall {min(stall):.2f} ms")
    result = {
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, shared by other agents)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokens": args.tokens,
        "calls_per_thread": args.calls,
        "match_prefix_ms": 1e3 * per_call,
        "rounds": rounds,
        "best_ratio": max(r["ratio"] for r in rounds),
        "median_ratio": sorted(r["ratio"] for r in rounds)[len(rounds) // 2],
        "ticker_stall_ms": stall,
        "gil_yield_steps_during_20_calls": ticks,
        "one_thread_cpu_over_wall": cpu_share,
        "load_avg": os.getloadavg(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
