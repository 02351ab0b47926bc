"""Review of the host fast paths (CPU).

- ``to_device_packed(out=...)``: the views are of ``out`` (a slice of a larger buffer
  included), not of the start of its storage; an ``out`` whose views could not be 16-byte
  aligned, or that is strided, is a ValueError.
- The decode record key follows the *contents* of ``variants._GLUON_FP8_OPTIONS`` (a module
  switch reassigned by benchmarks), not its ``id``: CPython reuses a freed dict's address, so
  two different option tables met in turn had the same key and the first one's launch replayed.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvpool  # noqa: E402
from kvpool import attention  # noqa: E402
from kvpool.attention import replay, variants  # noqa: E402
from kvpool.config import ModelSpec  # noqa: E402

SMOL = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            vocab_size=100)  # fmt: skip


def _arrays():
    return [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int64) + 100,
            np.full((2, 3), 7, dtype=np.int32)]  # fmt: skip


@pytest.mark.parametrize("start", [0, 64, 128])
@pytest.mark.parametrize("extra", [0, 3])
def test_packed_copy_into_a_slice_of_a_larger_buffer(start, extra):
    arrays = _arrays()
    _, total = kvpool._host.pack_layout(arrays)
    big = torch.zeros(start + total + extra + 64, dtype=torch.uint8)
    out = big[start : start + total + extra]
    got = kvpool.to_device_packed(arrays, "cpu", out=out)
    for t, a in zip(got, arrays, strict=True):
        assert np.array_equal(t.numpy(), a)
        assert out.data_ptr() <= t.data_ptr() < out.data_ptr() + total
        assert t.data_ptr() % 16 == 0
    assert big[:start].eq(0).all()  # (nothing written before out)


def test_packed_copy_refuses_an_unaligned_or_strided_out():
    arrays = _arrays()
    _, total = kvpool._host.pack_layout(arrays)
    big = torch.zeros(2 * total + 64, dtype=torch.uint8)
    base = big.data_ptr() % 16
    with pytest.raises(ValueError, match="`out`"):
        kvpool.to_device_packed(arrays, "cpu", out=big[(20 - base) % 16 + 4 :])
    with pytest.raises(ValueError, match="`out`"):
        kvpool.to_device_packed(arrays, "cpu", out=big[::2])


def test_decode_record_key_follows_the_fp8_option_table():
    spec = ModelSpec.from_dict(SMOL, name="smol", dtype="bf16")
    view = kvpool.KVPool(kvpool.size_for(spec, "fp8_e4m3", num_tokens=4096, page_size=16),
                         "cpu").layer(0)  # fmt: skip
    pt, sl = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    plan = attention.plan_decode(view, 9, pt, sl, num_splits=1)
    q = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    orig = variants._GLUON_FP8_OPTIONS
    base = dict(orig)

    def key():
        return replay.decode_key(view, q, plan, None, None, 0.125, None, None, "auto", False)

    keys, ids = set(), set()
    try:
        for i in range(8):
            # (a new table each time, assigned as benches/attention/probes/gluon_fp8_diet.py
            # does: the previous one is freed, and its address reused)
            variants._GLUON_FP8_OPTIONS = {**base, "fp8_e4m3": (bool(i & 1), float(i), False)}
            ids.add(id(variants._GLUON_FP8_OPTIONS))
            keys.add(key())
        assert len(keys) == 8, f"{len(keys)} keys for 8 option tables ({len(ids)} distinct ids)"
        # the same contents in a new dict: the same key (records still hit)
        variants._GLUON_FP8_OPTIONS = dict(base)
        k1 = key()
        keep = variants._GLUON_FP8_OPTIONS
        variants._GLUON_FP8_OPTIONS = dict(base)
        assert key() == k1 and keep is not variants._GLUON_FP8_OPTIONS
    finally:
        variants._GLUON_FP8_OPTIONS = orig


def _tiny_view():
    cfg = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               vocab_size=100)  # fmt: skip
    spec = ModelSpec.from_dict(cfg, name="tiny", dtype="bf16")
    view = kvpool.KVPool(kvpool.size_for(spec, "bf16", num_tokens=256, page_size=16), "cpu").layer(
        0
    )
    g = torch.Generator().manual_seed(0)
    view.k.copy_(torch.randn(view.k.shape, generator=g))
    view.v.copy_(torch.randn(view.v.shape, generator=g))
    pt = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    sl = torch.tensor([20, 9], dtype=torch.int32)
    return view, pt, sl, g


def test_an_in_place_decode_is_not_recorded():
    """``out=q``: one object in two per-call places; no record (see the interpreted test)."""
    view, pt, sl, _ = _tiny_view()
    plan = attention.plan_decode(view, 4, pt, sl, num_splits=1, gluon=False)
    q = torch.zeros(2, 4, 32, dtype=torch.bfloat16)
    assert replay.decode_key(view, q, plan, q, None, 0.2, None, None, "triton", False) is None
    assert replay.decode_key(view, q, plan, None, None, 0.2, None, None, "triton", False)


@pytest.mark.interpret
def test_decode_after_an_in_place_decode_reads_its_own_q():
    """A decode with ``out=q`` recorded one pointer for both places: the next call of the same
    kind with its own ``out`` read ``out`` (zeros) as q."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    view, pt, sl, g = _tiny_view()
    plan = attention.plan_decode(view, 4, pt, sl, num_splits=1, gluon=False)
    q1 = torch.randn(2, 4, 32, generator=g).bfloat16()
    qq = q1.clone()
    attention.decode(view, qq, plan=plan, out=qq, sm_scale=0.2, backend="triton")
    ref1 = attention.decode(view, q1, pt, sl, sm_scale=0.2, backend="torch")
    assert (qq.float() - ref1.float()).abs().max() < 0.05
    q2 = torch.randn(2, 4, 32, generator=g).bfloat16()
    out2 = torch.zeros_like(q2)
    attention.decode(view, q2, plan=plan, out=out2, sm_scale=0.2, backend="triton")
    ref2 = attention.decode(view, q2, pt, sl, sm_scale=0.2, backend="torch")
    assert (out2.float() - ref2.float()).abs().max() < 0.05


def test_a_deep_copied_view_has_no_records_and_a_generation_of_its_own():
    """A record holds the buffers' addresses as ints (CUDA's fast replay): kept on a deep copy
    at the same generation it would replay there on the original's buffers."""
    import copy

    from kvpool import _launch

    view, pt, sl, _ = _tiny_view()
    _launch.records(view)["x"] = object()  # (any record)
    plan = attention.plan_decode(view, 4, pt, sl, num_splits=1, gluon=False)
    replay._plan_key(plan)
    twin = copy.deepcopy(view)
    assert _launch.generation(twin) not in (None, _launch.generation(view))
    assert "_launch_records" not in twin.__dict__ and "x" in _launch.records(view)
    assert twin.k is not view.k and torch.equal(twin.k, view.k) and twin.dtype == view.dtype
    p2 = copy.deepcopy(plan)
    assert "_launch_key" not in p2.__dict__ and p2.page_table is not plan.page_table
    assert _launch.generation(p2) != _launch.generation(plan)
    assert _launch.generation(copy.copy(view)) == _launch.generation(view)  # (same buffers)
