"""Gluon decode knobs (``kvpool.attention.gluon_knobs``, issue 17): parsing, refusals by name,
what plans say (CPU, the device check patched out as in test_gluon_geometries.py); GPU: the
multi kernel (``decode_gluon_multi.py``) and the measured kernels with other constants against
the fp64 oracle at gpt-oss geometry (64 / 8 x 64) and beside it, sinks, sliding window,
soft-cap, ragged lengths with poisoned slots past them, one split and several. The sm_90
builds are checked on the CPU in test_gluon_compile.py.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from attention_helpers import TOL, Cache, rel_err, run_decode  # noqa: E402
from kvpool import attention  # noqa: E402
from kvpool.attention import gluon_knobs as gk  # noqa: E402
from kvpool.attention import replay, variants  # noqa: E402
from kvpool.attention.gluon_knobs import GluonKnobs  # noqa: E402

GLUON = ("fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "nvfp4", "fp4_mx_block16")
FP4 = ("nvfp4", "fp4_mx_block16")


@pytest.fixture
def as_if_on_gpu(monkeypatch):
    """Plans as on an H200: the device check passes, 132 multiprocessors, no env knobs."""
    monkeypatch.setattr(variants, "_gluon_device_unfit", lambda device: None)
    monkeypatch.setattr(attention.splits, "_num_sms", lambda device: 132)
    monkeypatch.delenv(gk.KNOBS_ENV, raising=False)


def _batch(b=64, n=8192):
    return torch.zeros(b, n // 16, dtype=torch.int32), torch.full((b,), n, dtype=torch.int32)


def test_parse_and_label():
    k = gk.parse_knobs("multi=1, sub=4,heads=2,stages=3,tma=0,rescale=-1,ahead=2,maxnreg=128")
    assert k == GluonKnobs(multi=True, sub=4, heads=2, stages=3, tma=False, rescale=-1.0,
                           ahead=2, maxnreg=128)  # fmt: skip
    assert k.label() == "multi-s3-t4-r-1-reg128-h2-a2-cpasync"
    assert gk.parse_knobs("") == GluonKnobs()
    assert gk.as_knobs({"multi": True, "sub": 1}) == GluonKnobs(multi=True, sub=1)
    assert gk.as_knobs("stages=4") == GluonKnobs(stages=4)
    assert gk.as_knobs(None) is None
    with pytest.raises(ValueError, match=r"bad item 'depth=3' \(keys: \["):
        gk.parse_knobs("depth=3")
    with pytest.raises(ValueError, match="bad value in 'sub=two'"):
        gk.parse_knobs("sub=two")
    with pytest.raises(ValueError, match="bad value in 'tma=yes'"):
        gk.parse_knobs("tma=yes")
    with pytest.raises(ValueError, match="unexpected keyword argument 'warps'"):
        gk.as_knobs({"warps": 2})
    with pytest.raises(ValueError, match="a GluonKnobs, dict, str or None"):
        gk.as_knobs(3)


@pytest.mark.parametrize(
    "dtype, heads, page, d, knobs, why",
    [
        ("fp8_e4m3", 8, 16, 64, GluonKnobs(multi=True, sub=3), "`sub` = 3 (1, 2 or 4"),
        ("fp8_e4m3", 8, 16, 64, GluonKnobs(multi=True, stages=1), "`stages` = 1 (2..8"),
        ("nvfp4", 3, 16, 64, GluonKnobs(multi=True, heads=2), "`heads` = 2 (1 or 2 dividing 3"),
        ("bf16", 8, 16, 64, GluonKnobs(multi=True, heads=2, sub=4), "groups <= 8, sub 1-2"),
        ("fp8_e4m3", 8, 1, 64, GluonKnobs(multi=True), "on pages of 1 tokens (>= 16)"),
        ("fp8_e4m3", 8, 16, 256, GluonKnobs(multi=True), "at head_dim 256 (64 or 128)"),
        ("fp8_e4m3", 8, 16, 64, GluonKnobs(multi=True, ahead=3), "`ahead` = 3 (1 or 2)"),
        ("fp8_e4m3", 8, 16, 64, GluonKnobs(sub=2), "`sub` = 2 (1 for fp8_e4m3)"),
        ("fp8_e4m3", 8, 16, 64, GluonKnobs(tma=True), "`tma` for fp8_e4m3"),
        ("nvfp4", 8, 16, 64, GluonKnobs(heads=2), "`heads` / `ahead` of the multi kernel"),
        ("nvfp4", 8, 16, 64, GluonKnobs(sub=2, stages=0), "two tiles a stage need the ring"),
        ("nvfp4", 8, 16, 64, GluonKnobs(stages=9), "`stages` = 9 (0..8)"),
        ("nvfp4", 8, 16, 64, GluonKnobs(maxnreg=300), "`maxnreg` = 300 (24..255)"),
        ("nvfp4", 8, 16, 64, GluonKnobs(stages="3"), "`stages` = '3' (an int)"),
        ("nvfp4", 8, 16, 64, GluonKnobs(multi=1), "`multi` = 1 (a bool)"),
    ],
)
def test_unfit_knobs(dtype, heads, page, d, knobs, why):
    v = Cache(dtype, [40, 3], heads=heads, d=d, page=page).view
    got = gk.knobs_unfit(v, 8, knobs)
    assert got is not None and why in got, got


def test_shared_memory_and_programs_per_sm():
    """A multi program's ring: stages x tiles x heads x (K + V) 16-row tiles (+ FP4 scale rows)
    and 8 bytes of barrier a stage; the split model's programs per SM follow from it."""
    for dtype, row in (("fp8_e4m3", 64), ("bf16", 128), ("nvfp4", 32 + 4)):
        v = Cache(dtype, [40, 3], heads=8, d=64, page=16).view
        k = GluonKnobs(multi=True, sub=2, heads=2, stages=3)
        assert gk._smem_bytes(v, k) == 3 * 2 * 2 * 2 * 16 * row + 3 * 8
        by_smem = 228 * 1024 // (gk._smem_bytes(v, k) + 1024)
        assert gk.programs_per_sm(v, 8, k) == min(24, 65536 // (168 * 32), by_smem)
        assert gk.programs_per_sm(v, 8, dataclasses.replace(k, per_sm=5)) == 5


def test_fitting_knobs():
    for dtype in GLUON:
        v = Cache(dtype, [40, 3], heads=8, d=64, page=16).view
        for k in (GluonKnobs(multi=True, sub=s, heads=h, stages=st, tma=t)
                  for s in (1, 2, 4) for h in (1, 2) for st in (2, 3) for t in (True, False)
                  if not (h == 2 and s == 4)):  # fmt: skip
            assert gk.knobs_unfit(v, 8, k) is None, (dtype, k)
        assert gk.knobs_unfit(v, 8, GluonKnobs(stages=4, rescale=-1.0)) is None


@pytest.mark.parametrize("dtype", GLUON)
def test_plans(dtype, as_if_on_gpu):
    """Knob plans at gpt-oss geometry, B=64 x 8k: the multi kernel's name, ring and tiles, its
    split model over ``H_kv / heads`` programs a split; explicit splits kept; the measured
    kernels with other constants keep their names."""
    c = Cache(dtype, [40, 3], heads=8, d=64, page=16)
    pt, sl = _batch()
    base = attention.plan_decode(c.view, 64, pt, sl)
    if dtype in gk.HD64_DEFAULTS:  # (the measured head_dim-64 default: the multi kernel)
        assert base.knobs == gk.HD64_DEFAULTS[dtype] and base.kernel.endswith("_multi")
    else:
        assert base.knobs is None and not base.kernel.endswith("_multi")
    base_name = base.kernel.removesuffix("_multi")
    for k in (GluonKnobs(multi=True, sub=2, stages=3), GluonKnobs(multi=True, sub=1, heads=2),
              GluonKnobs(multi=True, sub=4, stages=2, per_sm=10)):  # fmt: skip
        p = attention.plan_decode(c.view, 64, pt, sl, gluon_knobs=k)
        assert p.gluon and p.kernel == base_name + "_multi" and p.knobs == k
        assert p.block_n == 16 * k.sub and p.num_stages == (k.stages or 3) and not p.prefetch
        per_sm = gk.programs_per_sm(c.view, 8, k)
        assert 1 <= per_sm <= 24 and (k.per_sm is None or per_sm == k.per_sm)
        want = attention.splits.default_splits(
            64, 8 // k.heads, 8192, c.view.k.device, p.block_n, 1, per_sm, variants._GLUON_OVERHEAD
        )
        assert p.num_splits == want and p.part_out.shape == (64, 64, want, 64)
        p5 = attention.plan_decode(c.view, 64, pt, sl, gluon_knobs=k, num_splits=5)
        assert p5.num_splits == 5
    p = attention.plan_decode(c.view, 64, pt, sl, gluon_knobs="stages=4,rescale=8")
    assert p.kernel == base_name and p.num_stages == 4 and p.knobs.rescale == 8.0
    if dtype in FP4:
        p = attention.plan_decode(c.view, 64, pt, sl, gluon_knobs="sub=1,stages=3,tma=0")
        assert (p.block_n, p.num_stages, p.prefetch) == (16, 3, False)
        p = attention.plan_decode(c.view, 64, pt, sl, gluon_knobs="sub=1,stages=0")
        assert (p.block_n, p.prefetch) == (16, True)
    else:
        p = attention.plan_decode(c.view, 64, pt, sl, gluon_knobs=GluonKnobs(stages=0))
        assert (p.block_n, p.prefetch) == (16, True)


def test_plan_refusals(as_if_on_gpu):
    c = Cache("fp8_e4m3", [40, 3], heads=8, d=64, page=16)
    pt, sl = _batch()
    with pytest.raises(ValueError, match=r"`gluon_knobs` are options of the Gluon kernel"):
        attention.plan_decode(c.view, 64, pt, sl, gluon=False, gluon_knobs="multi=1")
    with pytest.raises(ValueError, match="does not run knobs with `sub` = 3"):
        attention.plan_decode(c.view, 64, pt, sl, gluon_knobs="multi=1,sub=3")
    with pytest.raises(ValueError, match="takes no Triton kernel options, got block_n"):
        attention.plan_decode(c.view, 64, pt, sl, gluon_knobs="multi=1", block_n=32)
    c8 = Cache("fp8_e4m3", [40, 3], heads=8, d=64, page=1)
    with pytest.raises(ValueError, match="the multi kernel on pages of 1 tokens"):
        attention.plan_decode(c8.view, 64, pt, sl, gluon_knobs="multi=1")
    # (a plan carries its knobs to other layers: the launch checks them against each view)
    c1 = Cache("fp8_e4m3", [40, 3], heads=2, d=64, page=1)
    p = attention.plan_decode(c.view, 64, c1.page_table, c1.seq_lens, gluon_knobs="multi=1")
    q = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="which does not run the multi kernel on pages of 1"):
        attention.decode(c1.view, q, plan=dataclasses.replace(p, num_q_heads=16),
                         backend="triton")  # fmt: skip


