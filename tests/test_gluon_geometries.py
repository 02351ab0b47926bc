"""The Gluon decode kernels beyond head_dim 128 with groups of <= 8: head_dim 64 and 256, query
groups up to 16 (issue 17). Host side: which layers they take and what their plans say (CPU,
the device check patched out as in test_attention.py); GPU: every bundled model geometry and
Gluon dtype against the fp64 oracle and beside the Triton kernel. The sm_90 builds themselves
(registers, spills, shared memory) are checked on the CPU in test_gluon_compile.py.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from kvpool import attention  # noqa: E402
from kvpool.attention import variants  # noqa: E402
from attention_helpers import TOL, Cache, rel_err, run_decode  # noqa: E402

GLUON_DTYPES = ("fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16")
WIDE_DTYPES = ("bf16", "fp16")  # (the Gluon kernel at head_dim 64 only)
# (name, query heads, KV heads, head_dim, options) per rank (benches/attention/bench_models.py)
GEOMETRIES = [
    ("qwen3.5-27b", 24, 4, 256, {}),
    ("qwen3.5-35b-a3b", 16, 2, 256, {}),
    ("gemma-2-9b", 16, 8, 256, {"softcap": 50.0, "window": 4096}),
    ("gpt-oss", 64, 8, 64, {"sinks": True}),
    ("gpt-oss-sliding", 64, 8, 64, {"sinks": True, "window": 128}),
    ("group-16", 64, 4, 128, {}),
    ("group-16-hd64", 32, 2, 64, {"sinks": True}),
    ("group-12", 48, 4, 128, {"window": 700}),
    ("group-1-hd256", 8, 8, 256, {}),
]


def _opts(opts, hq):
    o = {k: v for k, v in opts.items() if k != "sinks"}
    if opts.get("sinks"):
        o["sinks"] = torch.linspace(-2.0, 3.0, hq)
    return o


@pytest.fixture
def as_if_on_gpu(monkeypatch):
    """Plans as on an H200 that fits: the device check passes, 132 multiprocessors."""
    monkeypatch.setattr(variants, "_gluon_device_unfit", lambda device: None)
    monkeypatch.setattr(attention.splits, "_num_sms", lambda device: 132)


@pytest.mark.parametrize("dtype", GLUON_DTYPES)
def test_unfit_geometries(dtype):
    """Head_dim 64/256 and groups up to 16 pass every check but the device's; head_dim 256
    with a group of 9..16, other head dims and groups past 16 are refused by name."""
    for d, g in ((64, 1), (64, 16), (128, 9), (128, 16), (256, 1), (256, 8)):
        v = Cache(dtype, [40, 3], heads=2, d=d, page=16).view
        assert attention._gluon_unfit(v, g).startswith("a CPU tensor"), (d, g)
    v = Cache(dtype, [40, 3], heads=2, d=256, page=16).view
    assert attention._gluon_unfit(v, 9) == "a query group of 9 heads (1..8 only at head_dim 256)"
    v = Cache(dtype, [40, 3], heads=2, d=64, page=16).view
    assert attention._gluon_unfit(v, 17) == "a query group of 17 heads (1..16 only at head_dim 64)"
    v = Cache(dtype, [40, 3], heads=2, d=32, page=16).view
    assert attention._gluon_unfit(v, 4) == (
        "head_dim 32 / v_head_dim 32 (64, 128 or 256, K and V alike)"
    )


def test_unfit_fp4_head_dim_256_needs_the_ring():
    """FP4 at head_dim 256 runs the ring only (register prefetch would spill): pages of >= 16
    tokens and 16-byte aligned scale rows; fp8 at head_dim 256 and FP4 at 64 take any page."""
    v = Cache("nvfp4", [40, 3], heads=2, d=256, page=8).view
    assert attention._gluon_unfit(v, 4) == (
        "an FP4 cache of page_size 8 at head_dim 256 (pages >= 16 only)"
    )
    v = Cache("nvfp4", [40, 3], heads=2, d=256, page=16).view
    s = v.k_block_scale
    buf = torch.zeros(s.numel() + 64, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 16 + 2
    odd = buf[start : start + s.numel()].view(s.shape)
    odd.copy_(s.view(torch.uint8))
    why = attention._gluon_unfit(dataclasses.replace(v, k_block_scale=odd.view(s.dtype)), 4)
    assert why.startswith("FP4 block scale rows not 16-byte aligned at head_dim 256"), why
    for dtype, d in (("fp8_e4m3", 256), ("nvfp4", 64), ("fp4_mx_block16", 64)):
        v = Cache(dtype, [40, 3], heads=2, d=d, page=1).view
        assert attention._gluon_unfit(v, 4).startswith("a CPU tensor"), (dtype, d)


def test_wide_switch(monkeypatch):
    """``KVPOOL_GLUON_WIDE=0``: only head_dim 128 with a group of <= 8 keeps the Gluon kernel."""
    monkeypatch.setenv(variants.GLUON_WIDE_ENV, "0")
    v = Cache("fp8_e4m3", [40, 3], heads=2, d=256, page=16).view
    why = attention._gluon_unfit(v, 6)
    assert why == "head_dim 256 with a group of 6 while KVPOOL_GLUON_WIDE=0"
    v = Cache("nvfp4", [40, 3], heads=2, d=128, page=16).view
    assert "KVPOOL_GLUON_WIDE=0" in attention._gluon_unfit(v, 16)
    assert attention._gluon_unfit(v, 8).startswith("a CPU tensor")


@pytest.mark.parametrize("name, hq, hk, d, opts", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
@pytest.mark.parametrize("dtype", GLUON_DTYPES + WIDE_DTYPES)
def test_plan_names_the_variant(name, hq, hk, d, opts, dtype, as_if_on_gpu):
    """At B=64 x 8k the default plan takes the Gluon kernel and names the variant; FP4 runs
    two tiles a ring stage;
    ``gluon=False`` gives the generic kernel for side-by-side runs."""
    # (a small cache; the plan reads the geometry and the batch: 64 requests of 8k tokens)
    c = Cache(dtype, [40, 3], heads=hk, d=d, page=16)
    pt = torch.zeros(64, 512, dtype=torch.int32)
    sl = torch.full((64,), 8192, dtype=torch.int32)
    p = attention.plan_decode(c.view, hq, pt, sl)
    g = hq // hk
    if dtype in WIDE_DTYPES and d != 64:
        assert not p.gluon and p.kernel == "triton_generic"
        return
    fp4 = dtype in ("nvfp4", "fp4_mx_block16")
    kind = dtype if dtype in WIDE_DTYPES else ("fp4" if fp4 else "fp8")
    want = f"gluon_{kind}" + ("" if d == 128 else f"_hd{d}")
    from kvpool.attention import gluon_knobs as gk

    if d == 64 and g <= 8 and dtype in gk.HD64_DEFAULTS:  # (run 14's measured default there)
        assert p.gluon and p.kernel == want + "_multi" and p.knobs == gk.HD64_DEFAULTS[dtype]
        assert (p.prefetch, p.num_stages, p.block_n) == (False, 2, 32)
        return
    assert p.gluon and p.kernel == want + ("_g16" if g > 8 else ""), p.kernel
    assert p.num_warps == 1 and p.group_pad == 16
    if fp4:
        assert (p.prefetch, p.num_stages, p.block_n) == (False, 2, 32)
    else:
        assert (p.prefetch, p.num_stages, p.block_n) == (False, 3, 16)
    # programs per SM in the split model: 16 (head_dim 64), 9 (128, 16-wide dots), 8 (256)
    per_sm = {64: 16, 128: 9, 256: 8}[d]
    assert p.num_splits == attention.splits.default_splits(
        64, hk, 8192, c.view.k.device, p.block_n, 1, per_sm, variants._GLUON_OVERHEAD
    )
    q = attention.plan_decode(c.view, hq, pt, sl, gluon=False)
    assert not q.gluon and q.kernel == "triton_generic"


def test_head_dim_128_plans_unchanged(as_if_on_gpu):
    """The measured path keeps its parameters: 12 programs per SM, its own FP4 tile choice."""
    for dtype, bn in (("fp8_e4m3", 16), ("fp8_e5m2", 16), ("nvfp4", 32), ("fp4_mx_block16", 32)):
        c = Cache(dtype, [2100] * 4, heads=8, d=128, page=16)
        p = attention.plan_decode(c.view, 32, c.page_table, c.seq_lens)
        assert p.kernel == ("gluon_fp4" if bn == 32 else "gluon_fp8")
        assert (p.block_n, p.num_splits) == (bn, 14 if bn == 32 else 15), dtype


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name, hq, hk, d, opts", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
@pytest.mark.parametrize("dtype", GLUON_DTYPES + WIDE_DTYPES)
@pytest.mark.parametrize("page", [16, 1], ids=["page16", "page1"])
def test_gluon_geometry_gpu(name, hq, hk, d, opts, dtype, page):
    """The Gluon kernel (``gluon=True``) at each geometry against the fp64 oracle, ragged
    lengths ending mid-tile and mid-page, one split (direct output) and several; and as close
    to it as the Triton kernel. FP4 at head_dim 256 needs pages of >= 16 (skipped at 1)."""
    if page == 1 and d == 256 and dtype in ("nvfp4", "fp4_mx_block16"):
        pytest.skip("FP4 at head_dim 256: ring only (pages >= 16)")
    if dtype in WIDE_DTYPES and d != 64:
        pytest.skip("16-bit caches: the Gluon kernel at head_dim 64 only")
    lens = [1, 5, 16, 17, 100, 1000, 4093, 64]
    c = Cache(dtype, lens, heads=hk, d=d, page=page, device="cuda", heavy=True)
    o = _opts(opts, hq)
    for kw in ({}, {"num_splits": 1}, {"num_splits": 5}):
        plan_kw = {"gluon": True, **kw}
        plan = attention.plan_decode(c.view, hq, c.page_table, c.seq_lens, **plan_kw)
        out, ref = run_decode(c, hq, backend="triton", device="cuda", plan_kw=plan_kw, **dict(o))
        err = rel_err(out, ref)
        assert err < TOL[dtype], (plan.kernel, kw)
        tri, _ = run_decode(
            c, hq, backend="triton", device="cuda", plan_kw={"gluon": False, **kw}, **dict(o)
        )
        floor = 2.0**-7 if dtype == "fp4_mx_block16" else TOL[dtype] / 4
        assert err <= max(1.25 * rel_err(tri, ref), floor), (plan.kernel, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GLUON_DTYPES + WIDE_DTYPES)
def test_gluon_geometry_gpu_default_plan(dtype):
    """``decode`` without a plan at gpt-oss and Qwen3.5-27B geometry, 64 requests of 2k: the
    default plan is the Gluon one, and its answer the oracle's."""
    for hq, hk, d, opts in ((64, 8, 64, {"sinks": True}), (24, 4, 256, {})):
        if dtype in WIDE_DTYPES and d != 64:
            continue
        c = Cache(dtype, [2048] * 63 + [77], heads=hk, d=d, page=16, device="cuda")
        plan = attention.plan_decode(c.view, hq, c.page_table, c.seq_lens)
        assert plan.gluon, plan.kernel
        out, ref = run_decode(c, hq, backend="triton", device="cuda", **_opts(opts, hq))
        assert rel_err(out, ref) < TOL[dtype], plan.kernel


@pytest.mark.parametrize("dtype", WIDE_DTYPES)
def test_unfit_16bit(dtype):
    """bf16 and fp16 caches take the Gluon kernel at head_dim 64 (groups up to 16) only."""
    v = Cache(dtype, [40, 3], heads=2, d=64, page=16).view
    assert attention._gluon_unfit(v, 16).startswith("a CPU tensor")
    for d in (128, 256):
        v = Cache(dtype, [40, 3], heads=2, d=d, page=16).view
        assert attention._gluon_unfit(v, 4) == (
            f"{dtype} caches at head_dim {d} / v_head_dim {d} (64 only; fp8_e4m3, fp8_e5m2, "
            "nvfp4, fp4_mx_block16 at 64, 128 and 256)"
        )
