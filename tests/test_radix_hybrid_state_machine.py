"""Hypothesis state machine: a hybrid-model RadixCache (full attention + one sliding-window group
+ linear-attention state slots) against a small pure-Python model, as
``test_radix_state_machine.py`` does for plain models.

The model keeps one entry per cached page, keyed by (namespace, token prefix up to and including
that page): its full page, its sliding page (0: released, a tombstone), the state slot saved
after that prefix (0: none), last access time and lock count; and one reference count per page of
each of the three spaces. After every step:

- every page's and every state slot's reference count equals its holders (requests + cache): no
  page or slot leaks, none is freed twice;
- the cache holds exactly the model's entries, in every group;
- ``match_prefix_groups`` returns exactly the longest prefix every group serves: all full pages,
  the sliding pages of the last ``WINDOW`` tokens before the match point (none released), and a
  saved state exactly there (with a state pool; so no checkpoint means a zero-length match); a hit
  is never longer than that, whatever full attention alone would serve;
- eviction removes only unlocked entries, least recently used first, and releases every group's
  pages with them.

Requests run as a serving loop runs them: match, lock, take their own reference on the matched
sliding pages, allocate the rest through the cache (evicting), release the sliding pages that fell
out of the window (``release_window_pages``), insert with a state checkpoint, unlock, free.
"""

from collections import Counter
from dataclasses import dataclass

import kvpool
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvpool import (
    CacheBusyError,
    OutOfPagesError,
    PageAllocator,
    PageError,
    RadixCache,
    StateSlotAllocator,
)
from test_radix_state_machine import SETTINGS, CacheMachine

NAMESPACES = [None, ("lora", 1)]


@dataclass
class Entry:
    page: int
    sw: int
    state: int
    time: int
    lock: int


class HybridMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    WINDOW = 3
    STATE = True
    NUM_PAGES = 24
    NUM_SLOTS = 6

    def __init__(self):
        super().__init__()
        ps = self.PAGE_SIZE
        self.full = PageAllocator(self.NUM_PAGES, ps)
        self.sw = PageAllocator(self.NUM_PAGES, ps)
        self.st = StateSlotAllocator(self.NUM_SLOTS) if self.STATE else None
        self.c = RadixCache(self.full, sliding=[(self.sw, self.WINDOW)], state_slots=self.st)
        self.refs = {"full": Counter(), "sw": Counter(), "st": Counter()}
        self.entries = {}
        self.locked = []  # (handle, key or None)
        self.clock = 0

    # --- model helpers ---------------------------------------------------------------------------

    def key(self, ns, tokens, k):
        return (ns, tuple(tokens[: k * self.PAGE_SIZE].tolist()))

    def longest(self, ns, tokens):
        k = 0
        while (k + 1) * self.PAGE_SIZE <= len(tokens) and self.key(
            ns, tokens, k + 1
        ) in self.entries:
            k += 1
        return k

    def first_kept(self, k):
        """First page entry a sliding group needs to resume after k pages (last WINDOW tokens)."""
        return max(0, k * self.PAGE_SIZE - self.WINDOW) // self.PAGE_SIZE

    def served(self, ns, tokens):
        """(pages served, pages full attention alone would serve), from the model alone."""
        full = self.longest(ns, tokens)
        for k in range(full, -1, -1):
            if self.STATE and k > 0 and self.entries[self.key(ns, tokens, k)].state == 0:
                continue
            if all(
                self.entries[self.key(ns, tokens, j + 1)].sw != 0
                for j in range(self.first_kept(k), k)
            ):
                return k, full
        raise AssertionError("k = 0 always serves")

    def spaces(self):
        out = [("full", self.full, self.NUM_PAGES), ("sw", self.sw, self.NUM_PAGES)]
        if self.STATE:
            out.append(("st", self.st, self.NUM_SLOTS))
        return out

    def free_of(self, space):
        n = self.NUM_SLOTS if space == "st" else self.NUM_PAGES
        return n - sum(1 for r in self.refs[space].values() if r > 0)

    def reclaimable(self, space):
        field = {"full": "page", "sw": "sw", "st": "state"}[space]
        ids = [getattr(e, field) for e in self.entries.values() if e.lock == 0]
        return sum(1 for x in ids if x != 0 and self.refs[space][x] == 1)

    def real_entries(self):
        out = {}
        for i, ns in enumerate(NAMESPACES):
            for toks, pages, sliding, states in self.c.leaf_paths_groups(namespace=ns):
                toks = tuple(toks.tolist())
                for j, (p, s, x) in enumerate(
                    zip(pages.tolist(), sliding[0].tolist(), states.tolist(), strict=True)
                ):
                    out[(i, toks[: (j + 1) * self.PAGE_SIZE])] = (p, s, x if self.STATE else 0)
        return out

    def sync_evictions(self):
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
            self.drop_entry(self.entries.pop(k))

    def drop_entry(self, e):
        self.refs["full"][e.page] -= 1
        if e.sw:
            self.refs["sw"][e.sw] -= 1
        if e.state:
            self.refs["st"][e.state] -= 1

    def take(self, space, ids):
        for x in ids.tolist():
            assert self.refs[space][x] == 0, f"{space} id {x} handed out twice"
            self.refs[space][x] = 1

    def release(self, space, alloc, ids):
        ids = np.asarray(ids, dtype=np.int32)
        alloc.free(ids)
        for x in ids.tolist():
            self.refs[space][x] -= 1

    def fits(self, space, n):
        return n <= self.free_of(space) + self.reclaimable(space)

    # --- operations ------------------------------------------------------------------------------

    def do_match(self, ns, tokens):
        k, full = self.served(ns, tokens)
        ps = self.PAGE_SIZE
        pages, node, n, sliding, state = self.c.match_prefix_groups(
            tokens, namespace=NAMESPACES[ns]
        )
        assert n == k * ps, (
            f"served {n} tokens, the model serves {k * ps} (full attention {full * ps})"
        )
        ents = [self.entries[self.key(ns, tokens, j)] for j in range(1, k + 1)]
        assert pages.tolist() == [e.page for e in ents]
        lo = self.first_kept(k)
        assert sliding[0].tolist() == [0] * lo + [e.sw for e in ents[lo:]]
        assert all(sliding[0][lo:]), "a hit whose window has a released page"
        assert state == (ents[-1].state if (k and self.STATE) else 0)
        if self.STATE and k:
            assert state != 0, "a hit with no saved state at its end"
        # The plain API agrees on the length (a hybrid cache never over-serves through it).
        self.clock += 1
        for e in ents:
            e.time = self.clock
        return node, (self.key(ns, tokens, k) if k else None), pages, sliding[0]

    def do_lock(self, node, key):
        self.c.lock(node)
        self.locked.append((node, key))
        if key is not None:
            ns, prefix = key
            for j in range(1, len(prefix) // self.PAGE_SIZE + 1):
                self.entries[(ns, prefix[: j * self.PAGE_SIZE])].lock += 1

    def do_unlock(self, i):
        node, key = self.locked.pop(i)
        self.c.unlock(node)
        if key is not None:
            ns, prefix = key
            for j in range(1, len(prefix) // self.PAGE_SIZE + 1):
                self.entries[(ns, prefix[: j * self.PAGE_SIZE])].lock -= 1

    def do_insert(self, ns, tokens, pages, sliding, state):
        ps = self.PAGE_SIZE
        k = self.longest(ns, tokens)
        kw = {"state_slot": state} if state else {}
        got = self.c.insert(tokens, pages, namespace=NAMESPACES[ns], sliding_pages=[sliding], **kw)
        assert got == k * ps
        full = len(tokens) // ps
        if isinstance(pages, tuple):
            pages = np.concatenate(pages)
        self.clock += 1
        for j in range(1, k + 1):
            self.entries[self.key(ns, tokens, j)].time = self.clock
        for j in range(k + 1, full + 1):
            sw = int(sliding[j - 1])
            self.entries[self.key(ns, tokens, j)] = Entry(int(pages[j - 1]), sw, 0, self.clock, 0)
            self.refs["full"][int(pages[j - 1])] += 1
            if sw:
                self.refs["sw"][sw] += 1
        if state and full:
            e = self.entries[self.key(ns, tokens, full)]
            if e.state == 0:
                e.state = state
                self.refs["st"][state] += 1

    # --- rules -----------------------------------------------------------------------------------

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), and_lock=st.booleans(), data=st.data())
    def match(self, ns, and_lock, data):
        node, key, _, _ = self.do_match(ns, data.draw(self.tokens_for(data)))
        if and_lock:
            self.do_lock(node, key)

    def tokens_for(self, data):
        """Fresh tokens; or a cached prefix (most often one ending at a saved state, where a hit
        can happen), whole or cut, with fresh tokens after it."""
        fresh = CacheMachine.tokens(self.PAGE_SIZE)
        mode = data.draw(st.integers(0, 3)) if self.entries else 0
        if mode == 0:
            return fresh
        keys = sorted(self.entries, key=repr)
        saved = [k for k in keys if self.entries[k].state]
        _, prefix = data.draw(st.sampled_from(saved if saved and mode < 3 else keys))
        cut = len(prefix) if mode < 3 else data.draw(st.integers(0, len(prefix)))
        return fresh.map(lambda t: np.array(list(prefix[:cut]) + t.tolist(), dtype=np.int32))

    @rule(
        ns=st.integers(0, len(NAMESPACES) - 1),
        checkpoint=st.booleans(),
        data=st.data(),
    )
    def serve(self, ns, checkpoint, data):
        """One request end to end, as a serving loop runs it."""
        ps = self.PAGE_SIZE
        tokens = data.draw(self.tokens_for(data))
        node, key, matched, msw = self.do_match(ns, tokens)
        self.do_lock(node, key)
        k = len(matched)
        n_pages = -(-len(tokens) // ps)
        need = n_pages - k
        # The request's own reference on the matched window pages (it will release them itself).
        own_sw = msw[msw != 0]
        self.sw.inc_ref(own_sw)
        for x in own_sw.tolist():
            self.refs["sw"][x] += 1
        want_state = self.STATE and checkpoint and len(tokens) % ps == 0 and len(tokens) > 0
        ok = self.fits("full", need)
        if ok:
            new = self.c.alloc(need)
            self.sync_evictions()
            self.take("full", new)
            ok = self.fits("sw", need)
            if ok:
                new_sw = self.c.alloc_sliding(0, need)
                self.sync_evictions()
                self.take("sw", new_sw)
                slot = 0
                if want_state and self.fits("st", 1):
                    slot = int(self.c.alloc_state_slots(1)[0])
                    self.sync_evictions()
                    self.take("st", np.array([slot]))
                # Decode done: the sliding pages before the window go back (entries become 0).
                row = np.concatenate([msw, new_sw]).astype(np.int32).reshape(1, -1)
                before = {x for x in row[0].tolist() if x}
                kvpool.release_window_pages(self.sw, row, np.array([len(tokens)]), self.WINDOW)
                for x in before - {x for x in row[0].tolist() if x}:
                    self.refs["sw"][x] -= 1
                self.do_insert(ns, tokens, (matched, new), row[0], slot)
                self.do_unlock(len(self.locked) - 1)
                self.release("full", self.full, new)
                self.release("sw", self.sw, row[0][row[0] != 0])
                if slot:
                    self.release("st", self.st, [slot])
                return
            self.release("full", self.full, new)
        self.release("sw", self.sw, own_sw)
        self.do_unlock(len(self.locked) - 1)

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), data=st.data())
    def insert_with_holes(self, ns, data):
        """Pages straight from the allocators, sliding pages released anywhere (tombstones)."""
        ps = self.PAGE_SIZE
        tokens = data.draw(CacheMachine.tokens(ps))
        n = len(tokens) // ps
        if not (self.fits("full", n) and self.fits("sw", n)):
            return
        pages = self.c.alloc(n)
        self.sync_evictions()
        self.take("full", pages)
        sw = self.c.alloc_sliding(0, n)
        self.sync_evictions()
        self.take("sw", sw)
        holes = np.array([data.draw(st.booleans()) for _ in range(n)], dtype=bool)
        self.release("sw", self.sw, sw[holes])
        sw = np.where(holes, 0, sw).astype(np.int32)
        slot = 0
        if self.STATE and n and data.draw(st.booleans()) and self.fits("st", 1):
            slot = int(self.c.alloc_state_slots(1)[0])
            self.sync_evictions()
            self.take("st", np.array([slot]))
        self.do_insert(ns, tokens[: n * ps], pages, sw, slot)
        self.release("full", self.full, pages)
        self.release("sw", self.sw, sw[sw != 0])
        if slot:
            self.release("st", self.st, [slot])

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), data=st.data())
    def bad_insert(self, ns, data):
        """A free sliding page for the part the tree would take: refused, nothing changes."""
        ps = self.PAGE_SIZE
        tokens = data.draw(CacheMachine.tokens(ps))
        n = len(tokens) // ps
        k = self.longest(ns, tokens)
        freep = [x for x in range(1, self.NUM_PAGES + 1) if self.refs["sw"][x] == 0]
        if n == k or not freep or not self.fits("full", n):
            return
        pages = self.c.alloc(n)
        self.sync_evictions()
        self.take("full", pages)
        sw = np.zeros(n, dtype=np.int32)
        sw[n - 1] = freep[0]
        before = [a.ref_counts().tolist() for _, a, _ in self.spaces()] + [self.c.total_size]
        with pytest.raises(PageError, match="sliding_pages"):
            self.c.insert(tokens, pages, namespace=NAMESPACES[ns], sliding_pages=[sw])
        after = [a.ref_counts().tolist() for _, a, _ in self.spaces()] + [self.c.total_size]
        assert before == after
        self.release("full", self.full, pages)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        self.do_unlock(data.draw(st.integers(0, len(self.locked) - 1)))

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        self.c.evict(n * self.PAGE_SIZE)
        self.sync_evictions()

    @rule(go=st.integers(0, 9))
    def reset(self, go):
        if go:
            return
        if self.locked:
            with pytest.raises(CacheBusyError):
                self.c.reset()
            return
        self.c.reset()
        for e in self.entries.values():
            self.drop_entry(e)
        self.entries.clear()

    @rule(space=st.sampled_from(["sw", "st"]), extra=st.integers(1, 3))
    def shortage(self, space, extra):
        """More than even evicting everything gives: OutOfPagesError, nothing changes."""
        if space == "st" and not self.STATE:
            return
        n = self.free_of(space) + self.reclaimable(space) + extra
        before = [a.ref_counts().tolist() for _, a, _ in self.spaces()] + [self.c.total_size]
        with pytest.raises(OutOfPagesError, match="state slots" if space == "st" else "pages") as e:
            if space == "st":
                self.c.alloc_state_slots(n)
            else:
                self.c.alloc_sliding(0, n)
        assert e.value.requested == n
        after = [a.ref_counts().tolist() for _, a, _ in self.spaces()] + [self.c.total_size]
        assert before == after

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def nothing_leaks(self):
        for space, alloc, n in self.spaces():
            rc = alloc.ref_counts()
            assert rc[0] == 0, f"{space}: the padding id was handed out"
            assert rc[1:].tolist() == [self.refs[space][x] for x in range(1, n + 1)], space
            assert alloc.num_free == self.free_of(space)

    @invariant()
    def cache_matches_model(self):
        ps = self.PAGE_SIZE
        assert self.c.total_size == len(self.entries) * ps
        assert self.c.protected_size == sum(1 for e in self.entries.values() if e.lock > 0) * ps
        model = {k: (e.page, e.sw, e.state) for k, e in self.entries.items()}
        assert self.real_entries() == model
        self.c.check_invariants()


