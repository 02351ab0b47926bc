"""Hypothesis state machine of retention: priorities, retention with a fake clock, pins within a
budget, and speculative rollback, on top of the radix state machine (test_radix_state_machine).

The model adds, per cached page entry, its priority, expiry time and retention (seconds), and its
pin count; per handle, the pins taken through it. Rules insert with priorities, move the fake
clock, pin and unpin (within and beyond the budget), and roll requests back. Checked after every
step, beside the base machine's checks:

- pinned tokens (each counted once) equal the model's and never exceed the budget;
- no pinned or locked entry is ever evicted;
- eviction takes the lowest current priority first, least recently used within one priority: no
  evicted entry has a higher (current priority, last use) than an evictable leaf that stays;
- protected tokens are those on locked or pinned paths;
- a rollback frees exactly the pages past the accepted length, never a tree page, and no page
  leaks (the base machine's reference counts).
"""

import math

import kvpool
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from kvpool import LockError, PageAllocator, PinBudgetError, RadixCache, StaleNodeError
from test_radix_state_machine import NAMESPACES, SETTINGS, CacheMachine, Entry

RETENTIONS = [None, 0.0, 1.0, 3.0, 10.0]


class RetentionMachine(CacheMachine):
    BUDGET = 6  # pages

    def __init__(self):
        super().__init__()
        ps = self.PAGE_SIZE
        self.a = PageAllocator(self.NUM_PAGES, ps)
        self.now = 0.0
        self.c = RadixCache(self.a, ps, max_pinned_tokens=self.BUDGET * ps, now=lambda: self.now)
        self.ret = {}  # key -> [priority, expiry, retention]
        self.pins = {}  # key -> pins on paths through it
        self.own_pins = {}  # own_key(handle) -> pins taken through it
        self.pending = (0, None)

    # --- model helpers ---------------------------------------------------------------------------

    def current(self, key):
        p, exp, _ = self.ret[key]
        return p if exp > self.now else 0

    def touch(self, ns, tokens, k):
        super().touch(ns, tokens, k)
        for j in range(1, k + 1):
            r = self.ret[self.key(ns, tokens, j)]
            if r[0] > 0 and r[1] != math.inf:
                if r[1] <= self.now:
                    r[0] = 0
                else:
                    r[1] = self.now + r[2]

    def pinned(self, key):
        return self.pins.get(key, 0) > 0

    def reclaimable(self):
        return sum(
            1 for k, e in self.entries.items() if e.lock == 0 and not self.pinned(k) and self.refs[e.page] == 1
        )

    def do_insert(self, ns, tokens, arg):
        ps = self.PAGE_SIZE
        k = self.longest(ns, tokens)
        p, r = self.pending
        assert self.c.insert(tokens, arg, namespace=NAMESPACES[ns], priority=p, retention_s=r) == k * ps
        if isinstance(arg, (tuple, list)):
            parts = [np.asarray(x, dtype=np.int64) for x in arg]
            arg = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.clock += 1
        self.touch(ns, tokens, k)
        for j in range(k + 1, len(tokens) // ps + 1):
            self.serial += 1
            key = self.key(ns, tokens, j)
            self.entries[key] = Entry(int(arg[j - 1]), self.clock, 0, self.serial)
            self.refs[int(arg[j - 1])] += 1
            self.ret[key] = [0, 0.0, math.inf]
        if p > 0:
            ret = math.inf if r is None else r
            for j in range(1, len(tokens) // ps + 1):
                m = self.ret[self.key(ns, tokens, j)]
                if m[0] > 0 and m[1] <= self.now:
                    m[0] = 0  # expired (the cache decayed it, or does now)
                if p > m[0]:
                    m[:] = [p, self.now + ret, ret]
                elif p == m[0]:
                    m[1], m[2] = max(m[1], self.now + ret), max(m[2], ret)

    def sync_evictions(self):
        real = self.real_entries()
        assert set(real) <= set(self.entries), "eviction cannot add entries"
        removed = [k for k in self.entries if k not in real]
        has_child_before = {(ns, prefix[: -self.PAGE_SIZE]) for ns, prefix in self.entries}
        for k in removed:
            assert self.entries[k].lock == 0, f"locked entry {k} evicted"
            assert not self.pinned(k), f"pinned entry {k} evicted"
        # Leaves before the eviction that stay and could have gone: none may rank below an
        # evicted entry (parents exposed by the eviction itself were no leaves when it chose).
        stay = [
            k for k in real
            if k not in has_child_before and self.entries[k].lock == 0 and not self.pinned(k)
        ]
        rank = lambda k: (self.current(k), self.entries[k].time)  # noqa: E731
        if removed and stay:
            worst = max(rank(k) for k in removed)
            best = min(rank(k) for k in stay)
            assert worst <= best, f"evicted {worst} while {best} stays"
        for k in removed:
            self.refs[self.entries.pop(k).page] -= 1
            del self.ret[k]
            self.pins.pop(k, None)
        return len(removed)

    def do_evict(self, n):
        freed = self.c.evict(n)
        removed = self.sync_evictions()
        assert freed == removed * self.PAGE_SIZE
        if freed < n:
            assert all(e.lock > 0 or self.pinned(k) for k, e in self.entries.items()), "stopped early"

    # --- rules -----------------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, 20.0]))
    def advance(self, dt):
        self.now += dt

    @rule(p=st.sampled_from([0, 10, 50, 100]), r=st.sampled_from(RETENTIONS), ns=st.integers(0, len(NAMESPACES) - 1),
          reuse=st.booleans(), partial=st.booleans(), keep=st.booleans(), data=st.data())
    def insert_retained(self, p, r, ns, reuse, partial, keep, data):
        self.pending = (p, r)
        try:
            CacheMachine.insert(self, ns, reuse, partial, keep, data)
        finally:
            self.pending = (0, None)

    @rule(p=st.sampled_from([10, 50, 100]), r=st.sampled_from(RETENTIONS), ns=st.integers(0, len(NAMESPACES) - 1),
          parts=st.booleans(), data=st.data())
    def serve_retained(self, p, r, ns, parts, data):
        self.pending = (p, r)
        try:
            CacheMachine.serve(self, ns, parts, data)
        finally:
            self.pending = (0, None)

    @rule(how=st.sampled_from(["priority", "retention"]), data=st.data())
    def bad_retain(self, how, data):
        tokens = data.draw(self.tokens(self.PAGE_SIZE))
        kw = dict(priority=data.draw(st.sampled_from([-1, 101, 1000]))) if how == "priority" else dict(
            priority=5, retention_s=data.draw(st.sampled_from([-1.0, math.nan])))
        pages = np.arange(1, len(tokens) // self.PAGE_SIZE + 1, dtype=np.int32)
        before = (self.c.total_size, self.a.ref_counts().tolist(), self.c.stats())
        with pytest.raises(kvpool.InvalidArgumentError):
            self.c.insert(tokens, pages, **kw)
        assert (self.c.total_size, self.a.ref_counts().tolist(), self.c.stats()) == before

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def pin(self, data):
        h = data.draw(st.sampled_from(self.handles))
        if not self.valid(h):
            with pytest.raises(StaleNodeError):
                self.c.pin(h[0])
            return
        path = self.path(h[1]) if h[1] is not None else []
        new = sum(1 for k in path if not self.pinned(k))
        used = sum(1 for k in self.entries if self.pinned(k))
        if used + new > self.BUDGET:
            before = (self.c.pinned_tokens, self.c.protected_size)
            with pytest.raises(PinBudgetError):
                self.c.pin(h[0])
            assert (self.c.pinned_tokens, self.c.protected_size) == before
            return
        self.c.pin(h[0])
        self.own_pins[self.own_key(h)] = self.own_pins.get(self.own_key(h), 0) + 1
        for k in path:
            self.pins[k] = self.pins.get(k, 0) + 1

    @precondition(lambda self: self.handles)
    @rule(pinned_one=st.booleans(), data=st.data())
    def unpin(self, pinned_one, data):
        pinned = [h for h in self.handles if self.valid(h) and self.own_pins.get(self.own_key(h), 0) > 0]
        h = data.draw(st.sampled_from(pinned if pinned_one and pinned else self.handles))
        if not self.valid(h):
            with pytest.raises(StaleNodeError):
                self.c.unpin(h[0])
        elif self.own_pins.get(self.own_key(h), 0) == 0:
            with pytest.raises(LockError):
                self.c.unpin(h[0])
        else:
            self.c.unpin(h[0])
            self.own_pins[self.own_key(h)] -= 1
            for k in self.path(h[1]) if h[1] is not None else []:
                self.pins[k] -= 1

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), data=st.data())
    def speculative_rollback(self, ns, data):
        """A request that matched a prefix (the tree's pages, locked) wrote drafts into new pages;
        verification keeps `accepted` tokens: rollback frees the new pages past it only."""
        ps = self.PAGE_SIZE
        tokens = self.draw_tokens(data)
        handle, matched = self.do_match(ns, tokens)
        self.do_lock(handle)
        n = len(matched) * ps
        extra = data.draw(st.integers(1, 3 * ps))
        need = -(-(n + extra) // ps) - len(matched)
        if need > self.free_pages() + self.reclaimable():
            self.do_unlock(handle)
            return
        new = self.c.alloc(need)
        self.sync_evictions()
        self.take(new)
        row = np.zeros((1, 8), dtype=np.int32)
        row[0, : len(matched) + len(new)] = np.concatenate([matched, new])
        acc = data.draw(st.integers(n, n + extra))
        lens = lambda x: np.array([x], dtype=np.int32)  # noqa: E731
        if data.draw(st.booleans()):  # accepted beyond what was written: refused, nothing changes
            before = self.a.ref_counts().tolist()
            with pytest.raises(kvpool.BatchError, match=r"`accepted_lens\[0\]` = \d+ exceeds"):
                kvpool.rollback_slots(row, lens(n + extra), lens(n + extra + 1), ps, cached_lens=lens(n))
            assert self.a.ref_counts().tolist() == before
        free, new_lens = kvpool.rollback_slots(row, lens(n + extra), lens(acc), ps, cached_lens=lens(n))
        keep = -(-acc // ps)
        assert free.tolist() == row[0, keep : -(-(n + extra) // ps)].tolist()
        assert new_lens.tolist() == [acc]
        assert not set(free.tolist()) & {e.page for e in self.entries.values()}, "a tree page rolled back"
        self.a.free(free)
        for x in free.tolist():
            self.refs[x] -= 1
        del self.requests[next(i for i, r in enumerate(self.requests) if r is new)]
        kept = row[0, len(matched) : keep].copy()
        self.requests.append(kept)
        self.do_unlock(handle)

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def cache_matches_model(self):
        ps = self.PAGE_SIZE
        held = sum(1 for k, e in self.entries.items() if e.lock > 0 or self.pinned(k))
        pinned = sum(1 for k in self.entries if self.pinned(k))
        assert self.c.total_size == len(self.entries) * ps
        assert self.c.protected_size == held * ps
        assert self.c.pinned_tokens == pinned * ps <= self.BUDGET * ps
        # (this replaces the base machine's invariant of the same name: keep its size identity)
        assert self.c.evictable_size == (len(self.entries) - held) * ps
        assert (self.c.hit_tokens, self.c.miss_tokens) == (self.hit, self.miss)
        assert self.real_entries() == {k: e.page for k, e in self.entries.items()}
        self.c.check_invariants()

    @rule(go=st.integers(0, 9))
    def reset(self, go):
        epoch = self.epoch
        CacheMachine.reset(self, go)
        if self.epoch != epoch:  # reset ran: pins go with everything else
            self.ret.clear()
            self.pins.clear()
            self.own_pins.clear()


class RetentionMachinePage4(RetentionMachine):
    PAGE_SIZE = 4
    NUM_PAGES = 16


TestRetentionPageSize1 = RetentionMachine.TestCase
TestRetentionPageSize1.settings = SETTINGS
TestRetentionPageSize4 = RetentionMachinePage4.TestCase
TestRetentionPageSize4.settings = SETTINGS
