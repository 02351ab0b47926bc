"""The extend kernel (kvpool.attention.extend, backend="triton"): interpreted at tiny shapes, on
the GPU at real shapes; the checks of its ragged batch (``cu_seqlens_q``, strides). Oracle and
tolerances: ``attention_helpers.py``.
"""


import pytest

torch = pytest.importorskip("torch")

from attention_helpers import (  # noqa: E402
    DTYPES,
    FP4,
    TOL,
    WORDS,
    Cache,
    _attack_cache,
    _i32,
    rel_err,
    run_extend,
)
from kvpool import attention  # noqa: E402

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu


# ------------------------------------------------------------------------ Triton, interpreted


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_interpret_every_dtype(dtype):
    # ragged: prefix ending mid-page, empty prefix, a request with no new tokens, seq_len 1
    cache = Cache(dtype, [21, 6, 16, 1], heads=2, d=32, page=16, heavy=dtype != "fp32")
    out, ref = run_extend(cache, 4, [4, 6, 0, 1], backend="triton")
    assert rel_err(out, ref) < TOL[dtype]


@interpret
@pytest.mark.parametrize(
    "opts",
    [{"window": 5}, {"softcap": 3.0}, {"sinks": torch.tensor([1.0, -2.0, 3.0, 0.5, 0.0, 1.0])}],
)
@pytest.mark.parametrize("page", [1, 64])
def test_extend_interpret_options_and_plan(opts, page):
    cache = Cache("fp16", [40, 19], heads=2, d=16, page=page)
    out, ref = run_extend(cache, 6, [20, 19], backend="triton", use_plan=True, **opts)
    assert rel_err(out, ref) < TOL["fp16"]


# --------------------------------------------------------------------------------------- host


