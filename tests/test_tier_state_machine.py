"""Hypothesis state machine: a RadixCache with a host tier against a simple Python model.

The model is what the pages hold and who holds them, not the tree: every page a request
computes gets the content ``f(namespace, tokens up to the page's end)`` (what a causal model's KV
depends on) in an array standing for the device pool; demotions (``take_demotions``) copy device
contents to an array standing for the host pool, loads copy them back. After every step:

- no page leaks: device pages in use == the tree's device pages + pages requests hold; host
  pages in use == the tree's host pages (freed when the host tier drops them);
- the pages a running request locked are still its device match, and no demotion ever lists
  one of them (a locked page is never demoted);
- every page ``match_prefix`` or ``match_prefix_host`` returns holds the content of its prefix
  (bytes equal after demote + load), and a load that fails leaves the node on the host;
- a load back succeeds with the tokens it loaded, or fails only as expected: a StaleNodeError
  after the host tier dropped the node (any other error fails the test);
- the Rust tree's structural checks of both tiers pass.
"""

import os
import zlib

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvpool import PageAllocator, RadixCache, StaleNodeError

PROFILES = {
    "ci": dict(max_examples=60, stateful_step_count=40, derandomize=True),
    "long": dict(max_examples=1000, stateful_step_count=100),
}
SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    **PROFILES[os.environ.get("KVPOOL_HYPOTHESIS_PROFILE", "ci")],
)

NAMESPACES = [None, ("lora", 1)]
# Prompts share prefixes: a few stems, then a short tail.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5], []]


def content(ns, prefix) -> int:
    return zlib.crc32(repr((ns, [int(t) for t in prefix])).encode()) + 1


