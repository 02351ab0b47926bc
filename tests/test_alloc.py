"""PageAllocator and the batch helpers (page table, slots) through the Python API."""

import numpy as np
import pytest

import kvpool
from kvpool import (
    ArrayTypeError,
    BatchError,
    InvalidArgumentError,
    OutOfPagesError,
    PageAllocator,
    PageError,
)


def i32(*xs):
    return np.array(xs, dtype=np.int32)


def test_pages_are_one_to_n_int32_never_padding():
    a = PageAllocator(5, 16)
    assert (a.num_pages, a.page_size, a.num_free, a.num_used) == (5, 16, 5, 0)
    p = a.alloc(5)
    assert p.dtype == np.int32 and p.shape == (5,)
    assert sorted(p.tolist()) == [1, 2, 3, 4, 5]
    assert (a.num_free, a.num_used) == (0, 5)
    assert a.ref_counts().tolist() == [0, 1, 1, 1, 1, 1]
    assert a.alloc(0).shape == (0,)


def test_out_of_pages_is_a_memory_error_with_numbers_and_changes_nothing():
    a = PageAllocator(4, 1)
    a.alloc(3)
    with pytest.raises(MemoryError) as e:
        a.alloc(2)
    assert isinstance(e.value, OutOfPagesError)
    assert (e.value.requested, e.value.free, e.value.evictable) == (2, 1, 0)
    assert "`2`" in str(e.value)
    assert a.num_free == 1
    assert a.try_alloc(2) is None
    assert a.num_free == 1
    assert a.try_alloc(1).tolist() == [4]


@pytest.mark.parametrize("page_size", [1, 16])
def test_kvb21_double_free_never_aliases_a_page(page_size):
    """KVB-21 (docs/architecture.md): double free, duplicate in one call, retain/release counts."""
    a = PageAllocator(4, page_size)
    p = a.alloc(1)
    a.free(p)
    with pytest.raises(PageError, match=f"`{p[0]}`"):
        a.free(p)
    assert a.num_free == 4
    x, y = a.alloc(2), a.alloc(2)
    assert len(set(x.tolist()) | set(y.tolist())) == 4
    with pytest.raises(OutOfPagesError):
        a.alloc(1)
    q = int(x[0])
    with pytest.raises(PageError, match="more than once"):
        a.free(i32(q, q))
    assert a.ref_counts()[q] == 1
    a.free(i32(q))
    assert a.num_free == 1
    assert a.alloc(1).tolist() == [q]

    a = PageAllocator(4, page_size)
    p = a.alloc(1)
    a.inc_ref(p)
    assert a.ref_counts()[p[0]] == 2
    a.free(p)
    assert a.num_free == 3
    a.free(p)
    assert a.num_free == 4, "the page returns exactly once, on the second release"
    with pytest.raises(PageError):
        a.free(p)
    assert a.num_free == 4


@pytest.mark.parametrize(
    "bad, match",
    [([1, 0], "padding"), ([1, 5], "`5` is out of range"), ([1, -3], "`-3`"), ([1, 3], "`3` is not allocated"),
     ([2, 1, 2], "`2` appears more than once")],
)
def test_free_and_inc_ref_are_atomic(bad, match):
    a = PageAllocator(4, 1)
    a.alloc(2)
    before = a.ref_counts().copy()
    for op in (a.free, a.inc_ref):
        for dtype in (np.int32, np.int64):
            with pytest.raises(PageError, match=match):
                op(np.array(bad, dtype=dtype))
            assert (a.ref_counts() == before).all()
            assert a.num_free == 2


def test_int64_pages_beyond_int32_are_out_of_range():
    a = PageAllocator(4, 1)
    with pytest.raises(PageError, match=str(1 << 40)):
        a.free(np.array([1 << 40], dtype=np.int64))


@pytest.mark.parametrize(
    "pages",
    [[1], np.array([1.0]), np.array([1], dtype=np.uint8), np.array([[1]], dtype=np.int32), 1,
     np.array([1, 2, 3, 4], dtype=np.int32)[::2]],
)
def test_wrong_arrays_raise_array_type_error(pages):
    a = PageAllocator(4, 1)
    a.alloc(4)
    with pytest.raises(ArrayTypeError) as e:
        a.free(pages)
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)
    assert "`pages`" in str(e.value)
    assert a.num_free == 0


def test_bad_sizes_and_negative_counts():
    with pytest.raises(InvalidArgumentError, match="num_pages"):
        PageAllocator(0, 1)
    with pytest.raises(InvalidArgumentError, match="page_size"):
        PageAllocator(4, 0)
    with pytest.raises(InvalidArgumentError, match="`-1`"):
        PageAllocator(-1, 1)
    with pytest.raises(InvalidArgumentError, match="int32"):
        PageAllocator(1 << 30, 16)
    a = PageAllocator(4, 1)
    for op in (a.alloc, a.try_alloc):
        with pytest.raises(ValueError, match="`-2`"):
            op(-2)
    assert a.num_free == 4


# --- batch helpers -------------------------------------------------------------------------------


