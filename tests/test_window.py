"""Sliding-window page recycling (``kvpool.release_window_pages``) and state slots.

The bound checked is the one the sizing plan reserves per request and sliding group: a request of
``n`` tokens holds at most ``ceil(min(n, w + d) / ps) + (1 if ps > 1 else 0)`` pages (window ``w``,
``d`` draft tokens a speculative step may roll back). Worked example: ps 16, w 128, n 8192, d 0:
positions 8064..8191 are kept, entries 504..511, i.e. 8 pages = ceil(128 / 16); were they not page
aligned (n 8200: positions 8072..8199, entries 504..512) 9 = 8 + 1 pages.
"""

import kvpool
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool import (
    ArrayTypeError,
    BatchError,
    InvalidArgumentError,
    OutOfPagesError,
    PageAllocator,
    PageError,
    StateSlotAllocator,
)


def i32(*xs):
    return np.array(xs, dtype=np.int32)


def bound(n, w, d, ps):
    return -(-min(n, w + d) // ps) + (1 if ps > 1 else 0)


def kept_entries(n, w, d, ps):
    """Entries that intersect positions [max(0, n - w - d), n - 1] (independent of the helper)."""
    if n == 0:
        return set()
    lo = max(0, n - w - d)
    return {p // ps for p in range(lo, n)}


def test_worked_example_page_16_window_128():
    ps, w = 16, 128
    a = PageAllocator(600, ps)
    for n, held in [(8192, 8), (8200, 9)]:
        pages = a.alloc(-(-n // ps))
        table = pages.reshape(1, -1).copy()
        fl = np.zeros(1, dtype=np.int32)
        released = kvpool.release_window_pages(a, table, i32(n), w, first_live=fl)
        assert released == len(pages) - held
        assert np.count_nonzero(table) == held <= bound(n, w, 0, ps) == 9  # the bound: 8 + 1
        assert fl.tolist() == [(n - w) // ps]
        assert a.num_used == held
        a.free(table[table != 0])


@settings(max_examples=150, deadline=None)
@given(
    ps=st.integers(1, 8),
    w=st.integers(1, 40),
    d=st.integers(0, 4),
    b=st.integers(1, 4),
    use_first_live=st.booleans(),
    data=st.data(),
)
def test_decode_with_drafts_holds_the_bound_and_leaks_nothing(ps, w, d, b, use_first_live, data):
    """Random batches grow by random steps (prefill chunks, decode, speculative steps that roll
    back some drafts); after each release every request holds exactly the pages that intersect
    its kept positions, never more than the bound, and the allocator's count equals the pages the
    page table holds."""
    steps = data.draw(st.integers(1, 25))
    max_pages = steps * (2 * w + 3 + d) // ps + 2  # never full: every step grows as drawn
    a = PageAllocator(b * max_pages, ps)
    table = np.zeros((b, max_pages), dtype=np.int32)
    seq = np.zeros(b, dtype=np.int64)
    fl = np.zeros(b, dtype=np.int32) if use_first_live else None
    for _ in range(steps):
        grow = np.array([data.draw(st.integers(0, 2 * w + 3)) for _ in range(b)], dtype=np.int64)
        new = seq + grow + d
        need = kvpool.pages_needed(seq, new, ps)
        kvpool.assign_pages(table, seq, new, a.alloc(int(need.sum())), ps)
        # The speculative step: `new` includes d drafts, which may still roll back.
        kvpool.release_window_pages(a, table, new, w, num_draft_tokens=d, first_live=fl)
        for i in range(b):
            held = set(np.flatnonzero(table[i]).tolist())
            assert held == kept_entries(int(new[i]), w, d, ps)
            assert len(held) <= bound(int(new[i]), w, d, ps)
        assert a.num_used == np.count_nonzero(table)
        # Commit: accept some drafts, free the pages past the accepted length, release again.
        rejected = [data.draw(st.integers(0, min(d, int(new[i] - seq[i])))) for i in range(b)]
        keep = new - np.array(rejected, dtype=np.int64)
        for i in range(b):
            lo = -(-int(keep[i]) // ps)
            gone = table[i, lo:][table[i, lo:] != 0]
            # Rolling back never needs a page released before: the kept window still holds.
            assert kept_entries(int(keep[i]), w, 0, ps) <= set(np.flatnonzero(table[i]).tolist())
            a.free(gone)
            table[i, lo:] = 0
        seq = keep
        kvpool.release_window_pages(a, table, seq, w, first_live=fl)
        for i in range(b):
            held = set(np.flatnonzero(table[i]).tolist())
            assert held == kept_entries(int(seq[i]), w, 0, ps)
            assert len(held) <= bound(int(seq[i]), w, 0, ps)
        assert a.num_used == np.count_nonzero(table)
        if fl is not None:  # first_live is the first entry still held (or past the released ones)
            for i in range(b):
                assert not table[i, : fl[i]].any()
    a.free(table[table != 0])
    assert a.num_used == 0


def test_bad_arguments_raise_naming_them_and_change_nothing():
    a = PageAllocator(8, 2)
    p = a.alloc(3)
    table = np.array([[p[0], p[1], p[2]], [0, 7, 0]], dtype=np.int32)  # page 7 is free
    fl = np.zeros(2, dtype=np.int32)
    before = (table.copy(), a.ref_counts().tolist(), fl.copy())
    with pytest.raises(PageError, match=r"page_table\[1, 1\].*page `7` is not allocated"):
        kvpool.release_window_pages(a, table, i32(6, 6), 2, first_live=fl)
    with pytest.raises(BatchError, match="page_table"):
        kvpool.release_window_pages(a, table, i32(6), 2)
    with pytest.raises(BatchError, match="first_live"):
        kvpool.release_window_pages(a, table, i32(6, 6), 2, first_live=i32(0))
    with pytest.raises(BatchError, match=r"first_live\[1\]"):
        kvpool.release_window_pages(a, table, i32(6, 6), 2, first_live=i32(0, 4))
    with pytest.raises(BatchError, match="window"):
        kvpool.release_window_pages(a, table, i32(6, 6), 0)
    with pytest.raises(BatchError, match="seq_lens"):
        kvpool.release_window_pages(a, table, i32(6, -1), 2)
    with pytest.raises(InvalidArgumentError, match="num_draft_tokens"):
        kvpool.release_window_pages(a, table, i32(6, 6), 2, num_draft_tokens=-1)
    with pytest.raises(ArrayTypeError, match="first_live"):
        kvpool.release_window_pages(a, table, i32(6, 6), 2, first_live=np.zeros(2, dtype=np.int64))
    with pytest.raises(ArrayTypeError, match="page_table"):
        kvpool.release_window_pages(a, table.astype(np.int64), i32(6, 6), 2)
    assert table.tolist() == before[0].tolist()
    assert a.ref_counts().tolist() == before[1]
    assert fl.tolist() == before[2].tolist()


def test_shared_page_in_two_rows_drops_one_reference_each():
    a = PageAllocator(8, 1)
    p = a.alloc(3)
    a.inc_ref(p[:1])  # a prefix page two requests share
    table = np.array([[p[0], p[1]], [p[0], p[2]]], dtype=np.int32)
    assert kvpool.release_window_pages(a, table, i32(2, 2), 1) == 2
    assert table.tolist() == [[0, p[1]], [0, p[2]]]
    assert a.ref_counts()[p[0]] == 0 and a.num_used == 2


def test_pages_the_cache_holds_keep_its_reference():
    a = PageAllocator(8, 1)
    c = kvpool.RadixCache(a)
    p = a.alloc(3)
    c.insert(i32(1, 2, 3), p)
    table = p.reshape(1, 3).copy()
    kvpool.release_window_pages(a, table, i32(3), 1)
    assert a.ref_counts()[p].tolist() == [1, 1, 2]  # the cache's reference stays
    with pytest.raises(PageError, match="prefix cache"):
        kvpool.release_window_pages(a, p.reshape(1, 3).copy(), i32(3), 1)


def test_state_slots_one_per_request_atomic_and_named():
    s = StateSlotAllocator(3)
    assert (s.num_slots, s.num_free, s.num_used) == (3, 3, 0)
    slots = s.alloc(2)
    assert slots.dtype == np.int32 and sorted(slots.tolist()) == [1, 2]  # slot 0 is padding
    with pytest.raises(OutOfPagesError, match="state slots") as e:
        s.alloc(2)
    assert (e.value.requested, e.value.free, e.value.evictable) == (2, 1, 0)
    assert s.num_free == 1 and s.try_alloc(2) is None
    with pytest.raises(PageError, match="state slot"):
        s.free(i32(slots[0], slots[0]))
    with pytest.raises(PageError, match="padding"):
        s.free(i32(0))
    assert s.num_used == 2
    s.inc_ref(slots[:1])
    s.free(slots)
    assert s.ref_counts().tolist() == [0, 1, 0, 0]
    s.free(slots[:1])
    assert s.num_free == 3
    with pytest.raises(InvalidArgumentError):
        StateSlotAllocator(0)