def test_extend_refuses_strided_tensors_on_the_kernel_path():
    """Extend's kernel indexes ``out`` and ``page_table`` rows with unit inner stride and reads
    ``seq_lens``/``cu_seqlens_q`` with none: other layouts are refused by name before any launch
    (``out`` untouched), as in decode; the torch path takes them and gives the same answer."""
    c = Cache("bf16", [40, 17], heads=2, d=32, page=16)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q = torch.randn(5, 4, 32).to(torch.bfloat16)
    out_t = torch.full((5, 32, 4), 7.0, dtype=torch.bfloat16).transpose(1, 2)
    pt_t = c.page_table.t().contiguous().t()
    sl2 = torch.stack([c.seq_lens, c.seq_lens], 1)[:, 0]
    cu2 = torch.stack([cu, cu], 1)[:, 0]
    for kw, name in [({"out": out_t}, "out"), ({"page_table": pt_t}, "page_table"),
                     ({"seq_lens": sl2}, "seq_lens"), ({"cu_seqlens_q": cu2}, "cu_seqlens_q")]:
        args = {"cu_seqlens_q": cu, "page_table": c.page_table, "seq_lens": c.seq_lens}
        out = kw.pop("out", None)
        args.update(kw)
        with pytest.raises(ValueError, match=f"`{name}` must be contiguous in its last dim"):
            attention.extend(c.view, q, out=out, backend="triton", **args)
    assert (out_t == 7.0).all()
    ref = attention.extend(c.view, q, cu, c.page_table, c.seq_lens, backend="torch")
    got = attention.extend(c.view, q, cu2, pt_t, sl2, backend="torch")
    assert torch.equal(got, ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton on CPU: checked before launch
def test_extend_refuses_cu_seqlens_q_that_does_not_fit_q(backend):
    """cu_seqlens_q must run from 0, non-decreasing, to T = q rows: before, [0, 2] with 4 rows
    left rows 2-3 zero, [1, 4] left row 0 zero, [0, 6] raised a bare torch error and [0, -3]
    "upper bound and lower bound inconsistent"."""
    c = _attack_cache()
    pt, sl = c.page_table, c.seq_lens
    q = torch.randn(4, 4, 16).to(torch.bfloat16)
    cases = [
        (q, _i32(0, 2), r"`cu_seqlens_q\[1\]` = 2: must equal T = 4, the rows of `q`"),
        (q, _i32(1, 4), r"`cu_seqlens_q\[0\]` = 1: must be 0"),
        (q, _i32(0, 6), r"`cu_seqlens_q\[1\]` = 6: must equal T = 4"),
        (q[:0], _i32(0, -3), r"`cu_seqlens_q\[1\]` = -3 is less than `cu_seqlens_q\[0\]` = 0"),
    ]
    for qq, cu, msg in cases:
        out = torch.full((qq.shape[0], 4, 16), 7.0, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=msg):
            attention.extend(c.view, qq, cu, pt, sl, backend=backend, out=out)
        assert bool((out == 7).all())
    # a request's new tokens are the last of its seq_len: more of them than seq_len is refused
    c2 = Cache("bf16", [8, 3], heads=2, d=16, page=4)
    q5 = torch.randn(9, 4, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"`seq_lens\[1\]` = 3 is shorter than its 4 new tokens"):
        attention.extend(c2.view, q5, _i32(0, 5, 9), c2.page_table, c2.seq_lens, backend=backend)
    # a cu_seqlens_q that does fit still works (and an empty request in the middle)
    if backend == "torch":
        out, ref = run_extend(c2, 4, [5, 0], backend="torch")
        assert rel_err(out, ref) < TOL["bf16"]
    # plan_extend reads cu_seqlens_q on the host: it checks the order there too
    with pytest.raises(ValueError, match=r"`cu_seqlens_q\[1\]` = -3 is less than"):
        attention.plan_extend(c.view, 4, _i32(0, -3), pt, sl)
    with pytest.raises(ValueError, match=r"`cu_seqlens_q\[0\]` = 2: must be 0"):
        attention.plan_extend(c.view, 4, _i32(2, 4), pt, sl)


def test_pool_extend_refuses_cu_seqlens_q_that_does_not_fit_q():
    """The reported case, through KVPool.extend (CPU: the torch path)."""
    import kvpool
    from kvpool.config import bundled_models

    plan = kvpool.size_for(
        bundled_models()[0], "bf16", 0.9, num_tokens=64, page_size=4, weights=0, gpu="H200"
    )
    pool = kvpool.KVPool(plan, device="cpu")
    view = pool.layer(0)
    q = torch.randn(4, view.num_kv_heads, view.head_dim).to(torch.bfloat16)
    pt, sl = _i32(1, 2).reshape(1, 2), _i32(8)
    for cu in (_i32(0, 2), _i32(1, 4), _i32(0, 6)):
        with pytest.raises(ValueError, match="`cu_seqlens_q"):
            pool.extend(0, q, cu, pt, sl)
    with pytest.raises(ValueError, match="`cu_seqlens_q"):
        pool.extend(0, q[:0], _i32(0, -3), pt, sl)
    with pytest.raises(ValueError, match=r"`page_table\[0, 1\]` = -1 is outside the pool's"):
        pool.decode(0, q[:1], _i32(1, -1).reshape(1, 2), sl)


# --------------------------------------------------------------------------- GPU, real shapes


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_gpu(dtype):
    lens = [600, 64, 129, 1]
    cache = Cache(dtype, lens, heads=8, d=128, page=64, device="cuda", heavy=True)
    # The default tiles (no plan) and, for FP4/fp8 caches, the other nibble/byte decode. Each
    # variant is one more compile, and an extend kernel takes 5-40 s to compile (seen on the
    # device host under parallel load): other tiles are covered at the SmolLM2 geometry.
    kws = [None]
    if dtype in WORDS:
        kws += [{"asm": dtype not in FP4}]
    for kw in kws:
        out, ref = run_extend(
            cache,
            32,
            [100, 64, 17, 1],
            backend="triton",
            device="cuda",
            use_plan=kw is not None,
            plan_kw=kw,
        )
        assert rel_err(out, ref) < TOL[dtype], kw
    out, ref = run_extend(
        cache,
        32,
        [100, 64, 17, 1],
        backend="triton",
        device="cuda",
        window=50,
        sinks=torch.linspace(-1, 1, 32),
        softcap=20.0,
    )
    assert rel_err(out, ref) < TOL[dtype]