class TierMachine(RuleBasedStateMachine):
    ps = 1
    dev_pages = 10
    host_pages = 16

    def __init__(self):
        super().__init__()
        self.a = PageAllocator(self.dev_pages, self.ps)
        self.h = PageAllocator(self.host_pages, self.ps)
        self.c = RadixCache(self.a, host_allocator=self.h)
        self.dev = np.zeros(self.dev_pages + 1, np.int64)
        self.host = np.zeros(self.host_pages + 1, np.int64)
        self.running = []  # (node, locked pages, tokens, namespace)
        self.held = []

    # --- helpers ---

    def locked_pages(self) -> set[int]:
        return {int(p) for _, pages, _, _ in self.running for p in pages}

    def flush(self, extra_locked=()):
        d, hp = self.c.take_demotions()
        assert d.shape == hp.shape and d.dtype == np.int32
        assert not ({int(x) for x in d} & (self.locked_pages() | set(extra_locked))), \
            "a locked page was demoted"
        for x, y in zip(d, hp, strict=True):  # in order: a host page listed twice takes the later
            self.host[y] = self.dev[x]

    def check_pages(self, ns, tokens, start, pages, where):
        ps = self.ps
        for j, p in enumerate(pages):
            want = content(ns, tokens[: start + (j + 1) * ps])
            assert where[p] == want, f"page {p} (position {start // ps + j}) holds other content"

    # --- rules ---

    @rule(stem=st.sampled_from(range(len(STEMS))),
          tail=st.lists(st.integers(0, 3), max_size=6),
          ns=st.sampled_from(NAMESPACES), fail_load=st.booleans())
    def serve(self, stem, tail, ns, fail_load):
        """One whole request: match both tiers, load (or recompute), compute the rest, insert."""
        tokens = np.array(STEMS[stem] + tail, np.int32)
        ps, c, a, h = self.ps, self.c, self.a, self.h
        p, node, n = c.match_prefix(tokens, ns)
        assert n == len(p) * ps
        self.check_pages(ns, tokens, 0, p, self.dev)
        hp, hnode, hn = c.match_prefix_host(tokens, ns)
        assert hn == len(hp) * ps and n + hn <= len(tokens)
        self.check_pages(ns, tokens, n, hp, self.host)
        c.lock(node)
        mine = [int(x) for x in p]
        loaded = np.zeros(0, np.int32)
        if hn and not fail_load:
            h.inc_ref(hp)  # the load's reference while it reads them
            dropped = c.tier_stats()["host_evicted_pages"]
            dev = c.try_alloc(len(hp))
            self.flush(mine)
            if dev is not None:
                self.dev[dev] = self.host[hp]  # the load's copies
                # The one failure expected: the allocation's demotions made the host tier drop
                # leaves, `hnode` among them (its host chain cannot change otherwise: its device
                # parent is the locked match, and only a load or an insert promotes).
                try:
                    assert c.load_back(hnode, dev) == hn
                except StaleNodeError:
                    assert c.tier_stats()["host_evicted_pages"] > dropped, "stale, none dropped"
                    _, _, again = c.match_prefix_host(tokens, ns)
                    assert again < hn, "the dropped node still matches"
                loaded = dev  # (loaded or not, they hold the prefix's bytes: they are inserted)
            h.free(hp)
        elif hn:
            # A failed load: the node stays on the host, the request recomputes.
            again, _, hn2 = c.match_prefix_host(tokens, ns)
            assert hn2 == hn and np.array_equal(again, hp)
        prefix = np.concatenate([p, loaded]).astype(np.int32)
        need = -(-len(tokens) // ps) - len(prefix)
        own = c.try_alloc(need)
        self.flush(mine)
        if own is None:
            c.unlock(node)
            if len(loaded):
                a.free(loaded)
            return
        for j, q in enumerate(own):
            self.dev[q] = content(ns, tokens[: (len(prefix) + j + 1) * ps])
        c.insert(tokens, (p, loaded, own), ns)
        c.unlock(node)
        a.free(own)
        if len(loaded):
            a.free(loaded)

    @rule(stem=st.sampled_from(range(len(STEMS))), ns=st.sampled_from(NAMESPACES))
    def start(self, stem, ns):
        """A request that keeps its device match locked for a while."""
        tokens = np.array(STEMS[stem], np.int32)
        p, node, _ = self.c.match_prefix(tokens, ns)
        self.c.lock(node)
        self.running.append((node, p.copy(), tokens, ns))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 7))
    def finish(self, i):
        node, _, _, _ = self.running.pop(i % len(self.running))
        self.c.unlock(node)

    @rule(k=st.integers(1, 6))
    def hold(self, k):
        got = self.c.try_alloc(k)
        self.flush()
        if got is not None:
            self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 7))
    def release(self, i):
        self.a.free(self.held.pop(i % len(self.held)))

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        self.c.evict(n)
        self.flush()

    @precondition(lambda self: not self.running)
    @rule()
    def reset(self):
        self.c.reset()
        assert self.c.host_allocator.num_used == 0 and self.c.tier_stats()["host_size"] == 0
        assert self.c.take_demotions()[0].size == 0

    # --- invariants ---

    @invariant()
    def structure(self):
        self.c.check_invariants()

    @invariant()
    def no_leaks(self):
        ps = self.ps
        assert self.a.num_used == self.c.total_size // ps + sum(len(x) for x in self.held)
        assert self.h.num_used == self.c.tier_stats()["host_size"] // ps

    @invariant()
    def locked_pages_stay_on_the_device(self):
        for _, pages, tokens, ns in self.running:
            got, _, _ = self.c.match_prefix(tokens, ns)
            assert np.array_equal(got[: len(pages)], pages)


class TierMachinePage4(TierMachine):
    ps = 4
    dev_pages = 6
    host_pages = 5


class TierMachineSmallHost(TierMachine):
    """A host pool smaller than some nodes: those are dropped (with their host subtrees)."""

    ps = 2
    dev_pages = 8
    host_pages = 3


TestTierPageSize1 = TierMachine.TestCase
TestTierPageSize1.settings = SETTINGS
TestTierPageSize4 = TierMachinePage4.TestCase
TestTierPageSize4.settings = SETTINGS
TestTierSmallHost = TierMachineSmallHost.TestCase
TestTierSmallHost.settings = SETTINGS