class SlidingOnlyPage4(HybridMachine):
    """No state pool: every page-aligned point can match, the window alone limits it."""

    PAGE_SIZE = 4
    WINDOW = 6
    STATE = False
    NUM_PAGES = 14


class StatePage2(HybridMachine):
    PAGE_SIZE = 2
    WINDOW = 5
    NUM_PAGES = 16


TestHybridPage1 = HybridMachine.TestCase
TestHybridPage1.settings = SETTINGS
TestSlidingOnlyPage4 = SlidingOnlyPage4.TestCase
TestSlidingOnlyPage4.settings = SETTINGS
TestHybridStatePage2 = StatePage2.TestCase
TestHybridStatePage2.settings = SETTINGS


def test_linear_model_without_checkpoints_matches_nothing():
    """The simpler correct case the issue allows: with a state pool and no checkpoint, no hit."""
    a, s = PageAllocator(8, 1), StateSlotAllocator(2)
    w = PageAllocator(8, 1)
    c = RadixCache(a, sliding=[(w, 4)], state_slots=s)
    assert c.has_state_slots
    toks = np.array([1, 2, 3], dtype=np.int32)
    p, q = c.alloc(3), w.alloc(3)
    c.insert(toks, p, sliding_pages=[q])
    assert c.match_prefix(toks)[2] == 0
    assert c.match_prefix_groups(toks)[2] == 0
    slot = s.alloc(1)
    c.insert(toks, p, sliding_pages=[q], state_slot=int(slot[0]))
    assert c.match_prefix(toks)[2] == 3
    a.free(p), w.free(q), s.free(slot)
    assert c.evict(10) == 3
    assert (a.num_used, w.num_used, s.num_used) == (0, 0, 0)
