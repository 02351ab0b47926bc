"""The host tier together with retention (issues 20 and the tier): demotion and the host tier's
own drops follow the (priority, last access) order, pinned paths stay on the device, host nodes
cannot be pinned, and the `now=` clock is read for the tier's calls too.

The Rust side is pinned by rust/src/radix/tier_retention_tests.rs; this file pins the bindings.
"""

import numpy as np
import pytest
from kvpool import InvalidArgumentError, PageAllocator, RadixCache


class FakeClock:
    def __init__(self):
        self.t = 0.0
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.t


def toks(*vals):
    return np.array(vals, dtype=np.int32)


def cache(dev=4, host=8, **kw):
    a, h = PageAllocator(dev, 1), PageAllocator(host, 1)
    return RadixCache(a, 1, host_allocator=h, **kw)


def put(c, tokens, **kw):
    pages = c.alloc(len(tokens))
    c.insert(tokens, pages, **kw)
    c.allocator.free(pages)
    c.check_invariants()


def on_device(c, tokens):
    return c.match_prefix(tokens)[2]


def on_host(c, tokens):
    return c.match_prefix_host(tokens)[2]


def test_demotion_takes_the_lowest_priority_first():
    c = cache()
    put(c, toks(1, 2), priority=50)
    put(c, toks(3, 4))  # more recent, priority 0
    put(c, toks(5, 6))  # demotes [3, 4], not the older [1, 2]
    dev, host = c.take_demotions()
    assert len(dev) == len(host) == 2
    assert on_device(c, toks(1, 2)) == 2
    assert (on_device(c, toks(3, 4)), on_host(c, toks(3, 4))) == (0, 2)
    assert c.stats()["evicted_tokens"] == 0  # a demotion is no eviction


def test_pins_stay_on_the_device_and_host_nodes_take_no_pin():
    c = cache(max_pinned_tokens=4)
    put(c, toks(1, 2))
    node = c.match_prefix(toks(1, 2))[1]
    c.pin(node)
    put(c, toks(3, 4))
    held = c.alloc(2)  # [1, 2] is least recently used but pinned: [3, 4] is demoted
    assert on_device(c, toks(1, 2)) == 2
    assert c.try_alloc(1) is None  # nothing else can leave the device
    _, host_node, n = c.match_prefix_host(toks(3, 4))
    assert n == 2
    with pytest.raises(InvalidArgumentError, match="host tier"):
        c.pin(host_node)
    assert c.pinned_tokens == 2
    c.check_invariants()
    c.allocator.free(held)
    c.unpin(node)
    assert c.pinned_tokens == 0
    c.check_invariants()


def test_full_host_pool_drops_by_priority_and_expiry_with_the_clock():
    clock = FakeClock()
    c = cache(dev=2, host=4, now=clock)
    put(c, toks(1, 2), priority=50, retention_s=10.0)
    put(c, toks(3, 4))  # [1, 2] to the host
    put(c, toks(5, 6))  # [3, 4] to the host: host full
    put(c, toks(7, 8))  # [5, 6] down: drops [3, 4] (priority 0), keeps the older [1, 2]
    assert (on_host(c, toks(1, 2)), on_host(c, toks(3, 4)), on_host(c, toks(5, 6))) == (2, 0, 2)
    clock.t = 20.0  # [1, 2]'s retention ran out: it decays and, least recently used, goes first
    calls = clock.calls
    assert on_host(c, toks(5, 6)) == 2
    assert clock.calls == calls + 1  # match_prefix_host reads the clock
    put(c, toks(9, 9))
    assert (on_host(c, toks(1, 2)), on_host(c, toks(5, 6)), on_host(c, toks(7, 8))) == (0, 2, 2)
    s = c.stats()
    assert s["retention_expiries"] == 1
    assert s["evicted_tokens_by_priority"] == {0: 4}
    c.reset()
    assert c.max_pinned_tokens == 0 and c.host_allocator is not None
    c.check_invariants()