def test_env_and_table(as_if_on_gpu, monkeypatch):
    """``KVPOOL_GLUON_KNOBS`` applies where it fits (else the defaults); the head_dim-64 table
    applies at groups <= 8 only; explicit knobs win over both."""
    pt, sl = _batch()
    c = Cache("nvfp4", [40, 3], heads=8, d=64, page=16)
    monkeypatch.setenv(gk.KNOBS_ENV, "multi=1,heads=2,sub=1")
    p = attention.plan_decode(c.view, 64, pt, sl)
    assert p.kernel == "gluon_fp4_hd64_multi" and p.knobs == GluonKnobs(multi=True, heads=2, sub=1)
    c3 = Cache("nvfp4", [40, 3], heads=3, d=64, page=16)
    p = attention.plan_decode(c3.view, 24, pt, sl)
    assert p.kernel == "gluon_fp4_hd64" and p.knobs is None  # (3 KV heads: env knobs unfit)
    p = attention.plan_decode(c.view, 64, pt, sl, gluon_knobs="stages=3")
    assert p.knobs == GluonKnobs(stages=3)
    monkeypatch.delenv(gk.KNOBS_ENV)
    monkeypatch.setitem(gk.HD64_DEFAULTS, "nvfp4", GluonKnobs(multi=True, sub=4, stages=2))
    assert attention.plan_decode(c.view, 64, pt, sl).knobs.sub == 4
    assert attention.plan_decode(c.view, 128, pt, sl).knobs is None  # (a group of 16)
    c128 = Cache("nvfp4", [40, 3], heads=8, d=128, page=16)
    assert attention.plan_decode(c128.view, 64, pt, sl).knobs is None
    monkeypatch.setenv(gk.KNOBS_ENV, "bogus")
    with pytest.raises(ValueError, match="gluon knobs 'bogus': bad item"):
        attention.plan_decode(c.view, 64, pt, sl)


