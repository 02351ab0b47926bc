"""Two Python threads on long `match_prefix` calls: does the GIL release let them overlap?

Setup: two radix caches (one per thread: a cache's calls take its mutex, so calls on one cache
serialize whatever the GIL does; a scheduler per model replica or per GPU has its own), each
holding one cached sequence of `--tokens` tokens at page_size 1 (the longest walk per token).
Timed: `--calls` full-length `match_prefix` calls per thread, first one thread (the other idle),
then both at once. Ratio = throughput of two threads / throughput of one (2.0 = perfect overlap;
about 1.0 when the GIL is held, as before issue 18).

Also measured: the CPU time per call in one and in two threads (their quotient, times 2, is the
ratio two free cores allow once the GIL is not held: memory-bandwidth contention lowers it),
`gil_ticks` (steps of a GIL-yielding thread during long calls with the switch
interval at 30 s: shows the release whatever the load), one thread's CPU time / wall time (below
1.0 the machine is oversubscribed and the ratio cannot reach 2), and the longest stall of a
"ticker" thread (sleeps 0.5 ms in a loop, records the longest gap) while the main thread runs
one long `match_prefix` and drops its result, with int32 and int64 tokens, over 30 calls: the
GIL held for X ms shows as a stall of X ms or more in every call (the minimum over calls is the
estimate on a loaded machine, where the ticker also waits for a core), reported against the
call's time.

Usage: python benches/radix/bench_threads.py [--tokens 4194304] [--calls 8] [--rounds 3]
       [--out benches/radix/results/threads-<machine>.json] [--machine 'CPU VM 2 cores, loaded']
"""

import argparse
import json
import os
import platform
import threading
import time

import kvpool
import numpy as np


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


def ticker_stall(cache, tokens) -> tuple[float, float]:
    """(longest gap in ms a 0.5 ms ticker thread sees while one match_prefix runs and its result
    is dropped, that call's ms). The GIL held for X ms shows as a gap of X ms or more."""
    stop, go, gap = threading.Event(), threading.Event(), [0.0]

    def tick():
        # (a running maximum: growing a list of gaps would take the memory-map lock, which the
        # call's page faults and frees contend for, and measure that instead of the GIL)
        last, m = time.perf_counter(), 0.0
        go.set()
        while not stop.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            m = max(m, now - last) if not go.is_set() else 0.0
            last = now
        gap[0] = m

    t = threading.Thread(target=tick)
    t.start()
    go.wait()
    time.sleep(0.01)
    go.clear()
    t0 = time.perf_counter()
    r = cache.match_prefix(tokens)
    call = time.perf_counter() - t0
    del r
    time.sleep(0.003)
    stop.set()
    t.join()
    return 1e3 * gap[0], 1e3 * call


def stalls(cache, tokens, n: int = 30) -> dict:
    """`ticker_stall` over `n` calls. On a loaded machine a ticker also waits for a core, so the
    minimum over calls is the estimate of the GIL-held stretch (every call holds it as long)."""
    rows = [ticker_stall(cache, tokens) for _ in range(n)]
    ratio = sorted(s / c for s, c in rows)
    st = sorted(s for s, _ in rows)
    ca = sorted(c for _, c in rows)
    return {
        "stall_ms_min": st[0],
        "stall_ms_median": st[n // 2],
        "call_ms_min": ca[0],
        "call_ms_median": ca[n // 2],
        "stall_over_call_min": ratio[0],
        "stall_over_call_median": ratio[n // 2],
    }


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
    ap.add_argument("--machine", default="CPU VM 2 cores", help="recorded in the result")
    ap.add_argument("--build", default="", help="which kvpool build ran, recorded in the result")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1 << 30, args.tokens, dtype=np.int32)
    caches = [make_cache(tokens), make_cache(tokens)]
    run(caches[:1], tokens, 1)  # warm
    rounds = []
    for _ in range(args.rounds):
        c0 = time.process_time()
        t1 = run(caches[:1], tokens, args.calls)
        c1 = time.process_time()
        t2 = run(caches, tokens, args.calls)
        c2 = time.process_time()
        rounds.append(
            {
                "one_thread_s": t1,
                "two_threads_s": t2,
                "ratio": 2 * t1 / t2,
                # CPU per call: more with two threads = contention for memory bandwidth and caches
                "cpu_ms_per_call_one_thread": 1e3 * (c1 - c0) / args.calls,
                "cpu_ms_per_call_two_threads": 1e3 * (c2 - c1) / (2 * args.calls),
            }
        )
        print(f"1 thread {t1:.3f} s, 2 threads {t2:.3f} s: ratio {2 * t1 / t2:.2f}", flush=True)
    t64 = tokens.astype(np.int64)
    stall = {"int32": stalls(caches[0], tokens), "int64": stalls(caches[0], t64)}
    ticks = gil_ticks(caches[0], tokens)
    cpu0, w0 = time.process_time(), time.perf_counter()
    run(caches[:1], tokens, args.calls)
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - w0)
    print(f"GIL-yielding thread steps during 20 long calls: {ticks}; CPU/wall {cpu_share:.2f}")
    per_call = min(r["one_thread_s"] for r in rounds) / args.calls
    cpu1 = min(r["cpu_ms_per_call_one_thread"] for r in rounds)
    cpu2 = min(r["cpu_ms_per_call_two_threads"] for r in rounds)
    # (the ratio two free cores allow once the GIL is not held: one thread's CPU per call over
    # two threads'; it says nothing of GIL serialization, which costs no CPU: see ticker_stall)
    ceiling = 2 * cpu1 / cpu2
    print(f"CPU per call: {cpu1:.2f} ms in one thread, {cpu2:.2f} ms in two: {ceiling:.2f}")
    print(f"match_prefix of {args.tokens} tokens: {1e3 * per_call:.1f} ms")
    for dt, st in stall.items():
        print(
            f"{dt} tokens: ticker stall min {st['stall_ms_min']:.2f} ms"
            f" (median {st['stall_ms_median']:.2f}) on calls of min {st['call_ms_min']:.2f} ms"
            f" (median {st['call_ms_median']:.2f}): stall/call min"
            f" {st['stall_over_call_min']:.2f}, median {st['stall_over_call_median']:.2f}"
        )
    result = {
        "machine": f"{args.machine} ({platform.machine()}, {os.cpu_count()} CPUs)",
        "build": args.build,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokens": args.tokens,
        "calls_per_thread": args.calls,
        "match_prefix_ms": 1e3 * per_call,
        "rounds": rounds,
        "best_ratio": max(r["ratio"] for r in rounds),
        "median_ratio": sorted(r["ratio"] for r in rounds)[len(rounds) // 2],
        "ticker_stall": stall,
        "gil_yield_steps_during_20_calls": ticks,
        "one_thread_cpu_over_wall": cpu_share,
        "ratio_ceiling_from_cpu": ceiling,
        "load_avg": os.getloadavg(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
