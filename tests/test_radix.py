"""RadixCache through the Python API: failure cases KVB-17/19 (docs/architecture.md), bad input."""

import numpy as np
import pytest

from kvpool import (
    ArrayTypeError,
    CacheBusyError,
    InvalidArgumentError,
    LockError,
    OutOfPagesError,
    PageAllocator,
    PageError,
    RadixCache,
    RadixNode,
    StaleNodeError,
)


def t(*xs, dtype=np.int32):
    return np.array(xs, dtype=dtype)


def make(num_pages=64, page_size=1):
    a = PageAllocator(num_pages, page_size)
    return a, RadixCache(a, page_size)


def put(c, tokens, namespace=None):
    """A request: alloc pages for all tokens, insert, release the request's references."""
    tokens = np.asarray(tokens, dtype=np.int32)
    pages = c.alloc(-(-len(tokens) // c.page_size))
    present = c.insert(tokens, pages, namespace=namespace)
    c.allocator.free(pages)
    c.check_invariants()
    return present


def test_shares_the_allocator():
    a, c = make(8, 2)
    assert c.allocator is a
    p = c.alloc(3)
    assert a.num_used == 3
    a.free(p)
    assert c.alloc(8).shape == (8,)
    assert a.num_free == 0
    assert RadixCache(a).page_size == 2
    with pytest.raises(InvalidArgumentError, match="page_size"):
        RadixCache(a, 4)


def test_match_returns_a_plain_tuple_and_is_page_granular():
    a, c = make(64, 4)
    assert put(c, range(10)) == 0  # 2 whole pages cached; the partial third is not
    assert c.total_size == 8 and a.num_used == 2
    pages, node, n = c.match_prefix(t(0, 1, 2, 3, 4, 5, 6, 7, 8, 9))
    assert isinstance(node, RadixNode) and pages.dtype == np.int32
    assert (len(pages), n) == (2, 8)
    assert c.match_prefix(t(0, 1, 2))[2] == 0, "shorter than a page matches nothing"
    assert put(c, [0, 1, 2]) == 0
    assert c.total_size == 8, "and creates no node"
    # int64 tokens match the same entries.
    assert c.match_prefix(t(0, 1, 2, 3, 9, 9, 9, 9, dtype=np.int64))[2] == 4


def test_split_keeps_handles_valid_and_insert_extends():
    a, c = make(64, 1)
    put(c, [1, 2, 3, 4, 5, 6])
    pages, h, n = c.match_prefix(t(1, 2, 3, 9))  # ends inside the edge: split after 3
    assert n == 3
    assert put(c, [1, 2, 3, 7, 8]) == 3
    c.lock(h)
    assert c.protected_size == 3 and c.evictable_size == 5
    assert c.evict(100) == 5, "only the two unlocked branches go"
    assert c.match_prefix(t(1, 2, 3))[0].tolist() == pages.tolist()
    c.unlock(h)
    c.check_invariants()


def test_kvb17_lock_covers_the_matched_node():
    """KVB-17: locking the matched node itself."""
    a, c = make(16, 1)
    put(c, [1, 2, 3])
    put(c, [1, 2, 3, 4, 5, 6])
    _, h, n = c.match_prefix(t(1, 2, 3, 4, 5, 6))
    assert n == 6
    c.lock(h)
    assert (c.evictable_size, c.protected_size) == (0, 6)
    assert c.evict(6) == 0
    c.unlock(h)
    assert (c.evictable_size, c.protected_size) == (6, 0)
    assert c.evict(6) == 6
    assert c.total_size == 0 and a.num_free == 16
    with pytest.raises((LockError, StaleNodeError)):
        c.unlock(h)
    assert (c.evictable_size, c.protected_size, c.total_size) == (0, 0, 0)
    # Unlock below zero on a live node.
    put(c, [1, 2, 3])
    _, h, _ = c.match_prefix(t(1, 2, 3))
    c.lock(h)
    c.unlock(h)
    with pytest.raises(LockError, match="no lock"):
        c.unlock(h)
    assert (c.evictable_size, c.protected_size) == (3, 0)
    c.check_invariants()


def test_unlock_cannot_release_a_lock_taken_through_a_descendant():
    a, c = make(16, 1)
    put(c, [1, 2, 3, 4])
    _, parent, _ = c.match_prefix(t(1, 2))
    _, child, _ = c.match_prefix(t(1, 2, 3, 4))
    c.lock(child)
    with pytest.raises(LockError):
        c.unlock(parent)
    assert c.protected_size == 4
    c.unlock(child)
    c.check_invariants()


def lora(adapter_id):
    return ("lora", adapter_id)


def salt(s):
    return ("salt", s)


def test_kvb19_namespaces_are_domain_separated():
    """KVB-19: adapter id 1 named "a"; other adapters, salts, no namespace never match."""
    a, c = make(64, 1)
    T = t(10, 11, 12, 13)
    put(c, T, namespace=(lora(1),))
    for ns in [(lora(2),), (salt("a"),), (lora(1), salt("x")), None, ()]:
        assert c.match_prefix(T, namespace=ns)[2] == 0, ns
    assert c.match_prefix(T, namespace=(lora(1),))[2] == 4
    # Tags keep values of different kinds apart; equal Python values are one namespace.
    put(c, T, namespace=1)
    for ns in ["1", b"1", (1,), (None,)]:
        assert c.match_prefix(T, namespace=ns)[2] == 0, ns
    assert c.match_prefix(T, namespace=True)[2] == 4, "True == 1 in Python"
    assert c.match_prefix(T, namespace=np.int64(1))[2] == 4
    big = 2**100 + 7
    put(c, T, namespace=("lora", big))
    assert c.match_prefix(T, namespace=("lora", big))[2] == 4
    assert c.match_prefix(T, namespace=("lora", big + 1))[2] == 0
    with pytest.raises(InvalidArgumentError, match="float"):
        c.match_prefix(T, namespace=1.5)
    with pytest.raises(InvalidArgumentError, match="list"):
        c.insert(T, c.alloc(4), namespace=["lora", 1])
    # a lone surrogate has no UTF-8 form: the error names the argument, and nothing changes
    before = (c.total_size, a.num_free)
    with pytest.raises(InvalidArgumentError, match="`namespace` strings must encode as UTF-8"):
        c.insert(T, c.alloc(4), namespace="\ud800")
    assert before == (c.total_size, a.num_free + 4)


def test_insert_takes_a_reference_only_on_new_pages():
    a, c = make(16, 1)
    p1 = c.alloc(2)
    assert c.insert(t(1, 2), p1) == 0
    p2 = c.alloc(3)
    assert c.insert(t(1, 2, 3), p2) == 2
    rc = a.ref_counts()
    assert rc[p1].tolist() == [2, 2] and rc[p2].tolist() == [1, 1, 2]
    a.free(p1)
    a.free(p2)
    assert a.num_used == 3
    assert c.match_prefix(t(1, 2, 3))[0].tolist() == [*p1.tolist(), int(p2[2])]
    # The cache's reference cannot be dropped by a holder's second free.
    with pytest.raises(PageError, match="double free"):
        a.free(p1)
    assert a.num_used == 3
    c.check_invariants()


def test_insert_bad_input_changes_nothing():
    a, c = make(16, 2)
    p = c.alloc(2)
    state = lambda: (c.total_size, a.ref_counts().tolist(), c.hit_tokens, c.miss_tokens)  # noqa: E731
    before = state()
    with pytest.raises(InvalidArgumentError, match="`pages` has 2 entries, but 6 tokens"):
        c.insert(t(1, 2, 3, 4, 5, 6), p)
    with pytest.raises(PageError, match="more than once"):
        c.insert(t(1, 2, 3, 4), np.array([p[0], p[0]], dtype=np.int32))
    with pytest.raises(PageError, match="padding"):
        c.insert(t(1, 2, 3, 4), np.array([p[0], 0], dtype=np.int32))
    with pytest.raises(PageError, match="not allocated"):
        c.insert(t(1, 2, 3, 4), np.array([p[0], 9], dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match=str(1 << 40)):
        c.insert(t(1, 2, 3, 1 << 40, dtype=np.int64), p)
    with pytest.raises(ArrayTypeError, match="`tokens`"):
        c.insert([1, 2, 3, 4], p)
    with pytest.raises(ArrayTypeError, match="`pages`"):
        c.insert(t(1, 2, 3, 4), p.astype(np.float32))
    with pytest.raises(ArrayTypeError, match="`tokens`"):
        c.match_prefix(np.array([1, 2], dtype=np.uint16))
    assert state() == before
    assert c.insert(t(1, 2, 3, 4, 5), p) == 0, "a partial last page may come along"
    q = c.alloc(1)
    with pytest.raises(PageError, match="already stored"):
        c.insert(t(7, 7, 8, 8), np.array([q[0], p[1]], dtype=np.int32))
    assert c.total_size == 4
    c.check_invariants()


def test_insert_takes_pages_in_parts():
    """`pages` as a tuple or list of arrays means their concatenation: the same tree, the same
    references and the same return value as inserting the concatenated array, split anywhere
    (inside the cached part, at its end, inside the new part, with empty parts)."""
    rng = np.random.default_rng(3)
    for ps in (1, 4):
        cut_rng = np.random.default_rng(ps)
        (a1, c1), (a2, c2) = make(48, ps), make(48, ps)
        for step in range(60):
            prefix = [0, 1, 2, 3, 4, 5, 6, 7][: int(rng.integers(0, 9))]
            tail = rng.integers(0, 3, int(rng.integers(0, 12))).tolist()
            tokens = np.array(prefix + tail, dtype=np.int32)
            got = {}
            for a, c, parts in ((a1, c1, False), (a2, c2, True)):
                pages, node, _ = c.match_prefix(tokens)
                c.lock(node)
                new = c.alloc(-(-len(tokens) // ps) - len(pages))
                whole = np.concatenate([pages, new])
                if parts:
                    cuts = sorted(cut_rng.integers(0, len(whole) + 1, 2).tolist())
                    middle = whole[cuts[0] : cuts[1]].astype(np.int64)
                    pieces = [whole[: cuts[0]], middle, whole[cuts[1] :]]
                    arg = tuple(pieces) if step % 2 else list(pieces)
                    if step % 3 == 0:
                        arg = (pages, new)  # what a serving loop holds
                else:
                    arg = whole
                got[parts] = c.insert(tokens, arg)
                c.unlock(node)
                a.free(new)
                c.check_invariants()
            assert got[True] == got[False], step
            assert a1.ref_counts().tolist() == a2.ref_counts().tolist()
            paths = [sorted((x.tolist(), y.tolist()) for x, y in c.leaf_paths()) for c in (c1, c2)]
            assert paths[0] == paths[1]
        assert c1.total_size == c2.total_size > 0


def test_insert_parts_long_and_int64_parts():
    """Long parts (borrowed, not copied) and int64 ones; the taken pages span three parts."""
    a, c = make(8000, 1)
    tokens = np.arange(5000, dtype=np.int32)
    p = c.alloc(5000)
    assert c.insert(tokens[:2500], p[:2500]) == 0
    assert c.insert(tokens, (p[:3000], p[3000:4000].astype(np.int64), p[4000:])) == 2500
    assert c.match_prefix(tokens)[0].tolist() == p.tolist()
    assert a.ref_counts()[p].tolist() == [2] * 5000
    c.check_invariants()


def test_insert_parts_bad_input_changes_nothing():
    a, c = make(16, 2)
    p = c.alloc(3)
    state = lambda: (c.total_size, a.ref_counts().tolist(), c.leaf_paths())  # noqa: E731
    before = repr(state())
    with pytest.raises(InvalidArgumentError, match="`pages` has 4 entries, but 6 tokens"):
        c.insert(t(1, 2, 3, 4, 5, 6), (p, p[:1]))
    with pytest.raises(ArrayTypeError, match=r"`pages\[1\]`"):
        c.insert(t(1, 2, 3, 4, 5, 6), (p[:2], [3]))
    with pytest.raises(ArrayTypeError, match=r"`pages\[0\]`"):
        c.insert(t(1, 2), [p[:1].astype(np.float64)])
    with pytest.raises(ArrayTypeError, match="`pages`"):
        c.insert(t(1, 2), 5)
    with pytest.raises(PageError, match="more than once"):
        c.insert(t(1, 2, 3, 4, 5, 6), (p[:2], p[1:2]))
    with pytest.raises(PageError, match="not allocated"):
        c.insert(t(1, 2, 3, 4, 5, 6), [p[:1], np.array([9, 10], dtype=np.int64)])
    with pytest.raises(InvalidArgumentError, match="`pages` has 0 entries"):
        c.insert(t(1, 2), ())
    with pytest.raises(ArrayTypeError, match="C-contiguous"):
        c.insert(t(1, 2, 3, 4, 5, 6), (p[:1], np.repeat(p[1:], 2)[::2]))
    with pytest.raises(PageError, match="out of range"):
        c.insert(t(1, 2, 3, 4, 5, 6), (p[:2], np.array([1 << 40], dtype=np.int64)))
    assert repr(state()) == before
    assert c.insert(t(1), ()) == 0, "shorter than a page: no pages needed"
    assert c.insert(t(1, 2, 3, 4, 5, 6, 7), [p[:1], p[1:], p[:0]]) == 0
    assert c.total_size == 6 and a.ref_counts()[p].tolist() == [2, 2, 2]
    c.check_invariants()


def test_stale_handles_raise():
    a, c = make(16, 1)
    put(c, [1, 2])
    _, h, _ = c.match_prefix(t(1, 2))
    assert c.evict(2) == 2
    for op in (c.lock, c.unlock):
        with pytest.raises(StaleNodeError, match="stale"):
            op(h)
    put(c, [1, 2])  # the slot is reused: the old handle stays stale
    with pytest.raises(KeyError):
        c.lock(h)
    _, other_h, _ = make(16, 1)[1].match_prefix(t(1))
    with pytest.raises(StaleNodeError):
        c.lock(other_h)
    c.check_invariants()


def test_cache_alloc_evicts_lru_and_fails_without_side_effects():
    a, c = make(6, 1)
    put(c, [1, 1])
    put(c, [2, 2])
    put(c, [3, 3])
    c.match_prefix(t(1, 1))
    _, h, _ = c.match_prefix(t(3, 3))
    c.lock(h)
    with pytest.raises(OutOfPagesError) as e:
        c.alloc(5)
    assert (e.value.requested, e.value.free, e.value.evictable) == (5, 0, 4)
    assert c.total_size == 6 and a.num_free == 0
    assert c.try_alloc(5) is None
    p = c.alloc(2)
    assert c.match_prefix(t(2, 2))[2] == 0, "least recently used goes first"
    assert c.match_prefix(t(1, 1))[2] == 2
    with pytest.raises(ValueError, match="`-1`"):
        c.evict(-1)
    with pytest.raises(ValueError, match="`-1`"):
        c.alloc(-1)
    a.free(p)
    c.unlock(h)
    c.check_invariants()


def test_hit_and_miss_counters_and_reset():
    a, c = make(16, 2)
    put(c, [1, 2, 3, 4])
    c.match_prefix(t(1, 2, 3, 4, 5))  # 4 hit, 1 miss (partial page)
    c.match_prefix(t(9, 9))  # 2 miss
    assert (c.hit_tokens, c.miss_tokens) == (4, 3)
    _, h, _ = c.match_prefix(t(1, 2))
    c.lock(h)
    with pytest.raises(CacheBusyError, match="locked"):
        c.reset()
    assert c.total_size == 4
    c.unlock(h)
    c.reset()
    assert (c.total_size, c.hit_tokens, c.miss_tokens, a.num_free) == (0, 0, 0, 16)
    with pytest.raises(StaleNodeError):
        c.lock(h)
    c.check_invariants()


def test_empty_match_handle_can_be_locked():
    a, c = make(4, 1)
    pages, h, n = c.match_prefix(t(5, 6))
    assert (pages.tolist(), n) == ([], 0)
    c.lock(h)
    assert c.protected_size == 0
    c.unlock(h)
    with pytest.raises(LockError):
        c.unlock(h)