def test_sweep_variants_fit(as_if_on_gpu):
    """Every variant ``benches/attention/sweep_hd64.py`` times is a plan at gpt-oss geometry
    (named once per dtype), so a sweep run spends no check on a refusal."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benches", "attention"))
    import sweep_hd64

    pt, sl = _batch()
    for dtype in sweep_hd64.DTYPES:
        c = Cache(dtype, [40, 3], heads=8, d=64, page=16)
        names = [n for n, _ in sweep_hd64.variants_for(dtype)]
        assert len(names) == len(set(names)) and names[0] == "default", names
        for name, kw in sweep_hd64.variants_for(dtype)[1:]:
            p = attention.plan_decode(c.view, 64, pt, sl, max_seq_len=8192, gluon_knobs=kw)
            assert p.knobs.label() == name and 1 <= p.num_splits <= 8, (name, p.num_splits)


def test_replay_key_holds_the_knobs(as_if_on_gpu):
    c = Cache("fp8_e4m3", [40, 3], heads=8, d=64, page=16)
    pt, sl = _batch(2, 64)
    a = attention.plan_decode(c.view, 64, pt, sl, gluon_knobs="multi=1,sub=1", num_splits=2)
    b = dataclasses.replace(a, knobs=GluonKnobs(multi=True, sub=1, stages=4))
    assert replay._plan_key(a) != replay._plan_key(b)


# --- GPU -------------------------------------------------------------------------------------

# (knobs, the options of the two calls each runs: (plan kwargs, decode options))
MULTI = [
    GluonKnobs(multi=True, sub=1, stages=3),
    GluonKnobs(multi=True, sub=2, stages=3),
    GluonKnobs(multi=True, sub=4, stages=2),
    GluonKnobs(multi=True, sub=1, heads=2, stages=4),
    GluonKnobs(multi=True, sub=2, heads=2, stages=2),
    GluonKnobs(multi=True, sub=2, stages=3, tma=False),
    GluonKnobs(multi=True, sub=2, heads=2, stages=3, tma=False),
    GluonKnobs(multi=True, sub=2, stages=4, ahead=2),
    GluonKnobs(multi=True, sub=2, stages=3, rescale=-1.0),
]
CALLS = [
    ({"num_splits": 5}, {"sinks": True}),
    ({"num_splits": 1}, {"sinks": True, "window": 128}),
    ({}, {"softcap": 20.0, "sm_scale": 0.2, "window": 700}),
]
LENS = [1, 5, 16, 17, 33, 100, 1000, 4093, 64, 2050]


def _opts(opts, hq):
    o = dict(opts)
    if o.pop("sinks", False):
        o["sinks"] = torch.linspace(-2.0, 3.0, hq)
    return o


def _check(c, hq, knobs, calls, tri_too=True):
    for plan_kw, opts in calls:
        kw = {"gluon_knobs": knobs, **plan_kw}
        out, ref = run_decode(c, hq, backend="triton", device="cuda", plan_kw=kw,
                              **_opts(opts, hq))  # fmt: skip
        err = rel_err(out, ref)
        assert err < TOL[c.dtype], (knobs, plan_kw, opts, err)
        if tri_too:  # as close to the oracle as the Triton kernel
            tri, _ = run_decode(c, hq, backend="triton", device="cuda",
                                plan_kw={"gluon": False, **plan_kw}, **_opts(opts, hq))  # fmt: skip
            floor = 2.0**-7 if c.dtype == "fp4_mx_block16" else TOL[c.dtype] / 4
            assert err <= max(1.25 * rel_err(tri, ref), floor), (knobs, plan_kw, opts)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", MULTI, ids=lambda k: k.label())
@pytest.mark.parametrize("dtype", GLUON)
def test_multi_gpu(dtype, knobs):
    """The multi kernel at gpt-oss geometry (64 / 8 x 64) against the fp64 oracle: ragged
    lengths ending mid-tile, mid-stage and mid-page, slots past them NaN-poisoned (TMA boxes
    read them: their V words are zeroed), sinks with several splits, sinks with the sliding
    window in one split, soft-cap with a window and the planner's splits."""
    c = Cache(dtype, LENS, heads=8, d=64, page=16, device="cuda", heavy=True)
    _check(c, 64, knobs, CALLS, tri_too=knobs.sub == 2 and knobs.heads == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "bf16", "nvfp4", "fp4_mx_block16"])
