"""The decode kernels (kvpool.attention.decode, backend="triton"): interpreted at tiny shapes
(every dtype, page sizes, splits, options, the split merge, the word-level decode, plan knobs),
on the GPU at real shapes (the Triton and Gluon kernels). Oracle and tolerances:
``attention_helpers.py``.
"""

import math

import pytest

torch = pytest.importorskip("torch")

from attention_helpers import (  # noqa: E402
    DTYPES,
    FP4,
    TOL,
    WORDS,
    Cache,
    oracle,
    q_dtype,
    rel_err,
    run_decode,
    run_extend,
)
from kvpool import attention  # noqa: E402

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu


# ------------------------------------------------------------------------ Triton, interpreted


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_dot", [True, False])
def test_decode_interpret_every_dtype(dtype, use_dot):
    cache = Cache(dtype, [1, 21, 16], heads=2, d=32, page=16, heavy=dtype != "fp32")
    out, ref = run_decode(
        cache, 4, backend="triton", plan_kw={"num_splits": 2, "block_n": 16, "use_dot": use_dot}
    )
    assert out.dtype == q_dtype(dtype)
    assert rel_err(out, ref) < TOL[dtype]


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [3, 4])
def test_decode_interpret_swap(dtype, group):
    """Transposed dots (swap=True): the KV tile as the MMA's M side, the group unpadded."""
    cache = Cache(dtype, [1, 21, 40], heads=2, d=32, page=16, heavy=dtype != "fp32")
    kw = {"num_splits": 2, "block_n": 16, "swap": True, "asm": dtype in WORDS}
    out, ref = run_decode(cache, 2 * group, backend="triton", plan_kw=kw)
    assert rel_err(out, ref) < TOL[dtype]


@interpret
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("prefetch", [False, True])
def test_decode_interpret_pages_and_splits(page, splits, prefetch):
    cache = Cache("fp8_e4m3", [2, 37, 70], heads=1, d=16, page=page)
    out, ref = run_decode(
        cache,
        2,
        backend="triton",
        plan_kw={"num_splits": splits, "block_n": 16, "prefetch": prefetch},
    )
    assert rel_err(out, ref) < TOL["fp8_e4m3"]


@interpret
@pytest.mark.parametrize(
    "opts",
    [
        {"window": 9},
        {"softcap": 1.5, "sm_scale": 0.9},
        {"sinks": torch.tensor([1.0, -2.0, 3.0, 0.5])},
        {"window": 20, "sinks": torch.tensor([0.0, 0.0, 5.0, -5.0])},
    ],
)
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_interpret_options(opts, splits):
    cache = Cache("bf16", [3, 45], heads=2, d=16, page=16)
    out, ref = run_decode(
        cache, 4, backend="triton", plan_kw={"num_splits": splits, "block_n": 16}, **opts
    )
    assert rel_err(out, ref) < TOL["bf16"]


@interpret
@pytest.mark.parametrize("dtype, swap", [("fp8_e4m3", True), ("nvfp4", False), ("bf16", True)])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("opts", [{}, {"window": 19}])
def test_decode_interpret_page_ahead(dtype, swap, page, opts):
    """num_stages >= 3 loads each tile's page ids one tile ahead (both loops): every length
    ends mid-tile or mid-page, splits start mid-page, the window moves the first tile."""
    cache = Cache(dtype, [1, 21, 16, 70], heads=2, d=32, page=page, heavy=True)
    kw = {"num_splits": 3, "block_n": 32 if dtype == "nvfp4" else 16, "num_stages": 3,
          "swap": swap, "asm": dtype in WORDS}
    out, ref = run_decode(cache, 4, backend="triton", plan_kw=kw, **opts)
    assert rel_err(out, ref) < TOL[dtype]


@interpret
def test_decode_interpret_default_plan_and_group_not_pow2():
    cache = Cache("fp16", [9, 30], heads=2, d=16, page=4)
    out, ref = run_decode(cache, 6, backend="triton")  # G = 3, planned inside
    assert rel_err(out, ref) < TOL["fp16"]