def test_page_table_pads_with_padding_page():
    t = kvpool.page_table([i32(3, 4), np.array([], dtype=np.int32), np.array([7], dtype=np.int64)])
    assert t.dtype == np.int32
    assert t.tolist() == [[3, 4], [0, 0], [7, 0]]
    assert kvpool.page_table([i32(1)], 3).tolist() == [[1, 0, 0]]
    out = np.full((2, 4), -1, dtype=np.int32)
    r = kvpool.page_table([i32(5), i32(6, 7)], out=out)
    assert r is out or np.shares_memory(r, out)
    assert out.tolist() == [[5, 0, 0, 0], [6, 7, 0, 0]]
    with pytest.raises(BatchError, match="max_pages"):
        kvpool.page_table([i32(1, 2, 3)], 2)
    with pytest.raises(ArrayTypeError):
        kvpool.page_table([[1, 2]])


def slots_by_hand(table, prefix, seq, ps):
    out = []
    for row, p, s in zip(table, prefix, seq):
        out += [int(row[t // ps]) * ps + t % ps for t in range(p, s)]
    return out


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("lens_dtype", [np.int32, np.int64])
def test_extend_fills_the_last_partial_page_first(ps, lens_dtype):
    rng = np.random.default_rng(ps)
    a = PageAllocator(1024, ps)
    prefix = rng.integers(0, 40, size=6).astype(lens_dtype)
    seq = (prefix + rng.integers(0, 40, size=6)).astype(lens_dtype)
    width = int(-(-seq.max() // ps))
    rows = [a.alloc(-(-int(p) // ps)) for p in prefix]
    table = kvpool.page_table(rows, width)
    need = kvpool.pages_needed(prefix, seq, ps)
    assert need.tolist() == [-(-int(s) // ps) - (-(-int(p) // ps)) for p, s in zip(prefix, seq)]
    new = a.alloc(int(need.sum()))
    kvpool.assign_pages(table, prefix, seq, new, ps)
    # Each row: its old pages, then its share of `new`, in order.
    k = 0
    for i, row in enumerate(rows):
        n = int(need[i])
        expect = row.tolist() + new[k : k + n].tolist()
        k += n
        assert table[i, : len(expect)].tolist() == expect
        assert (table[i, len(expect) :] == 0).all()
    slots = kvpool.extend_slots(table, prefix, seq, ps)
    assert slots.dtype == np.int32
    assert slots.tolist() == slots_by_hand(table, prefix, seq, ps)
    # The first new token of a request with a partial page lands in that (old) page.
    starts = np.concatenate([[0], np.cumsum(seq - prefix)[:-1]])
    for i, p in enumerate(prefix):
        if p % ps and seq[i] > p:
            assert slots[starts[i]] == rows[i][-1] * ps + p % ps
    out = np.zeros(int((seq - prefix).sum()), dtype=np.int32)
    kvpool.extend_slots(table, prefix, seq, ps, out=out)
    assert out.tolist() == slots.tolist()
    # Decode: one more token each.
    seq2 = seq + 1
    need2 = kvpool.pages_needed(seq, seq2, ps)
    table2 = kvpool.page_table([table[i, : -(-int(s) // ps)] for i, s in enumerate(seq)], width + 1)
    kvpool.assign_pages(table2, seq, seq2, a.alloc(int(need2.sum())), ps)
    d = kvpool.decode_slots(table2, seq2, ps)
    assert d.tolist() == slots_by_hand(table2, seq, seq2, ps)


def test_batch_errors_name_the_request_and_leave_outputs_alone():
    table = np.array([[5, 0]], dtype=np.int32)
    out = np.full(3, -7, dtype=np.int32)
    with pytest.raises(BatchError, match="request 0: token 2"):
        kvpool.extend_slots(table, i32(0), i32(3), 2, out=out)
    assert out.tolist() == [-7, -7, -7]
    with pytest.raises(BatchError, match="below `prefix_lens`"):
        kvpool.pages_needed(i32(3), i32(2), 2)
    with pytest.raises(BatchError, match="negative"):
        kvpool.pages_needed(i32(-1), i32(2), 2)
    with pytest.raises(BatchError, match="`prefix_lens` has 2 entries"):
        kvpool.pages_needed(i32(0, 0), i32(2), 2)
    with pytest.raises(BatchError, match="`new_pages` has 2 entries, expected 1"):
        kvpool.assign_pages(table, i32(2), i32(3), i32(1, 2), 2)
    assert table.tolist() == [[5, 0]]
    with pytest.raises(ArrayTypeError, match="2-D numpy int32"):
        kvpool.extend_slots(table.astype(np.int64), i32(0), i32(1), 2)
    with pytest.raises(ArrayTypeError, match="`seq_lens`"):
        kvpool.decode_slots(table, np.array([1.0]), 2)
    # was "`seq_lens - 1[0]` is negative: `-1`" (user review)
    with pytest.raises(BatchError, match=r"`seq_lens\[0\]` = 0: a decode step needs at least one"):
        kvpool.decode_slots(table, i32(0), 2)
    with pytest.raises(ValueError, match="page_size"):
        kvpool.pages_needed(i32(0), i32(1), -1)


def i64(*xs):
    return np.array(xs, dtype=np.int64)


@pytest.mark.parametrize("n", [2**40, 2**62])
def test_huge_alloc_is_out_of_pages_not_an_abort(n):
    # the output vector used to be reserved for `n` pages before the free count was checked:
    # 2^40 aborted the process, 2^62 panicked
    a = PageAllocator(8, 1)
    cache = kvpool.RadixCache(a)
    for alloc in (a.alloc, cache.alloc):
        with pytest.raises(OutOfPagesError) as e:
            alloc(n)
        assert e.value.requested == n
    assert a.try_alloc(n) is None and cache.try_alloc(n) is None
    assert a.num_free == 8


@pytest.mark.parametrize("call", [
    lambda: PageAllocator(True, 1),
    lambda: PageAllocator(8, True),
    lambda: PageAllocator(8, 1).alloc(True),
    lambda: PageAllocator(8, 1).try_alloc(False),
    lambda: kvpool.RadixCache(PageAllocator(8, 1)).evict(True),
    lambda: kvpool.pages_needed(i32(0), i32(5), True),
    lambda: kvpool.page_table([i32(1)], True),
])  # fmt: skip
def test_bools_are_not_counts(call):
    with pytest.raises(TypeError, match="got the bool `(True|False)`"):
        call()


def test_numpy_integer_counts_are_accepted():
    a = PageAllocator(np.int64(8), np.int32(2))
    assert a.alloc(np.int64(3)).shape == (3,)
    assert kvpool.pages_needed(i32(0), i32(5), np.int64(2)).tolist() == [3]


def test_sequences_beyond_int32_slots_are_refused():
    # 2^31 tokens or more cannot have int32 slot indices; page counts used to wrap to int32
    # (pages_needed gave [0, 5, -2147483648] for 2^40, 2^32 + 5, 2^31 at page_size 1)
    with pytest.raises(BatchError, match=r"`seq_lens\[0\]` = 1099511627776: more tokens than int32"):
        kvpool.pages_needed(i64(0, 0), i64(2**40, 5), 1)
    with pytest.raises(BatchError, match=r"`seq_lens\[2\]` = 2147483648"):
        kvpool.pages_needed(i64(0, 0, 0), i64(1, 2**31 - 1, 2**31), 1)
    assert kvpool.pages_needed(i64(0), i64(2**31 - 1), 1).tolist() == [2**31 - 1]
    table = np.full((2, 4), 3, dtype=np.int32)
    for seq in (i64(2**40, 1), i64(2**63 - 1, 2**63 - 1)):
        with pytest.raises(BatchError, match="more tokens than int32"):
            kvpool.extend_slots(table, i64(0, 0), seq, 4)


def test_outputs_too_large_raise_before_any_allocation():
    # a request the page table cannot hold is refused before its slot array exists
    with pytest.raises(BatchError, match="request 0 needs 268435456 pages, .* `max_pages` = 4"):
        kvpool.extend_slots(np.full((1, 4), 3, dtype=np.int32), i64(0), i64(2**30), 4)
    # numpy's own MemoryError, not a panic, for a table too wide to allocate
    with pytest.raises(MemoryError):
        kvpool.page_table([i32(1)], 2**40)


@pytest.mark.parametrize("bad, index, value", [((-7, 8), 0, -7), ((3, 0), 1, 0)])
def test_assign_pages_refuses_padding_and_negative_ids(bad, index, value):
    table = np.zeros((1, 4), dtype=np.int32)
    with pytest.raises(BatchError, match=rf"`new_pages\[{index}\]` = {value}: page ids start at 1"):
        kvpool.assign_pages(table, i64(0), i64(5), i32(*bad), 4)
    assert table.tolist() == [[0, 0, 0, 0]]


def test_extend_slots_ignores_requests_without_new_tokens():
    # request 1 adds no token: its (short) table row is never read, so it is not checked
    table = np.array([[1, 2], [3, 0]], dtype=np.int32)
    got = kvpool.extend_slots(table, i64(0, 12), i64(5, 12), 4)
    assert got.tolist() == [4, 5, 6, 7, 8]
    with pytest.raises(BatchError, match="request 1 needs 4 pages"):
        kvpool.extend_slots(table, i64(0, 12), i64(5, 13), 4)


def test_bool_tensors_are_not_counts():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="dtype `torch.bool`"):
        PageAllocator(8, 1).alloc(torch.tensor(True))
    with pytest.raises(TypeError, match="dtype `bool`"):
        PageAllocator(8, 1).alloc(np.array(True))
    with pytest.raises(kvpool.ModelConfigError, match="`tp_size` must be an integer"):
        kvpool.size_for("Qwen/Qwen3-8B", "bf16", num_tokens=16, tp_size=torch.tensor(True))
    assert PageAllocator(8, 1).alloc(torch.tensor(2)).shape == (2,)