def test_multi_gpu_other_geometries(dtype):
    """Groups of 4 (rows 4..7 padding) and 16 (16-wide PV dots), head_dim 128 (not bf16),
    pages of 64 (one page id serves four tiles), 2 KV heads a program where the group fits."""
    for hq, hk, d, page, knobs in [
        (16, 4, 64, 16, GluonKnobs(multi=True, sub=2, heads=2)),
        (32, 2, 64, 64, GluonKnobs(multi=True, sub=4, stages=2)),
        (32, 8, 128, 16, GluonKnobs(multi=True, sub=2, heads=2)),
        (32, 8, 128, 64, GluonKnobs(multi=True, sub=1, stages=4, tma=False)),
    ]:
        if d == 128 and dtype == "bf16":
            continue
        c = Cache(dtype, LENS, heads=hk, d=d, page=page, device="cuda", heavy=True)
        _check(c, hq, knobs, CALLS[:2], tri_too=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GLUON)
@pytest.mark.parametrize(
    "knobs", ["stages=2", "stages=5", "stages=3,rescale=8", "stages=4,rescale=-1", "stages=0"]
)
def test_measured_kernels_with_knobs_gpu(dtype, knobs):
    """The measured Gluon kernels with other ring depths, lazy or eager rescale and register
    prefetch (FP4 also one tile a stage, and cp.async instead of TMA)."""
    c = Cache(dtype, LENS, heads=8, d=64, page=16, device="cuda", heavy=True)
    _check(c, 64, knobs, CALLS[:2], tri_too=False)
    if dtype in FP4 and knobs == "stages=2":
        for k in ("sub=1,stages=3", "sub=2,stages=3,tma=0", "sub=1,stages=4,tma=1"):
            _check(c, 64, k, CALLS[:2], tri_too=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "bf16", "nvfp4"])