def _merge_reference(po, pl, sinks, vf):
    """Split merge in float64: softmax over the splits' log2-sum-exp (and the sink), weights
    applied to the normalized partial outputs, times the V factor."""
    lse = pl.double() * math.log(2.0)  # natural-log units
    if sinks is not None:
        lse = torch.cat([lse, sinks.double()[None, :, None].expand(lse.shape[0], -1, 1)], 2)
    w = torch.softmax(lse, 2)[..., : po.shape[2]]
    w = torch.nan_to_num(w)  # every split empty, no sink: output 0
    return (w[..., None] * po.double()).sum(2) * vf


@interpret
@pytest.mark.parametrize("splits", [1, 3, 256, 300])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("sinks", [False, True])
def test_merge_interpret(splits, wide, sinks):
    """The split merge alone against a float64 softmax: steps of <= 256 splits (300 takes two,
    the second mostly masked), empty splits (lse -inf, partial 0) mixed in, a request whose
    splits are all empty, 32-column blocks or whole rows (``wide``), sinks, the V factor."""
    from kvpool.triton_kernels.decode import merge_kernel

    gen = torch.Generator().manual_seed(splits)
    b, hq, dv = 2, 3, 64
    po = torch.randn(b, hq, splits, dv, generator=gen)
    pl = torch.randn(b, hq, splits, generator=gen) * 8.0
    empty = torch.rand(b, hq, splits, generator=gen) < 0.3
    empty[1, 0] = True  # one (request, head) with no token in any split
    if splits > 256:  # another whose first step of 256 splits is all empty, a later one live
        empty[0, 1, :256] = True
        empty[0, 1, 256:] = False
    pl[empty] = float("-inf")
    po[empty.unsqueeze(-1).expand_as(po)] = 0.0
    sk = torch.linspace(-2.0, 3.0, hq) if sinks else None
    vsc = torch.tensor([0.75])  # times FP4_MUL 2.0: the V factor 1.5
    out = torch.empty(b, hq, dv, dtype=torch.bfloat16)
    sp, block_dv, _ = attention._merge_tiles(b * hq, splits, dv)
    if wide:
        block_dv = dv
    merge_kernel[(b, hq, dv // block_dv)](
        po, pl, sk if sinks else out, vsc, out, out.stride(0), out.stride(1), hq, splits,
        DV=dv, BLOCK_DV=block_dv, SP=sp, HAS_SCALE=True, FP4_MUL=2.0, HAS_SINKS=sinks,
    )  # fmt: skip
    ref = _merge_reference(po, pl, sk, 1.5)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    if not sinks:
        assert (out[1, 0] == 0).all()


def test_merge_tiles():
    """Merge tiling: <= 256 splits a step, 32-column blocks below 4,096 rows, from there steps
    of at most 8,192 values, warps by size."""
    assert attention._merge_tiles(32, 256, 128) == (256, 32, 4)  # B=1, 32 heads: 128 programs
    assert attention._merge_tiles(32, 1024, 128) == (256, 32, 4)  # four steps
    assert attention._merge_tiles(32, 3, 128) == (16, 32, 1)
    assert attention._merge_tiles(2048, 4, 128) == (16, 32, 1)
    assert attention._merge_tiles(4096, 4, 128) == (16, 128, 2)
    assert attention._merge_tiles(4096, 64, 16) == (64, 16, 1)
    assert attention._merge_tiles(4096, 128, 128) == (128, 64, 4)  # 8,192 values a step
    assert attention._merge_tiles(4096, 300, 128) == (256, 32, 4)


@interpret
@pytest.mark.parametrize("dtype", WORDS)
@pytest.mark.parametrize("what", ["decode", "extend"])
def test_word_decode_interpret(dtype, what):
    """The word-level FP4/fp8 decode (asm=True), run through its plain-Triton emulation:
    word loads, scale broadcast and output order around the PTX block."""
    cache = Cache(dtype, [33, 5, 17], heads=2, d=32, page=16, heavy=True)
    if what == "decode":
        out, ref = run_decode(
            cache, 4, backend="triton", plan_kw={"num_splits": 2, "block_n": 16, "asm": True}
        )
    else:
        out, ref = run_extend(
            cache, 4, [9, 5, 17], backend="triton", use_plan=True, plan_kw={"asm": True}
        )
    assert rel_err(out, ref) < TOL[dtype]


@interpret
@pytest.mark.parametrize("dtype", FP4)
def test_decode_interpret_fp4_prefetch(dtype):
    cache = Cache(dtype, [33, 5], heads=2, d=32, page=16, heavy=True)
    out, ref = run_decode(
        cache, 4, backend="triton", plan_kw={"num_splits": 1, "block_n": 16, "prefetch": True}
    )
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.interpret
@pytest.mark.parametrize(
    "plan_kw",
    [
        {"swap": False, "group_pad": 4},  # untransposed dots on a 4-row group (no 16-row pad)
        {"swap": False, "group_pad": 32},
        {"swap": True, "group_pad": 16},
        {"maxnreg": 127},
        {"num_warps": 1, "prefetch": True},
    ],
)
def test_decode_plan_knobs_interpreted(plan_kw):
    cache = Cache("fp8_e4m3", [5, 40], heads=2, d=32, page=16)
    out, ref = run_decode(cache, 8, backend="triton", plan_kw={"num_splits": 2, **plan_kw})
    assert rel_err(out, ref) < TOL["fp8_e4m3"]


@pytest.mark.interpret
def test_word_decode_plan_reused_on_unaligned_rows_interpreted():
    """A word-decode plan from an aligned layer reused on a view whose rows are off 4-byte
    boundaries takes the byte path at launch (the result matches the oracle)."""
    import dataclasses

    cache = Cache("fp8_e4m3", [5, 40], heads=2, d=32, page=16)
    plan = attention.plan_decode(cache.view, 8, cache.page_table, cache.seq_lens)
    assert plan.asm

    def odd_rows(t):
        n, h, w = t.shape
        wide = torch.zeros(n, h * w + 1, dtype=torch.uint8)
        wide[:, : h * w] = t.view(torch.uint8).reshape(n, -1)
        return wide.as_strided((n, h, w), (h * w + 1, w, 1)).view(t.dtype)

    view = dataclasses.replace(cache.view, k=odd_rows(cache.view.k), v=odd_rows(cache.view.v))
    q = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = attention.decode(view, q, plan=plan, sm_scale=0.2, backend="triton")
    ref = oracle(cache, q, [[4], [39]], [[0], [1]], sm_scale=0.2)
    assert rel_err(out, ref) < TOL["fp8_e4m3"]


# --------------------------------------------------------------------------- GPU, real shapes


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heavy", [False, True])
def test_decode_gpu_llama_geometry(dtype, heavy):
    lens = [1, 15, 16, 17, 300, 1000, 4097, 2000]
    cache = Cache(dtype, lens, heads=8, d=128, page=16, device="cuda", heavy=heavy)
    kws = [{}, {"num_splits": 1}]
    if heavy:  # every other path once (each is one more compile)
        kws += [  # (many splits with 32-token tiles: at the SmolLM2 geometry)
            {"use_dot": False},
            {"prefetch": True, "num_splits": 1, "block_n": 128},
            {"swap": True, "num_splits": 3},
            {"swap": False, "num_splits": 1, "block_n": 64},
        ]
        if dtype in WORDS:  # the word-level decode off (it is the default)
            kws += [{"asm": False}]
    for kw in kws:
        out, ref = run_decode(cache, 32, backend="triton", device="cuda", plan_kw=kw)
        assert rel_err(out, ref) < TOL[dtype], kw


@gpu
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16"])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_decode_gpu_gluon(dtype, page):
    """The Gluon kernel against the fp32 oracle: ragged lengths ending mid-tile and mid-page,
    query groups of 1, 4 and 8, one split (direct output) and several, window, soft-cap and
    sinks; and the same answer as the Triton kernel."""
    lens = [1, 5, 16, 17, 100, 1000, 4093, 64]
    for group, kw, opts in [
        (4, {}, {}),
        (4, {"num_splits": 1}, {}),
        (8, {"num_splits": 5}, {"window": 300}),
        (1, {"num_splits": 3}, {"softcap": 20.0, "sm_scale": 0.2}),
        (4, {"num_splits": 1}, {"sinks": torch.linspace(-2.0, 3.0, 32), "window": 700}),
        (4, {"num_splits": 7}, {"sinks": torch.linspace(-2.0, 3.0, 32)}),
    ]:
        cache = Cache(dtype, lens, heads=8, d=128, page=page, device="cuda", heavy=True)
        plan_kw = {"gluon": True, **kw}
        out, ref = run_decode(cache, 8 * group, backend="triton", device="cuda", plan_kw=plan_kw,
                              **dict(opts))
        err = rel_err(out, ref)
        assert err < TOL[dtype], (group, kw, opts)
        tri, _ = run_decode(cache, 8 * group, backend="triton", device="cuda",
                            plan_kw={"gluon": False, **kw}, **dict(opts))
        # as close to the oracle as the Triton kernel (nvfp4: the two differ by up to 0.5% on
        # heavy-tailed caches, the Triton kernel's fp16 p underflowing where this one's, taken
        # against a running max that moves lazily, does not; fp4_mx's bf16 operands: one ulp
        # is 0.39%, so within two of it)
        floor = 2.0**-7 if dtype == "fp4_mx_block16" else TOL[dtype] / 4
        assert err <= max(1.25 * rel_err(tri, ref), floor), (group, kw, opts)


@gpu
def test_decode_gpu_gluon_nvfp4_odd_heads():
    """3 KV heads: nvfp4 block-scale rows of 24 bytes are not 16-byte aligned, so the launcher
    takes register prefetch instead of the cp.async ring (which would not compile); splits past
    the end of short requests read only their last row."""
    lens = [1, 17, 300, 2100]
    cache = Cache("nvfp4", lens, heads=3, d=128, page=16, device="cuda", heavy=True)
    for kw in ({"num_splits": 1}, {"num_splits": 6}):
        out, ref = run_decode(cache, 12, backend="triton", device="cuda",
                              plan_kw={"gluon": True, **kw})
        err = rel_err(out, ref)
        tri, _ = run_decode(cache, 12, backend="triton", device="cuda",
                            plan_kw={"gluon": False, **kw})
        assert err < TOL["nvfp4"] and err <= max(1.25 * rel_err(tri, ref), TOL["nvfp4"] / 4), kw


@gpu
@pytest.mark.parametrize("dtype", ["nvfp4", "fp4_mx_block16"])
@pytest.mark.parametrize("tma, sub", [(False, 1), (False, 2), (True, 1), (True, 2)])
def test_decode_gpu_gluon_fp4_ring_variants(dtype, tma, sub, monkeypatch):
    """Every FP4 ring the launcher can pick (data by cp.async, as on sm_89, or by TMA; one or two
    16-token tiles a stage) against the torch reference of the same decode call: requests ending
    mid-tile and mid-stage, splits that get no tile, and a window."""
    monkeypatch.setattr(attention.variants, "_GLUON_FP4_OPTIONS", (True, 0, tma, sub))
    lens = [1, 17, 100, 1000, 4093, 64, 33, 5]
    cache = Cache(dtype, lens, heads=8, d=128, page=16, device="cuda", heavy=True)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), 32, 128, generator=gen).to(torch.bfloat16).cuda()
    for kw, opts in [({}, {}), ({"num_splits": 7}, {}), ({"num_splits": 3}, {"window": 300})]:
        plan = attention.plan_decode(cache.view, 32, cache.page_table, cache.seq_lens,
                                     gluon=True, **kw)
        assert plan.gluon and plan.block_n == 16 * sub
        out = attention.decode(cache.view, q, cache.page_table, cache.seq_lens, plan=plan, **opts)
        ref = attention.decode(cache.view, q, cache.page_table, cache.seq_lens, backend="torch",
                               **opts)
        assert rel_err(out, ref.double().cpu()) < TOL[dtype], (kw, opts)


