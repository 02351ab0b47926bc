"""Issue 18, concurrency: how long a long call holds the GIL, against how long it runs.

A probe thread loops on ``time.sleep(0)`` (which hands the GIL to a thread waiting for it) and
records its longest gap while the main thread runs one long call and drops its result: a call
that holds the GIL for X ms shows as a gap of X ms or more. The bound is a ratio to the call's own
time, and every call holds the GIL as long, so the best of several calls is taken: on a loaded
machine the probe also waits for a core, which only lengthens some gaps. Before the fix the
input's copy and checks (and the int64 narrowing) ran with the GIL held: the best share was
0.28-0.75 on a loaded 2-core machine (1.5 on an idle one, where the result's free added to it);
now the GIL is held for microseconds, and the best share is 0.01-0.1.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kvpool
import pytest

PKG_ROOT = str(Path(kvpool.__file__).resolve().parent.parent)

# A gap above this share of the call's time means O(n) work ran with the GIL held.
BOUND = 0.2

CHILD = """
import sys, threading, time, numpy as np, kvpool
n = 1 << 22
toks = np.random.default_rng(0).integers(0, 1 << 30, n, dtype=np.int32)
a = kvpool.PageAllocator(n + 1, 1); c = kvpool.RadixCache(a)
pages = c.alloc(n); c.insert(toks, pages); a.free(pages)

def held(call):
    # The probe's longest gap over the call's time, for one call and the drop of its result. (The
    # probe allocates nothing as it runs: growing a list would take the process's memory-map
    # lock, which the call's page faults and frees contend for, and measure that instead.)
    stop, go, gap = threading.Event(), threading.Event(), [0.0]
    def probe():
        last = time.perf_counter(); go.set(); m = 0.0
        while not stop.is_set():
            time.sleep(0)
            now = time.perf_counter(); m = max(m, now - last); last = now
            if go.is_set(): m = 0.0  # (the call has not started yet)
        gap[0] = m
    t = threading.Thread(target=probe); t.start(); go.wait(); time.sleep(0.002)
    go.clear()
    t0 = time.perf_counter(); r = call(); dt = time.perf_counter() - t0; del r
    time.sleep(0.002); stop.set(); t.join()
    return gap[0] / dt

calls = {
    "match_prefix int32": lambda: c.match_prefix(toks),
    "match_prefix int64": lambda: c.match_prefix(t64),
    "insert int32": lambda: c.insert(toks, pages),
    "insert int64": lambda: c.insert(t64, pages),
}
t64 = toks.astype(np.int64)
for name, call in calls.items():
    call()  # warm
    best = min(held(call) for _ in range(12))
    print(f"{name}: {best:.3f}")
"""


def run_child() -> dict[str, float]:
    """One child run: each call's best share (see `CHILD`)."""
    env = dict(os.environ, PYTHONPATH=PKG_ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    shares = {
        line.rsplit(":", 1)[0]: float(line.rsplit(":", 1)[1])
        for line in r.stdout.strip().splitlines()
    }
    assert len(shares) == 4, r.stdout
    return shares


def test_long_calls_hold_the_gil_for_a_small_share_of_their_time():
    # Up to 5 runs, keeping each call's best: a loaded machine delays the probe in some runs
    # (a share of 0.1-0.22 was seen at a load of 10 on 2 cores); the GIL held never improves.
    best: dict[str, float] = {}
    for _ in range(5):
        for k, v in run_child().items():
            best[k] = min(v, best.get(k, v))
        if max(best.values()) < BOUND:
            break
    held = {k: v for k, v in best.items() if v >= BOUND}
    assert not held, f"the GIL was held for this share of a long call's time: {best}"


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_long_calls_keep_their_results(dtype):
    """The long path (GIL released, input read in place or narrowed into a scratch buffer)
    returns what the short path returns, and a bad token still raises and changes nothing."""
    import numpy as np

    n = 1 << 15
    toks = np.random.default_rng(1).integers(0, 1 << 30, n).astype(dtype)
    a = kvpool.PageAllocator(n + 1, 1)
    c = kvpool.RadixCache(a)
    p = c.alloc(n)
    assert c.insert(toks, p) == 0
    a.free(p)
    for m in (n, n - 1, 1 << 14, 100):  # long and short calls
        pages, node, k = c.match_prefix(toks[:m])
        assert k == m and pages.tolist() == p[:m].tolist()
    bad = toks.copy()
    bad[n - 7] = -3
    before = (c.total_size, c.hit_tokens, c.miss_tokens, c.num_nodes)
    with pytest.raises(kvpool.InvalidArgumentError, match=rf"token `-3` at index {n - 7}"):
        c.match_prefix(bad)
    with pytest.raises(kvpool.InvalidArgumentError, match=rf"token `-3` at index {n - 7}"):
        c.insert(bad, p)
    assert (c.total_size, c.hit_tokens, c.miss_tokens, c.num_nodes) == before
    if dtype == "int64":
        big = toks.copy()
        big[n - 2] = 1 << 40
        with pytest.raises(kvpool.InvalidArgumentError, match=str(1 << 40)):
            c.match_prefix(big)
    c.check_invariants()


def test_long_debug_grants_and_frees():
    """A debug-mode allocator's long `alloc` fills its grant buffer with the GIL released; the
    array still carries the generations (a free after reuse is caught) and long frees copy the
    ids before checking them."""
    import numpy as np

    n = 1 << 14
    a = kvpool.PageAllocator(2 * n, 1, debug=True)
    p = a.alloc(n)
    assert p.dtype == np.int32 and p.shape == (n,) and len(set(p.tolist())) == n
    a.free(p)
    q = a.alloc(2 * n)
    with pytest.raises(kvpool.PageError):
        a.free(p)  # stale: its pages were handed out again
    assert a.num_used == 2 * n
    a.free(q.astype(np.int64))  # (a copy: not checked, freed through the int64 path)
    assert a.num_used == 0
