"""The per-step host paths of issue 22 (CPU): packed host-to-device copies, DecodeGraph's one
copy per step, plan_extend's numpy work list, generations, recorded launches with int pointers.

Each is checked against an independent reference: the arrays themselves, the per-buffer copy
path, a Python loop over the blocks, the tensors' own ``data_ptr()``.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvpool  # noqa: E402
from kvpool import _launch, attention  # noqa: E402
from kvpool._host import (  # noqa: E402
    PACK_ALIGN,
    PackedUpload,
    pack_layout,
    packed_views,
    to_device_packed,
)
from kvpool.config import ModelSpec  # noqa: E402
from kvpool.graph import DecodeGraph  # noqa: E402

CFG = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           vocab_size=100)  # fmt: skip


def _pool(tokens=2048):
    spec = ModelSpec.from_dict(CFG, name="tiny", dtype="bf16")
    return kvpool.KVPool(kvpool.size_for(spec, "bf16", num_tokens=tokens, page_size=16), "cpu")


ARRAYS = [
    np.arange(12, dtype=np.int32).reshape(3, 4),
    np.arange(5, dtype=np.int64) - 2,
    np.array(7, dtype=np.int32),  # (0-d)
    np.zeros((0, 3), np.int32),
    np.linspace(0, 1, 7, dtype=np.float32)[::2],  # (not contiguous: copied as such)
]


def test_packed_copy_gives_the_arrays_as_views_of_one_aligned_buffer():
    offs, total = pack_layout(ARRAYS)
    assert offs == [0, 64, 128, 192, 192] and total == 256
    out = torch.full((total + 8,), 255, dtype=torch.uint8)
    got = to_device_packed(ARRAYS, "cpu", out=out)
    for a, t in zip(ARRAYS, got, strict=True):
        assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype
        assert tuple(t.shape) == a.shape and t.is_contiguous()
        assert np.array_equal(t.numpy(), a)
        if t.numel():  # (an empty view's address is meaningless)
            off = t.data_ptr() - out.data_ptr()
            assert off % PACK_ALIGN == 0 and 0 <= off < total
    # without `out` on a CPU device: separate copies, not views of the caller's arrays
    a = ARRAYS[0].copy()
    (t,) = to_device_packed([a], "cpu")
    a[0, 0] = 99
    assert int(t[0, 0]) == 0


def test_packed_copy_refuses_a_bad_out_buffer():
    with pytest.raises(ValueError, match="uint8"):
        to_device_packed(ARRAYS[:1], "cpu", out=torch.zeros(256, dtype=torch.int32))
    with pytest.raises(ValueError, match=">= 64 bytes"):
        to_device_packed(ARRAYS[:1], "cpu", out=torch.zeros(16, dtype=torch.uint8))


def test_packed_views_of_numpy_and_torch_buffers_agree():
    specs = [((2, 3), np.int32), ((4,), np.int64), ((), np.int32)]
    offs, total = pack_layout(specs)
    host = np.zeros(total, np.uint8)
    for i, v in enumerate(packed_views(host, specs, offs)):
        v[...] = 10 * i + 1
    dev = packed_views(torch.from_numpy(host), specs, offs)
    assert [t.tolist() for t in dev] == [[[1] * 3] * 2, [11] * 4, 21]


def test_packed_upload_reuses_its_ring_and_keeps_each_call_for_depth_calls():
    up = PackedUpload("cpu", depth=2)
    first = up(ARRAYS)
    for a, t in zip(ARRAYS, first, strict=True):
        assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype
        assert tuple(t.shape) == a.shape and np.array_equal(t.numpy(), a)
    # the arrays were copied: refilling them changes nothing uploaded
    b = [a + 1 if a.dtype != np.float32 else a * 2 for a in ARRAYS]
    second = up(b)
    assert all(np.array_equal(t.numpy(), a) for a, t in zip(ARRAYS, first, strict=True))
    assert all(np.array_equal(t.numpy(), a) for a, t in zip(b, second, strict=True))
    # the third call reuses the first call's buffer and views (the same tensors, new values)
    third = up(b)
    assert all(x is y for x, y in zip(first, third, strict=True))
    assert all(np.array_equal(t.numpy(), a) for a, t in zip(b, first, strict=True))
    assert first[0].data_ptr() != second[0].data_ptr()
    # another shape set in the same slot: views of the same buffer, at the layout's offsets
    big = [np.arange(300, dtype=np.int32).reshape(100, 3), np.arange(9, dtype=np.int64)]
    got = up(big)  # (slot 1)
    assert [t.tolist() for t in got] == [a.tolist() for a in big]
    assert got[1].data_ptr() - got[0].data_ptr() == 1216  # (1,200 bytes, to 64-byte lines)
    # a shape set larger than the buffer regrows it
    huge = [np.arange(100_000, dtype=np.int32)]
    assert up(huge)[0].tolist() == huge[0].tolist()
    assert up(huge)[0].tolist() == huge[0].tolist()


def test_packed_upload_refuses_bad_arguments():
    for depth in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="`depth`"):
            PackedUpload("cpu", depth=depth)
    up = PackedUpload("cpu")
    with pytest.raises(TypeError, match=r"`arrays\[1\]` is of dtype <U1"):
        up([ARRAYS[0], ["a", "b"]])
    # nothing was consumed by the refused call: the next one still uses slot 0
    assert up._next == 0
    # Python values and generators are taken as numpy.asarray takes them
    got = up(x for x in ([1, 2, 3], 7.5))
    assert [t.tolist() for t in got] == [[1, 2, 3], 7.5] and up._next == 1


def test_plan_decode_memo_gives_the_fresh_choice_for_each_batch_shape(monkeypatch):
    from kvpool.attention import plans

    pool = _pool()
    view = pool.layer(0)
    for b, width, ctx in ((1, 4, 40), (3, 8, 100), (3, 8, None)):
        pt = torch.zeros(b, width, dtype=torch.int32)
        sl = torch.full((b,), 17, dtype=torch.int32)
        monkeypatch.setattr(plans, "_PLAN_MEMO", {})
        first = attention.plan_decode(view, 4, pt, sl, max_seq_len=ctx)  # (made, memoized)
        assert len(plans._PLAN_MEMO) == 1
        pt2, sl2 = pt.clone(), sl.clone()
        again = attention.plan_decode(view, 4, pt2, sl2, max_seq_len=ctx)  # (from the memo)
        assert again.page_table is pt2 and again.seq_lens is sl2
        assert again is not first and _launch.generation(again) != _launch.generation(first)
        mine = {k: v for k, v in vars(again).items() if k not in plans._BATCH_FIELDS}
        assert mine == {k: v for k, v in vars(first).items() if k not in plans._BATCH_FIELDS}
        splits = first.num_splits
        assert (again.part_out is None) == (splits == 1)
        if splits > 1:
            assert again.part_out.shape == first.part_out.shape
            assert again.part_out.data_ptr() != first.part_out.data_ptr()
    # what the choice reads changes the key: the view's fields, the environment, knobs
    n = len(plans._PLAN_MEMO)
    view.page_size = view.page_size  # (a new generation)
    attention.plan_decode(view, 4, pt, sl)
    monkeypatch.setenv("KVPOOL_GLUON_WIDE", "0")
    attention.plan_decode(view, 4, pt, sl)
    assert len(plans._PLAN_MEMO) == n + 2
    attention.plan_decode(view, 4, pt, sl, block_n=32)  # (knobs given: never memoized)
    assert len(plans._PLAN_MEMO) == n + 2
    # values equal to a memoized one but refused fresh are refused (their types are keyed)
    attention.plan_decode(view, 4, pt, sl, max_seq_len=1)
    for bad in (True, 1.0):
        with pytest.raises(ValueError, match="max_seq_len"):
            attention.plan_decode(view, 4, pt, sl, max_seq_len=bad)
    # a swapped SM count (as tests do) is not served the choice made for the CPU's 4: 16
    # requests x 2 KV heads of 1,000 tokens take 1 split on 4 multiprocessors (32 programs
    # fill them) and 4 on 132 (the wave model, splits.default_splits)
    pt16, sl16 = torch.zeros(16, 64, dtype=torch.int32), torch.full((16,), 1000, dtype=torch.int32)
    assert attention.plan_decode(view, 4, pt16, sl16).num_splits == 1
    monkeypatch.setattr(attention.splits, "_num_sms", lambda device: 132)
    assert attention.plan_decode(view, 4, pt16, sl16).num_splits == 4
    assert attention.plan_decode(view, 4, pt16, sl16).num_splits == 4  # (its own memo entry)
    attention.clear_plan_memo()
    assert not plans._PLAN_MEMO


@pytest.mark.parametrize("n", [1, 3, 4])
def test_decode_graph_fills_its_bucket_with_one_copy_as_the_per_buffer_path(n):
    pool = _pool()
    inputs = {"input_ids": ((), torch.int64), "h": ((2,), torch.bfloat16)}
    g = DecodeGraph(pool, 4, 5, [4], inputs=inputs, use_graphs=False)
    s = g.static[4]
    buf = s.packing[0]
    packed = (s.page_table, s.seq_lens, s.slots, s.inputs["input_ids"])
    for t in packed:  # views of one buffer, each on its own 64-byte line
        assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert (t.data_ptr() - buf.data_ptr()) % PACK_ALIGN == 0
    # bf16 has no numpy dtype: a buffer of its own
    assert s.inputs["h"].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    rng = np.random.default_rng(n)
    pt = rng.integers(1, 50, (n, 5)).astype(np.int32)
    sl = rng.integers(1, 80, n).astype(np.int32)
    slots = rng.integers(16, 800, n).astype(np.int32)
    ids = rng.integers(0, 100, n)
    h = torch.randn(n, 2).to(torch.bfloat16)
    other = dataclasses.replace(s, page_table=s.page_table.clone(), seq_lens=s.seq_lens.clone(),
                                slots=s.slots.clone(),
                                inputs={k: v.clone() for k, v in s.inputs.items()},
                                packing=None)  # fmt: skip
    for st in (s, other):  # (dirty them first: the padding must be rewritten)
        for t in (st.page_table, st.seq_lens, st.slots, *st.inputs.values()):
            t.fill_(7)
        g._fill(st, n, pt, sl, slots, {"input_ids": ids, "h": h})
    assert s.page_table[:n].tolist() == pt.tolist() and s.page_table[n:].eq(0).all()
    assert s.seq_lens.tolist() == sl.tolist() + [1] * (4 - n)
    assert s.slots.tolist() == slots.tolist() + [0] * (4 - n)
    assert s.inputs["input_ids"].tolist() == ids.tolist() + [0] * (4 - n)
    pairs = [(s.page_table, other.page_table), (s.seq_lens, other.seq_lens),
             (s.slots, other.slots), *((s.inputs[k], other.inputs[k]) for k in inputs)]  # fmt: skip
    assert all(torch.equal(a, b) for a, b in pairs)
    with pytest.raises(ValueError, match="int64, expected int32"):
        g._fill(s, n, pt.astype(np.int64), sl, slots, {"input_ids": ids, "h": h})


def _work_reference(cu, block_t):
    return [(b, t) for b in range(len(cu) - 1) for t in range(0, cu[b + 1] - cu[b], block_t)]


@pytest.mark.parametrize("seed", range(4))
def test_extend_plan_work_list_and_host_cu_seqlens(seed):
    pool = _pool()
    view = pool.layer(0)
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 9))
    q_len = rng.integers(0, 70, b)
    q_len[rng.integers(0, b)] = 0  # (a request without new tokens has no block)
    cu = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
    pt = torch.ones(b, 8, dtype=torch.int32)
    sl = torch.from_numpy(q_len.astype(np.int32) + 3)
    plan = attention.plan_extend(view, 4, torch.from_numpy(cu), pt, sl)
    assert plan.work.tolist() == [list(w) for w in _work_reference(cu.tolist(), plan.block_t)]
    host = attention.plan_extend(view, 4, torch.from_numpy(cu), pt, sl, host_cu_seqlens_q=cu)
    assert torch.equal(host.work, plan.work) and host.block_t == plan.block_t
    with pytest.raises(ValueError, match="host_cu_seqlens_q` has shape"):
        attention.plan_extend(view, 4, torch.from_numpy(cu), pt, sl, host_cu_seqlens_q=cu[:-1])
    with pytest.raises(ValueError, match="numpy int32/int64"):
        attention.plan_extend(view, 4, torch.from_numpy(cu), pt, sl,
                              host_cu_seqlens_q=cu.astype(np.float32))  # fmt: skip
    bad = cu.copy()
    bad[0] = 1
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\]` = 1"):
        attention.plan_extend(view, 4, torch.from_numpy(bad), pt, sl)
    if b > 1 and cu[-1] > 0:
        bad = cu.copy()
        bad[-1] = -1
        with pytest.raises(ValueError, match=f"cu_seqlens_q\\[{b}\\]` = -1 is less"):
            attention.plan_extend(view, 4, torch.from_numpy(bad), pt, sl)


def test_every_attribute_set_gives_a_new_generation():
    pool = _pool()
    view = pool.layer(0)
    g0 = _launch.generation(view)
    assert g0 is not None and g0 != _launch.generation(pool.layer(1))
    twin = copy.copy(view)  # (the same generation until either changes)
    assert _launch.generation(twin) == g0
    twin.k = view.k[:, :1]
    assert _launch.generation(twin) > g0 and _launch.generation(view) == g0
    view.layer = view.layer  # (any set counts, even of the same value)
    assert _launch.generation(view) not in (g0, _launch.generation(twin))
    plan = attention.plan_decode(view, 4, torch.ones(2, 3, dtype=torch.int32),
                                 torch.ones(2, dtype=torch.int32))  # fmt: skip
    g = _launch.generation(plan)
    plan.num_splits = plan.num_splits
    assert _launch.generation(plan) != g


def test_pool_layer_lookup_takes_ints_and_refuses_bools_and_floats():
    pool = _pool()
    for i in pool.layers:
        assert pool.layer(i) is pool.layer(np.int64(i)) is pool._views[i]
    for bad in (True, 0.0, "0", 99, -1):
        with pytest.raises(KeyError):
            pool.layer(bad)


# ----------------------------------------------------------------------------- int pointers


class _Compiled:
    function = 7
    packed_metadata = "meta"

    def __init__(self, calls):
        self.run = lambda *a: calls.append(a)


class _Kernel:
    """A JIT function's stand-in: its signature, a compiled kernel that records its launches."""

    def __init__(self, fn):
        self.signature, self.calls = fn.signature, []

    def warmup(self, *args, grid, **kw):
        return _Compiled(self.calls)