@gpu
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "nvfp4", "fp4_mx_block16"])
@pytest.mark.parametrize("page", [1, 16])
def test_decode_gpu_gluon_window_reads_nothing_before_it(dtype, page):
    """With a sliding window the Gluon kernels start tiles at multiples of 16, possibly before the
    window: pages wholly before the window get page-table entries far out of bounds (a read
    would fault) and the rows of the window's first 16-token block before its start get NaN
    bytes (a read of them would reach the output as 0 * NaN). fp8 and block-scale rows there are
    never read; the FP4 kernel's TMA boxes fetch that block's data rows whole (E2M1 codes are
    all finite, their p is 0). The answer is unchanged, bit for bit."""
    lens, window = [700, 1000, 40, 2100], 300
    cache = Cache(dtype, lens, heads=8, d=128, page=page, device="cuda")
    for kw in ({"num_splits": 1}, {"num_splits": 5}):
        plan_kw = {"gluon": True, **kw}
        before, _ = run_decode(cache, 32, backend="triton", device="cuda", plan_kw=plan_kw,
                               window=window)
        pt, v = cache.page_table.clone(), cache.view.v.clone()
        vbs = None if cache.view.v_block_scale is None else cache.view.v_block_scale.clone()
        for b, n in enumerate(lens):
            lo = max(n - window, 0)
            lo16 = lo // 16 * 16
            for tok in range(lo16, lo):  # NaN rows next to the window, in pages still in use
                slot = int(cache.page_table[b, tok // page]) * page + tok % page
                cache.view.v.view(torch.uint8)[slot] = 0x7F
                if vbs is not None:
                    cache.view.v_block_scale.view(torch.uint8)[slot] = 0x7F
            cache.page_table[b, : lo16 // page] = 1 << 30
        try:
            after, _ = run_decode(cache, 32, backend="triton", device="cuda", plan_kw=plan_kw,
                                  window=window)
        finally:
            cache.page_table.copy_(pt)
            cache.view.v.copy_(v)
            if vbs is not None:
                cache.view.v_block_scale.copy_(vbs)
        assert torch.equal(before, after), kw


@gpu
def test_decode_gpu_gluon_default_and_refusals():
    """fp8 at head_dim 128 with more than 16 programs takes the Gluon kernel by default; a plan
    made for it refuses a layer it cannot run, and gluon=True refuses such a layer up front."""
    c8 = Cache("fp8_e4m3", [2100] * 4, heads=8, d=128, page=16, device="cuda")
    plan = attention.plan_decode(c8.view, 32, c8.page_table, c8.seq_lens)
    assert plan.gluon and plan.block_n == 16
    assert not attention.plan_decode(c8.view, 32, c8.page_table[:2], c8.seq_lens[:2]).gluon
    cb = Cache("bf16", [2100] * 4, heads=8, d=128, page=16, device="cuda")
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="uses the Gluon kernel, which does not run bf16 caches"):
        attention.decode(cb.view, q, plan=plan)
    with pytest.raises(ValueError, match="`gluon=True`: the Gluon decode kernel does not run "
                                         "head_dim 32"):
        c32 = Cache("fp8_e4m3", [40] * 4, heads=8, d=32, page=16, device="cuda")
        attention.plan_decode(c32.view, 32, c32.page_table, c32.seq_lens, gluon=True)


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
def test_decode_gpu_batch_256_page_sizes(dtype):
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 300, (256,), generator=gen).tolist()
    for page in (1, 64):
        cache = Cache(dtype, lens, heads=2, d=64, page=page, device="cuda")
        out, ref = run_decode(
            cache,
            8,
            backend="triton",
            device="cuda",
            window=100,
            softcap=30.0,
            sinks=torch.linspace(-2, 2, 8),
        )
        assert rel_err(out, ref) < TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("splits", [128, 300])
def test_decode_gpu_merge_many_rows_and_splits(dtype, splits):
    """The split merge where it takes its other tiles: 4,096 (request, query head) rows (128
    requests x 32 heads) with 128 splits (64-column blocks) and 300 (two steps, most splits
    empty), sinks; on sm_90+ launched as a programmatic dependent of the split kernel."""
    gen = torch.Generator().manual_seed(splits)
    lens = torch.randint(1, 700, (128,), generator=gen).tolist()
    cache = Cache(dtype, lens, heads=8, d=128, page=16, device="cuda")
    rows, dv = 128 * 32, 128
    sp, block_dv, _ = attention._merge_tiles(rows, splits, dv)
    assert (sp, block_dv) == ((128, 64) if splits == 128 else (256, 32))
    out, ref = run_decode(
        cache, 32, backend="triton", device="cuda", plan_kw={"num_splits": splits},
        sinks=torch.linspace(-2, 2, 32),
    )  # fmt: skip
    assert rel_err(out, ref) < TOL[dtype]
