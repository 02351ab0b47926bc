"""Retention priorities, pins with a budget, the `now=` clock and their bad inputs (issue 20).

The scenario of the issue: a pool of 64 pages, a priority-80 system prompt of 16 pages and 200
priority-0 chats of 4 pages each through it; the system prompt stays while its retention lasts
and ages out by LRU once it expired.
"""

import math

import kvpool
import numpy as np
import pytest
from kvpool import (
    InvalidArgumentError,
    LockError,
    PageAllocator,
    PinBudgetError,
    RadixCache,
    StaleNodeError,
)

PS = 4


class FakeClock:
    def __init__(self, t=0.0):
        self.t = t
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.t


def toks(*vals):
    return np.array(vals, dtype=np.int32)


def put(c, tokens, **kw):
    """A request finishing: pages for its tokens (evicting as needed), insert, free its own."""
    pages = c.alloc(-(-len(tokens) // c.page_size))
    c.insert(tokens, pages, **kw)
    c.allocator.free(pages)


def cached_paths(c):
    """Cached token paths, read without touching the cache's LRU or retention state."""
    return {tuple(t.tolist()) for t, _ in c.leaf_paths()}


def state(c):
    return (c.total_size, c.evictable_size, c.protected_size, c.pinned_tokens, c.allocator.ref_counts().tolist(),
            sorted(cached_paths(c)))


def run_scenario(system_priority):
    """The system prompt at `system_priority` (retention 30 s), then 200 four-page chats, one a
    second, each with its own tokens; for the first 100 s every 20th request reuses the system
    prompt (a hit renews its retention; 19 chats between hits fill the pool and more). Returns when the system prompt was evicted (None:
    never), the last hit, and the cache."""
    clock = FakeClock()
    a = PageAllocator(64, PS)
    c = RadixCache(a, PS, now=clock)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 1000, 16 * PS, dtype=np.int32)
    put(c, system, priority=system_priority, retention_s=30.0)
    sys_key = tuple(system.tolist())
    evicted_at, last_hit = None, 0.0
    for i in range(200):
        clock.t = float(i + 1)
        if clock.t <= 100 and i % 20 == 0:
            _, _, n = c.match_prefix(system)
            assert n == len(system) or evicted_at is not None
            last_hit = clock.t
        chat = (10_000 + 16 * i + np.arange(4 * PS)).astype(np.int32)  # 4 pages, unique
        put(c, chat)
        c.check_invariants()
        if evicted_at is None and sys_key not in cached_paths(c):
            evicted_at = clock.t
    return evicted_at, last_hit, c


def test_scenario_system_prompt_kept_while_retained_then_ages_out():
    evicted_at, last_hit, c = run_scenario(80)
    assert last_hit == 81.0
    # Kept through every chat while its retention lasted (the pool turned over many times)...
    assert evicted_at is not None and evicted_at >= last_hit + 30
    # ...and gone with the first chat after it expired: it is then the least recently used.
    assert evicted_at == last_hit + 30
    s = c.stats()
    assert s["retention_expiries"] == 1
    # Every eviction happened at priority 0: the system prompt decayed before it went.
    assert set(s["evicted_tokens_by_priority"]) == {0}
    assert s["evicted_tokens"] == s["evicted_tokens_by_priority"][0] == (16 + 200 * 4) * PS - c.total_size
    assert s["evicted_nodes"] == 1 + 200 - c.num_nodes
    # Hand-worked: the pool ends full of the last 16 chats (64 pages); five hits of 16 pages.
    assert (c.total_size, c.num_nodes, c.allocator.num_free) == (64 * PS, 16, 0)
    assert s["evicted_tokens"] == (16 + 200 * 4 - 64) * PS
    assert (s["hit_tokens"], s["miss_tokens"]) == (5 * 16 * PS, 0)


def test_scenario_control_without_priority_evicts_the_system_prompt_early():
    evicted_at, _, _ = run_scenario(0)
    # Plain LRU, hand-worked: 16 + 12 * 4 pages fill the pool at t = 12; chat 12 (t = 13) needs
    # pages and the system prompt (last used at t = 1, before chat 0 went in) is the LRU leaf.
    assert evicted_at == 13.0


def test_lowest_priority_first_then_lru():
    clock = FakeClock()
    c = RadixCache(PageAllocator(16, 1), now=clock)
    put(c, toks(1, 2), priority=50)  # oldest, kept longest
    put(c, toks(3, 4), priority=10)
    put(c, toks(5, 6))
    put(c, toks(7, 8))
    order = []
    while c.total_size:
        before = cached_paths(c)
        c.evict(1)
        order += sorted(before - cached_paths(c))
    assert order == [(5, 6), (7, 8), (3, 4), (1, 2)]
    assert c.stats()["evicted_tokens_by_priority"] == {0: 4, 10: 2, 50: 2}


def test_match_renews_retention_and_lower_priority_never_lowers():
    clock = FakeClock(100.0)
    c = RadixCache(PageAllocator(16, 1), now=clock)
    put(c, toks(1, 2), priority=60, retention_s=10)
    put(c, toks(1, 2, 3), priority=5)  # walks through [1, 2] at a lower priority
    put(c, toks(9))
    clock.t = 108.0
    c.match_prefix(toks(1, 2))  # renews [1, 2] until 118
    clock.t = 115.0
    c.evict(2)  # [9] and then [3] (priority 5) before [1, 2]
    assert cached_paths(c) == {(1, 2)}
    clock.t = 118.0
    assert c.stats()["retained_nodes"] == 0  # decayed
    assert c.stats()["retention_expiries"] == 1  # [1, 2] ([3] has no retention: it never decays)


def test_pins_budget_nesting_and_separate_from_locks():
    a = PageAllocator(16, 1)
    c = RadixCache(a, max_pinned_tokens=4)
    assert c.max_pinned_tokens == 4
    put(c, toks(1, 2, 3))
    put(c, toks(1, 2, 9))
    put(c, toks(7))
    _, ha, _ = c.match_prefix(toks(1, 2, 3))
    _, hb, _ = c.match_prefix(toks(1, 2, 9))
    _, hc, _ = c.match_prefix(toks(7))
    c.pin(ha)
    c.pin(ha)  # twice through one node: its tokens count once
    assert c.pinned_tokens == 3
    c.pin(hb)  # shares [1, 2] with ha: one new token
    assert c.pinned_tokens == 4 == c.stats()["pinned_tokens"]
    before = state(c)
    with pytest.raises(PinBudgetError, match=r"1 more tokens.*4 of the budget `max_pinned_tokens` = 4") as e:
        c.pin(hc)
    assert isinstance(e.value, LockError)
    assert state(c) == before
    # A pinned path survives eviction and cache.alloc; the rest goes.
    assert c.evict(100) == 1
    assert cached_paths(c) == {(1, 2, 3), (1, 2, 9)}
    with pytest.raises(kvpool.OutOfPagesError) as oom:
        c.alloc(a.num_free + 1)
    assert oom.value.evictable == 0
    # Pins and locks are separate counts.
    c.lock(hb)
    c.unpin(hb)
    with pytest.raises(LockError, match="holds no pin"):
        c.unpin(hb)
    with pytest.raises(LockError, match="holds no lock"):
        c.unlock(ha)
    assert c.protected_size == 4  # ha's path pinned, hb's leaf locked
    c.unlock(hb)
    c.unpin(ha)
    c.unpin(ha)
    assert (c.pinned_tokens, c.protected_size) == (0, 0)
    assert c.evict(100) == 4
    c.check_invariants()
    assert a.num_free == 16


def test_default_budget_is_zero_and_stale_pins_fail():
    c = RadixCache(PageAllocator(8, 1))
    put(c, toks(1, 2))
    _, h, _ = c.match_prefix(toks(1, 2))
    with pytest.raises(PinBudgetError, match="`max_pinned_tokens` = 0"):
        c.pin(h)
    c.evict(10)
    with pytest.raises(StaleNodeError):
        c.pin(h)
    with pytest.raises(StaleNodeError):
        c.unpin(h)


def test_reset_drops_pins_and_keeps_the_budget():
    a = PageAllocator(8, 1)
    c = RadixCache(a, max_pinned_tokens=8)
    put(c, toks(1, 2))
    _, h, _ = c.match_prefix(toks(1, 2))
    c.pin(h)
    c.reset()
    assert (c.pinned_tokens, c.max_pinned_tokens, c.total_size, a.num_free) == (0, 8, 0, 8)


def test_clock_is_read_before_any_lock():
    """A clock that calls into the cache (Python code) must not deadlock: it runs unlocked."""
    a = PageAllocator(8, 1)
    box = {}

    def clock():
        if "c" in box:
            box["seen"] = box["c"].total_size  # takes the cache's lock itself
        return 1.0

    c = RadixCache(a, now=clock)
    box["c"] = c
    put(c, toks(1, 2), priority=10, retention_s=5)
    c.match_prefix(toks(1, 2))
    c.evict(1)
    assert box["seen"] == 2
    assert c.stats()["evicted_nodes"] == 1


def test_default_clock_is_monotonic_seconds():
    c = RadixCache(PageAllocator(8, 1))
    put(c, toks(1), priority=10, retention_s=3600)
    assert c.stats()["retained_nodes"] == 1
    put(c, toks(2), priority=10, retention_s=0)
    assert c.stats()["retained_nodes"] == 1  # a retention of 0 is over at once


def test_bad_clock_readings():
    a = PageAllocator(8, 1)
    clock = FakeClock()
    c = RadixCache(a, now=clock)
    put(c, toks(1, 2))
    pages = a.alloc(3)
    before = state(c)
    for bad, exc, msg in [
        (math.nan, InvalidArgumentError, "`now`.* read `NaN`"),
        (math.inf, InvalidArgumentError, "read `inf`"),
        ("soon", TypeError, "`now\\(\\)` must return seconds as a float, got `'soon'`"),
    ]:
        clock.t = bad
        with pytest.raises(exc, match=msg):
            c.match_prefix(toks(1, 2))
        with pytest.raises(exc):
            c.insert(toks(1, 2, 3), pages, priority=3)
        with pytest.raises(exc):
            c.evict(1)
        assert state(c) == before
    clock.t = 5.0

    def broken():
        raise RuntimeError("clock down")

    c2 = RadixCache(PageAllocator(4, 1), now=broken)
    with pytest.raises(RuntimeError, match="clock down"):
        c2.alloc(1)
    assert c2.allocator.num_free == 4
    with pytest.raises(TypeError, match="`now` must be a callable"):
        RadixCache(PageAllocator(4, 1), now=3.0)


@pytest.mark.parametrize(
    ("kw", "exc", "msg"),
    [
        (dict(priority=101), InvalidArgumentError, r"`priority` = 101 is outside 0..=100"),
        (dict(priority=-1), InvalidArgumentError, r"`priority` = -1 is outside"),
        (dict(priority=2**70), InvalidArgumentError, r"`priority` = 1180591620717411303424 is outside"),
        (dict(priority="high"), TypeError, r"`priority` must be an int 0..=100, got `'high'`"),
        (dict(priority=True), TypeError, r"`priority` must be an int 0..=100, got the bool `True`"),
        (
            dict(priority=np.bool_(True)),
            TypeError,
            r"`priority` must be an int 0..=100, got a value of dtype `bool`",
        ),
        (dict(priority=np.int64(-3)), InvalidArgumentError, r"`priority` = -3 is outside 0..=100"),
        (
            dict(priority=np.uint64(2**64 - 1)),
            InvalidArgumentError,
            r"`priority` = 18446744073709551615 is outside",
        ),
        (dict(priority=2.0), TypeError, r"`priority` must be an int 0..=100, got `2.0`"),
        (dict(priority=5, retention_s=-1.0), InvalidArgumentError, r"`retention_s` = -1: a retention is"),
        (dict(priority=5, retention_s=math.nan), InvalidArgumentError, r"`retention_s` = NaN"),
    ],
)
def test_bad_priority_and_retention_change_nothing(kw, exc, msg):
    a = PageAllocator(8, 1)
    c = RadixCache(a)
    put(c, toks(1, 2))
    pages = a.alloc(3)
    before = state(c)
    with pytest.raises(exc, match=msg):
        c.insert(toks(1, 2, 3), pages, **kw)
    assert state(c) == before
    assert c.stats()["retained_nodes"] == 0


def test_numpy_integer_priorities_are_accepted():
    a = PageAllocator(8, 1)
    c = RadixCache(a)
    put(c, toks(1, 2), priority=np.int64(90))
    put(c, toks(3, 4), priority=np.uint8(0))
    c.evict(1)
    assert c.stats()["evicted_tokens_by_priority"] == {0: 2}


def test_hybrid_cache_takes_priorities_too():
    full, sl = PageAllocator(16, 1), PageAllocator(16, 1)
    c = RadixCache(full, sliding=[(sl, 4)])
    p1, s1 = c.alloc(2), c.alloc_sliding(0, 2)
    c.insert(toks(1, 2), p1, sliding_pages=[s1], priority=90)
    p2, s2 = c.alloc(2), c.alloc_sliding(0, 2)
    c.insert(toks(3, 4), p2, sliding_pages=[s2])
    for p, s in [(p1, s1), (p2, s2)]:
        full.free(p)
        sl.free(s)
    c.evict(1)
    assert cached_paths(c) == {(1, 2)}
    assert c.stats()["evicted_tokens_by_priority"] == {0: 2}
    with pytest.raises(InvalidArgumentError, match="`priority` = 200"):
        c.insert(toks(5, 6), c.alloc(2), sliding_pages=[c.alloc_sliding(0, 2)], priority=200)
    c.check_invariants()