class _Driver:
    def get_current_stream(self, device=None):
        return 1234

    def get_current_device(self):
        return 0


def test_fast_replay_passes_every_pointer_as_an_int(monkeypatch):
    import triton
    import triton.language as tl
    from triton.runtime import driver

    @triton.jit
    def axpy(x, y, out, n, A: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + i, A * tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)

    kern = _Kernel(axpy)
    monkeypatch.setattr(_launch, "FAST_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(driver, "_active", _Driver())
    x, y, out = torch.zeros(8), torch.ones(8), torch.empty(8)
    rec = _launch.Launch(kern, (2,), (x, y, out, 8), {"A": 3.0, "BLOCK": 4}, (x, out), x.device)
    assert rec.fast and y in rec.keep  # (the recorded tensor is kept alive by the record)
    x2, out2 = torch.zeros(8), torch.empty(8)
    rec(x2, out2)
    _launch.replay([rec, rec], (x, out), (x.data_ptr(), out.data_ptr()))
    want = [(2, 1, 1, 1234, 7, "meta", None, None, None, p[0], y.data_ptr(), p[1], 8, 3.0, 4)
            for p in ((x2.data_ptr(), out2.data_ptr()), (x.data_ptr(), out.data_ptr()),
                      (x.data_ptr(), out.data_ptr()))]  # fmt: skip
    assert kern.calls == want
    assert all(type(v) is int for call in kern.calls for v in call[9:12])


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode:UserWarning")
def test_packed_upload_on_cuda_keeps_queued_readers_and_never_syncs():
    """The pinned path: values arrive; work queued before the ring comes back to a buffer
    still reads that call's values (the copy is stream-ordered), with the GPU held back by a
    spin so the host runs ahead; no call syncs with the host."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    up = PackedUpload("cuda", depth=2)
    table = np.arange(256 * 5, dtype=np.int32).reshape(256, 5)
    lens = np.arange(256, dtype=np.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.cuda._sleep(50_000_000)  # (the GPU is busy: the copies below wait in the stream)
        first = up([table, lens])
        kept = [t * 1 for t in first]  # (queued readers of the first call's buffer)
        up([table + 1, lens + 1])
        third = up([table + 2, lens + 2])  # (the first call's buffer again)
        assert all(a is b for a, b in zip(first, third, strict=True))
        late = [t * 1 for t in third]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert [t.cpu().numpy().tolist() for t in kept] == [table.tolist(), lens.tolist()]
    assert [t.cpu().numpy().tolist() for t in late] == [(table + 2).tolist(), (lens + 2).tolist()]
    assert first[0].dtype == torch.int32 and first[0].is_cuda
