"""Fused paged attention (kvpool.attention): KVB-16 (docs/architecture.md, failure cases) for
every dtype through the torch reference, the interpreted Triton kernels and the GPU; the CPU
reference against the fp64 oracle; the pool's entry points.

The oracle and the cache builders live in ``attention_helpers.py``; the kernels' own tests in
``test_attention_decode.py`` / ``test_attention_extend.py``, the plans in
``test_attention_plans.py``, the kernel-variant choice in ``test_attention_variants.py``,
bad input in ``test_attention_checks.py``.
"""

import math

import pytest

torch = pytest.importorskip("torch")

from attention_helpers import (  # noqa: E402
    DTYPES,
    Cache,
    check_kvb16,
    q_dtype,
    rel_err,
    run_decode,
    run_extend,
)
from kvpool import attention  # noqa: E402
from kvpool.pool import LayerView  # noqa: E402

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu


# ------------------------------------------------------------------------------------- KVB-16


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvb16_reference(dtype):
    check_kvb16(dtype, "torch")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what", ["decode", "extend"])
def test_kvb16_triton_interpret(dtype, what):
    check_kvb16(dtype, "triton", what=what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what", ["decode", "extend"])
def test_kvb16_gpu(dtype, what):
    check_kvb16(dtype, "triton", device="cuda", what=what)


# ------------------------------------------------------------------------------ CPU reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_decode_matches_oracle(dtype):
    cache = Cache(dtype, [1, 17, 40], heads=2, d=32, page=16)
    out, ref = run_decode(cache, 4, backend="torch")
    assert out.dtype == q_dtype(dtype)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize(
    "opts",
    [
        {"window": 5},
        {"softcap": 2.0},
        {"sm_scale": 0.7},
        {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    ],
)
def test_reference_decode_options(opts):
    cache = Cache("fp32", [3, 33], heads=2, d=16, page=4)
    out, ref = run_decode(cache, 4, backend="torch", **opts)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", ["fp32", "fp8_e4m3", "nvfp4"])
def test_reference_extend_matches_oracle(dtype):
    cache = Cache(dtype, [5, 16, 30, 1], heads=2, d=32, page=16)
    out, ref = run_extend(cache, 4, [5, 3, 0, 1], backend="torch", window=7)
    assert rel_err(out, ref) < 1e-2 if dtype != "fp32" else 1e-5


def test_reference_matches_manual_softmax():
    """A hand-checkable case: 1 head, 2 tokens, scores 0 and ln 3 -> weights 1/4, 3/4."""
    v = LayerView(
        layer=0,
        dtype="fp32",
        page_size=1,
        num_kv_heads=1,
        head_dim=16,
        v_head_dim=16,
        k=torch.zeros(3, 1, 16),
        v=torch.zeros(3, 1, 16),
    )
    v.k[2, 0, 0] = math.log(3)
    v.v[1, 0, 0] = 4.0
    v.v[2, 0, 1] = 8.0
    q = torch.zeros(1, 1, 16)
    q[0, 0, 0] = 1.0
    out = attention.decode(
        v,
        q,
        torch.tensor([[1, 2]], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        sm_scale=1.0,
    )
    assert out[0, 0, :2].tolist() == pytest.approx([1.0, 6.0])


# -------------------------------------------------------------------------- pool entry points


def test_pool_methods_delegate_to_attention():
    import kvpool
    from kvpool.config import bundled_models

    plan = kvpool.size_for(
        bundled_models()[0], "fp8_e4m3", 0.9, num_tokens=64, page_size=16, weights=0, gpu="H200"
    )
    pool = kvpool.KVPool(plan, device="cpu")
    n = plan.spec.num_layers
    pool.set_kv_scales([1.0] * n, [1.0] * n)  # unset fp8 scales would warn (an error here)
    view = pool.layer(0)
    gen = torch.Generator().manual_seed(0)
    for t in (view.k, view.v):
        t.copy_(torch.randn(t.shape, generator=gen).clamp(-8, 8).to(t.dtype))
    hq = 2 * view.num_kv_heads
    q = torch.randn(2, hq, view.head_dim, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    pt = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    sl = torch.tensor([20, 5], dtype=torch.int32)
    out = pool.decode(0, q, pt, sl, sm_scale=0.1)
    ref = attention.reference_decode(view, q, pt, sl, sm_scale=0.1)
    assert torch.allclose(out.float(), ref, atol=1e-2, rtol=1e-2)
    # the same two tokens as one-token extends give the same outputs
    ext = pool.extend(0, q, torch.tensor([0, 1, 2], dtype=torch.int32), pt, sl, sm_scale=0.1)
    assert torch.equal(ext, out)


@pytest.mark.parametrize("junk", [0, 1 << 30, -5])
def test_pages_before_the_window_may_hold_anything(junk):
    # engines return pages that left a sliding window (vLLM: its null block); the kernels never
    # read them, so neither do the reference path nor the page-id check. Request of 40 tokens,
    # page 4, window 8: decode reads tokens 32..39 (entries 8-9); an extend of 3 new tokens
    # (positions 37..39) reads from token 30 (entry 7) on
    cache = Cache("bf16", [40], heads=2, d=16, page=4)
    for qlens, first in ((None, 8), ([3], 7)):
        pt = cache.page_table.clone()
        pt[0, :first] = junk
        cache_pt, cache.page_table = cache.page_table, pt
        try:
            if qlens is None:
                out, ref = run_decode(cache, 4, backend="torch", window=8)
            else:
                out, ref = run_extend(cache, 4, qlens, backend="torch", window=8)
        finally:
            cache.page_table = cache_pt
        assert rel_err(out, ref) < 1e-2
        # the first entry the window reads is still checked
        pt[0, first] = -1
        q = torch.randn(1 if qlens is None else 3, 4, 16).to(torch.bfloat16)
        with pytest.raises(ValueError, match=rf"`page_table\[0, {first}\]` = -1 is outside"):
            if qlens is None:
                attention.decode(cache.view, q, pt, cache.seq_lens, window=8, backend="torch")
            else:
                cu = torch.tensor([0, 3], dtype=torch.int32)
                attention.extend(cache.view, q, cu, pt, cache.seq_lens, window=8, backend="torch")


def test_numpy_batch_metadata_in_plans_and_entry_points():
    """Issue 21 point 1: plans and pool entry points take the batch helpers' numpy int32 arrays.

    The outputs equal those from the same values as torch tensors; the plans keep device copies.
    """
    np = pytest.importorskip("numpy")
    import kvpool

    plan = kvpool.size_for(
        "meta-llama/Llama-3.1-8B", "bf16", 0.9, num_tokens=128, page_size=16, weights=0, gpu="H200"
    )
    pool = kvpool.KVPool(plan, device="cpu")
    view = pool.layer(0)
    gen = torch.Generator().manual_seed(0)
    for t in (view.k, view.v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    pt_np = kvpool.page_table([np.array([1, 2], np.int32), np.array([3], np.int32)], 2)
    sl_np = np.array([20, 5], dtype=np.int32)
    pt, sl = torch.from_numpy(pt_np.copy()), torch.from_numpy(sl_np.copy())
    q = torch.randn(2, 32, 128, generator=gen).to(torch.bfloat16)
    want = pool.decode(0, q, pt, sl)
    assert torch.equal(pool.decode(0, q, pt_np, sl_np), want)
    p = attention.plan_decode(view, 32, pt_np, sl_np)
    assert isinstance(p.page_table, torch.Tensor) and torch.equal(p.page_table, pt)
    assert torch.equal(p.seq_lens, sl)
    pt_np[:] = 0  # the plan holds a copy: refilling the caller's array changes nothing
    assert torch.equal(pool.decode(0, q, plan=p), want)
    cu_np = np.array([0, 1, 2], dtype=np.int32)
    ext = pool.extend(0, q, cu_np, pt, sl_np)
    assert torch.equal(ext, want)
    pe = attention.plan_extend(view, 32, cu_np, pt, sl_np)
    assert torch.equal(pe.cu_seqlens_q, torch.from_numpy(cu_np))
    assert torch.equal(pool.extend(0, q, plan=pe), want)
    with pytest.raises(ValueError, match=r"`seq_lens` is a numpy int64 array, expected numpy"):
        attention.plan_decode(view, 32, pt, sl_np.astype(np.int64))
    with pytest.raises(ValueError, match=r"`page_table` is a numpy float32 array"):
        pool.decode(0, q, pt.numpy().astype(np.float32), sl)
