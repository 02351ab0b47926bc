"""Hypothesis state machines: PageAllocator + RadixCache against a small pure-Python model.

The model keeps one entry per cached page, keyed by (namespace, token prefix up to and including
that page), with its page id, last access time and lock count; and one reference count per page
(requests' references plus the cache's). It knows nothing of nodes or splits. After every step:

- free + referenced pages == capacity, and every page's reference count equals its holders;
- the cache holds exactly the model's entries (same pages), and evictable + protected == cached,
  with protected == the tokens of locked entries;
- match_prefix returns exactly the longest cached page-aligned prefix;
- eviction removes only unlocked entries, least recently used first (no evicted entry was used
  after an unlocked leaf that stays), frees what it reports, and reaches its goal if it can;
- the Rust tree's own structural check passes.

Profiles: the default (CI) runs a few thousand steps per page size in well under a minute;
KVPOOL_HYPOTHESIS_PROFILE=long runs far more.
"""

import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool import (
    CacheBusyError,
    LockError,
    OutOfPagesError,
    PageAllocator,
    PageError,
    RadixCache,
    StaleNodeError,
)

PROFILES = {
    "ci": dict(max_examples=100, stateful_step_count=50, derandomize=True),
    "long": dict(max_examples=2000, stateful_step_count=100),
}
PROFILE = os.environ.get("KVPOOL_HYPOTHESIS_PROFILE", "ci")
SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    **PROFILES[PROFILE],
)

NAMESPACES = [None, ("lora", 1), ("lora", 2), (("salt", "a"),)]


@dataclass
class Entry:
    page: int
    time: int
    lock: int
    serial: int


class CacheMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    NUM_PAGES = 24

    def __init__(self):
        super().__init__()
        ps = self.PAGE_SIZE
        self.a = PageAllocator(self.NUM_PAGES, ps)
        self.c = RadixCache(self.a, ps)
        self.refs = Counter()  # page -> references (requests + cache)
        self.entries = {}  # (ns_index, prefix tuple) -> Entry
        self.requests = []  # arrays of pages, one reference each
        self.handles = []  # (handle, key or None for the empty match, serial, epoch)
        self.own = Counter()  # (key, serial) or ("root", epoch) -> locks taken through that handle
        self.clock = 0
        self.serial = 0
        self.epoch = 0
        self.hit = self.miss = 0

    # --- strategies -----------------------------------------------------------------------------

    @staticmethod
    def tokens(ps):
        """Token lists built from page symbols, so prefixes are shared; with page_size > 1 two
        pages may differ only in their last token (the match must stop at the page before)."""
        page = st.tuples(st.integers(0, 2), st.integers(0, 1)) if ps > 1 else st.integers(0, 3)
        tail = st.integers(0, ps - 1)

        def build(pages_tail):
            pages, extra = pages_tail
            out = []
            for p in pages:
                if ps == 1:
                    out.append(p)
                else:
                    s, v = p
                    out += [s] * (ps - 1) + [s + 10 * v]
            out += [7] * extra
            return np.array(out, dtype=np.int32)

        return st.tuples(st.lists(page, max_size=5), tail).map(build)

    def draw_tokens(self, data):
        """Fresh tokens, or a cached prefix cut, bent (one token changed) and/or extended: the
        inputs that split edges, end inside them, or diverge inside a page."""
        fresh = data.draw(self.tokens(self.PAGE_SIZE))
        if not self.entries or data.draw(st.integers(0, 2)) == 0:
            return fresh
        _, prefix = data.draw(st.sampled_from(sorted(self.entries, key=repr)))
        toks = list(prefix)
        toks = toks[: data.draw(st.integers(0, len(toks)))] if data.draw(st.booleans()) else toks
        if toks and data.draw(st.booleans()):
            toks[data.draw(st.integers(0, len(toks) - 1))] += 100
        return np.array(toks + fresh.tolist(), dtype=np.int32)

    # --- model helpers ---------------------------------------------------------------------------

    def key(self, ns, tokens, k):
        return (ns, tuple(tokens[: k * self.PAGE_SIZE].tolist()))

    def longest(self, ns, tokens):
        k = 0
        while (k + 1) * self.PAGE_SIZE <= len(tokens) and self.key(ns, tokens, k + 1) in self.entries:
            k += 1
        return k

    def touch(self, ns, tokens, k):
        for j in range(1, k + 1):
            self.entries[self.key(ns, tokens, j)].time = self.clock

    def path(self, key):
        ns, prefix = key
        return [(ns, prefix[: j * self.PAGE_SIZE]) for j in range(1, len(prefix) // self.PAGE_SIZE + 1)]

    def valid(self, h):
        _, key, serial, epoch = h
        if epoch != self.epoch:
            return False
        return key is None or (key in self.entries and self.entries[key].serial == serial)

    def own_key(self, h):
        _, key, serial, epoch = h
        return ("root", epoch) if key is None else (key, serial)

    def reclaimable(self):
        return sum(1 for e in self.entries.values() if e.lock == 0 and self.refs[e.page] == 1)

    def free_pages(self):
        return self.NUM_PAGES - sum(1 for r in self.refs.values() if r > 0)

    def real_entries(self):
        out = {}
        for i, ns in enumerate(NAMESPACES):
            for toks, pages in self.c.leaf_paths(namespace=ns):
                toks = tuple(toks.tolist())
                for j, p in enumerate(pages.tolist(), start=1):
                    out[(i, toks[: j * self.PAGE_SIZE])] = p
        return out

    def sync_evictions(self):
        """Learns which entries the cache evicted, checks they were fair game, applies them."""
        real = self.real_entries()
        assert set(real) <= set(self.entries), "eviction cannot add entries"
        removed = [k for k in self.entries if k not in real]
        for k in removed:
            assert self.entries[k].lock == 0, f"locked entry {k} evicted"
        has_child = {(ns, prefix[: -self.PAGE_SIZE]) for ns, prefix in real}
        leaves = [k for k in real if k not in has_child and self.entries[k].lock == 0]
        if removed and leaves:
            newest_removed = max(self.entries[k].time for k in removed)
            oldest_leaf = min(self.entries[k].time for k in leaves)
            assert newest_removed <= oldest_leaf, "evicted an entry used after a remaining leaf"
        for k in removed:
            self.refs[self.entries.pop(k).page] -= 1
        return len(removed)

    # --- rules -----------------------------------------------------------------------------------

    @rule(n=st.integers(0, 8))
    def alloc(self, n):
        free = self.free_pages()
        if n <= free:
            p = self.a.alloc(n)
            self.take(p)
        else:
            with pytest.raises(OutOfPagesError) as e:
                self.a.alloc(n)
            assert (e.value.requested, e.value.free) == (n, free)

    def take(self, p):
        assert p.dtype == np.int32 and len(set(p.tolist())) == len(p)
        for x in p.tolist():
            assert 1 <= x <= self.NUM_PAGES and self.refs[x] == 0, f"page {x} handed out twice"
            self.refs[x] = 1
        self.requests.append(p)

    @rule(n=st.integers(0, 10))
    def cache_alloc(self, n):
        free, reclaim = self.free_pages(), self.reclaimable()
        if n <= free + reclaim:
            p = self.c.alloc(n)
            self.sync_evictions()
            if n <= free:
                assert self.free_pages() == free, "evicted although enough was free"
            self.take(p)
        else:
            with pytest.raises(OutOfPagesError) as e:
                self.c.alloc(n)
            assert (e.value.requested, e.value.free, e.value.evictable) == (n, free, reclaim)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_request(self, data):
        self.release(data.draw(st.sampled_from(self.requests)))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def share_request(self, data):
        p = self.requests[data.draw(st.integers(0, len(self.requests) - 1))]
        self.a.inc_ref(p)
        for x in p.tolist():
            self.refs[x] += 1
        self.requests.append(p.copy())

    @rule(page=st.integers(-1, 30), dup=st.booleans())
    def bad_free(self, page, dup):
        """A page nobody may free (free, padding, out of range, or cache-only), or a repeat."""
        held = {x for p in self.requests for x in p.tolist()}
        if dup and held:
            x = min(held)
            with pytest.raises(PageError):
                self.a.free(np.array([x, x], dtype=np.int32))
        elif page not in held:
            with pytest.raises(PageError):
                self.a.free(np.array([page], dtype=np.int64))

    def do_match(self, ns, tokens):
        k = self.longest(ns, tokens)
        pages, h, n = self.c.match_prefix(tokens, namespace=NAMESPACES[ns])
        assert n == k * self.PAGE_SIZE
        assert pages.tolist() == [self.entries[self.key(ns, tokens, j)].page for j in range(1, k + 1)]
        self.clock += 1
        self.touch(ns, tokens, k)
        self.hit += n
        self.miss += len(tokens) - n
        key = self.key(ns, tokens, k) if k else None
        handle = (h, key, self.entries[key].serial if key else None, self.epoch)
        self.handles.append(handle)
        return handle, pages

    def do_insert(self, ns, tokens, arg):
        """`arg`: the pages, or a tuple / list of parts that stands for their concatenation."""
        ps = self.PAGE_SIZE
        k = self.longest(ns, tokens)
        assert self.c.insert(tokens, arg, namespace=NAMESPACES[ns]) == k * ps
        if isinstance(arg, (tuple, list)):
            parts = [np.asarray(x, dtype=np.int64) for x in arg]
            arg = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.clock += 1
        self.touch(ns, tokens, k)
        for j in range(k + 1, len(tokens) // ps + 1):
            self.serial += 1
            self.entries[self.key(ns, tokens, j)] = Entry(int(arg[j - 1]), self.clock, 0, self.serial)
            self.refs[int(arg[j - 1])] += 1

    def release(self, pages):
        del self.requests[next(i for i, r in enumerate(self.requests) if r is pages)]
        self.a.free(pages)
        for x in pages.tolist():
            self.refs[x] -= 1

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), and_lock=st.booleans(), data=st.data())
    def match(self, ns, and_lock, data):
        handle, _ = self.do_match(ns, self.draw_tokens(data))
        if and_lock:  # a request keeps its prefix pinned
            self.do_lock(handle)

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), parts=st.booleans(), data=st.data())
    def serve(self, ns, parts, data):
        """One request as a serving loop runs it: match, lock, cache.alloc the rest, insert the
        whole sequence (its pages concatenated, or as the parts (matched, new)), unlock, release
        the request's own pages."""
        tokens = self.draw_tokens(data)
        handle, matched = self.do_match(ns, tokens)
        self.do_lock(handle)
        need = -(-len(tokens) // self.PAGE_SIZE) - len(matched)
        if need <= self.free_pages() + self.reclaimable():
            new = self.c.alloc(need)
            self.sync_evictions()
            self.take(new)
            self.do_insert(ns, tokens, (matched, new) if parts else np.concatenate([matched, new]))
            self.release(new)
        else:
            with pytest.raises(OutOfPagesError):
                self.c.alloc(need)
        self.do_unlock(handle)

    @rule(
        ns=st.integers(0, len(NAMESPACES) - 1),
        reuse=st.booleans(),
        partial=st.booleans(),
        keep=st.booleans(),
        data=st.data(),
    )
    def insert(self, ns, reuse, partial, keep, data):
        """A request finishing: pages for its tokens (evicting if needed), insert, and usually
        release its own references right away."""
        tokens = self.draw_tokens(data)
        ps = self.PAGE_SIZE
        full = len(tokens) // ps
        n = -(-len(tokens) // ps) if partial else full
        if n > self.free_pages() + self.reclaimable():
            return
        pages = self.c.alloc(n)
        self.sync_evictions()
        self.take(pages)
        arg = pages.copy()
        if reuse:  # hand the cached pages back for the present part, as a request that matched
            for j in range(self.longest(ns, tokens)):
                arg[j] = self.entries[self.key(ns, tokens, j + 1)].page
        cuts = sorted(data.draw(st.lists(st.integers(0, len(arg)), max_size=3)))
        if cuts:  # the same pages in parts, cut anywhere (empty parts too)
            arg = [arg[i:j] for i, j in zip([0, *cuts], [*cuts, len(arg)], strict=True)]
        self.do_insert(ns, tokens, arg)
        if not keep:
            self.release(pages)

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), how=st.sampled_from(["cached", "free", "dup"]), data=st.data())
    def bad_insert(self, ns, how, data):
        """Pages the tree must refuse for the part it would take; nothing may change."""
        tokens = data.draw(self.tokens(self.PAGE_SIZE))
        full = len(tokens) // self.PAGE_SIZE
        k = self.longest(ns, tokens)
        if full == k:
            return
        held = [x for p in self.requests for x in p.tolist() if x not in {e.page for e in self.entries.values()}]
        cached = [e.page for e in self.entries.values()]
        freep = [x for x in range(1, self.NUM_PAGES + 1) if self.refs[x] == 0]
        base = held[:1] * full if held else [1] * full
        if how == "cached" and cached:
            bad = cached[0]
        elif how == "free" and freep:
            bad = freep[0]
        elif how == "dup" and held and full - k >= 2:
            base = [held[0]] * full
            bad = held[0]
        else:
            return
        arg = np.array(base, dtype=np.int32)
        arg[full - 1] = bad
        cut = data.draw(st.integers(-1, full))
        if cut >= 0:  # in two parts
            arg = (arg[:cut], arg[cut:])
        before = (self.c.total_size, self.a.ref_counts().tolist())
        with pytest.raises(PageError):
            self.c.insert(tokens, arg, namespace=NAMESPACES[ns])
        assert (self.c.total_size, self.a.ref_counts().tolist()) == before

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def lock(self, data):
        self.do_lock(data.draw(st.sampled_from(self.handles)))

    def do_lock(self, h):
        if not self.valid(h):
            with pytest.raises(StaleNodeError):
                self.c.lock(h[0])
            return
        self.c.lock(h[0])
        self.own[self.own_key(h)] += 1
        if h[1] is not None:
            for k in self.path(h[1]):
                self.entries[k].lock += 1

    @precondition(lambda self: self.handles)
    @rule(locked_one=st.booleans(), data=st.data())
    def unlock(self, locked_one, data):
        locked = [h for h in self.handles if self.valid(h) and self.own[self.own_key(h)] > 0]
        self.do_unlock(data.draw(st.sampled_from(locked if locked_one and locked else self.handles)))

    def do_unlock(self, h):
        if not self.valid(h):
            with pytest.raises(StaleNodeError):
                self.c.unlock(h[0])
        elif self.own[self.own_key(h)] == 0:
            with pytest.raises(LockError):
                self.c.unlock(h[0])
        else:
            self.c.unlock(h[0])
            self.own[self.own_key(h)] -= 1
            if h[1] is not None:
                for k in self.path(h[1]):
                    self.entries[k].lock -= 1

    @precondition(lambda self: self.entries)
    @rule(ns=st.integers(0, len(NAMESPACES) - 1), data=st.data())
    def match_then_evict(self, ns, data):
        """Use an entry, then evict one page: the entry just used must not be the one to go
        while an older unlocked leaf remains."""
        self.do_match(ns, self.draw_tokens(data))
        self.do_evict(1)

    @rule(pages=st.integers(0, 2), extra=st.integers(0, 1))
    def evict(self, pages, extra):
        self.do_evict(pages * self.PAGE_SIZE + extra)

    def do_evict(self, n):
        freed = self.c.evict(n)
        removed = self.sync_evictions()
        assert freed == removed * self.PAGE_SIZE
        if freed < n:
            assert all(e.lock > 0 for e in self.entries.values()), "stopped early with evictable entries"

    @rule(go=st.integers(0, 9))
    def reset(self, go):
        if go:  # rare: it empties the cache
            return
        if any(v > 0 for v in self.own.values()):
            with pytest.raises(CacheBusyError):
                self.c.reset()
            return
        self.c.reset()
        for e in self.entries.values():
            self.refs[e.page] -= 1
        self.entries.clear()
        self.hit = self.miss = 0
        self.epoch += 1
        self.own.clear()

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def pages_add_up(self):
        rc = self.a.ref_counts()
        assert rc[0] == 0
        assert rc[1:].tolist() == [self.refs[x] for x in range(1, self.NUM_PAGES + 1)]
        assert self.a.num_free + self.a.num_used == self.NUM_PAGES
        assert self.a.num_free == self.free_pages()

    @invariant()
    def cache_matches_model(self):
        ps = self.PAGE_SIZE
        locked = sum(1 for e in self.entries.values() if e.lock > 0)
        assert self.c.total_size == len(self.entries) * ps
        assert self.c.protected_size == locked * ps
        assert self.c.evictable_size + self.c.protected_size == self.c.total_size
        assert (self.c.hit_tokens, self.c.miss_tokens) == (self.hit, self.miss)
        assert self.real_entries() == {k: e.page for k, e in self.entries.items()}
        self.c.check_invariants()


class CacheMachinePage16(CacheMachine):
    PAGE_SIZE = 16
    NUM_PAGES = 12


TestPageSize1 = CacheMachine.TestCase
TestPageSize1.settings = SETTINGS
TestPageSize16 = CacheMachinePage16.TestCase
TestPageSize16.settings = SETTINGS