@pytest.mark.parametrize("tma", [True, False])
def test_multi_gpu_window_reads_nothing_before_it(dtype, tma):
    """As test_attention_decode's Gluon case: pages wholly before the window get page ids far
    out of bounds and the rows of the window's first 16-token block before its start NaN bytes
    (K and V: the TMA boxes read them); the answer is unchanged, bit for bit."""
    lens, window = [700, 1000, 40, 2100], 300
    knobs = GluonKnobs(multi=True, sub=2, heads=2, stages=3, tma=tma)
    c = Cache(dtype, lens, heads=8, d=64, page=16, device="cuda")
    for kw in ({"num_splits": 1}, {"num_splits": 5}):
        plan_kw = {"gluon_knobs": knobs, **kw}
        before, _ = run_decode(c, 64, backend="triton", device="cuda", plan_kw=plan_kw,
                               window=window)  # fmt: skip
        pt, k, v = c.page_table.clone(), c.view.k.clone(), c.view.v.clone()
        scales = [t.clone() for t in (c.view.k_block_scale, c.view.v_block_scale) if t is not None]
        for b, n in enumerate(lens):
            lo = max(n - window, 0)
            lo16 = lo // 16 * 16
            for tok in range(lo16, lo):
                slot = int(c.page_table[b, tok // 16]) * 16 + tok % 16
                for t in (c.view.k, c.view.v):
                    if dtype == "bf16":
                        t[slot] = float("nan")
                    elif dtype != "nvfp4":  # (FP4 codes are all finite: poison the scales)
                        t.view(torch.uint8)[slot] = 0x7F
                for t in (c.view.k_block_scale, c.view.v_block_scale):
                    if t is not None:
                        t.view(torch.uint8)[slot] = 0x7F
            c.page_table[b, : lo16 // 16] = 1 << 30
        try:
            after, _ = run_decode(c, 64, backend="triton", device="cuda", plan_kw=plan_kw,
                                  window=window)  # fmt: skip
        finally:
            c.page_table.copy_(pt)
            c.view.k.copy_(k)
            c.view.v.copy_(v)
            for t, s in zip([t for t in (c.view.k_block_scale, c.view.v_block_scale)
                             if t is not None], scales, strict=True):  # fmt: skip
                t.copy_(s)
        assert torch.equal(before, after), kw
