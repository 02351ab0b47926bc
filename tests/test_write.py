"""pool.write / dequantize: every write path against the pure-torch reference (kvpool.formats).

Modes: ``torch`` (CPU reference path, runs in the default pytest process), ``interpret`` (the
Triton kernels on CPU tensors under TRITON_INTERPRET=1, tiny shapes), ``gpu`` (the kernels on
CUDA, bit for bit against the reference computed on the CPU). The kernels build fp8/FP4 bytes with
integer arithmetic and never cast to fp8, so the interpreter's inexact fp8 casts do not apply and
bytes are compared exactly in every mode; values read back are compared exactly too.

Expected buffers are built here independently of kvpool.write: multi-dimensional indexing of
page-major views (not the launcher's flat offsets) and formats.quantize on CPU copies.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import kvpool  # noqa: E402
from kvpool import formats  # noqa: E402
from kvpool.config import ModelSpec  # noqa: E402
from kvpool.write import dequantize_kv, write_kv  # noqa: E402

# numpy (inside the Triton interpreter) warns on the overflows the kernels saturate on purpose
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

MODES = [
    pytest.param("torch", id="torch"),
    pytest.param("interpret", id="interpret", marks=pytest.mark.interpret),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]
KERNEL_MODES = MODES[1:]
CASES = [
    ("bf16", "linear"),
    ("fp32", "linear"),
    ("fp16", "linear"),
    ("fp8_e4m3", "linear"),
    ("fp8_e5m2", "linear"),
    ("nvfp4", "linear"),
    ("nvfp4", "page_major"),
    ("nvfp4", "mixed"),
    ("nvfp4", "linear_workspace"),
    ("fp4_mx_block16", "linear"),
]


def device_for(mode: str) -> str:
    if mode == "interpret" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 set before triton is imported (scripts/test)")
    if mode == "gpu":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        return "cuda"
    return "cpu"


def backend_for(mode: str) -> str:
    return "torch" if mode == "torch" else "triton"


def make_pool(
    dtype,
    device,
    *,
    recipe="linear",
    heads=2,
    head_dim=64,
    page_size=8,
    num_tokens=64,
    layers=2,
    mla=False,
):
    cfg = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads * 2,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "hidden_size": 256,
        "vocab_size": 100,
    }
    if mla:
        cfg.update(
            {
                "kv_lora_rank": head_dim - 64,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 64,
                "v_head_dim": 64,
                "num_key_value_heads": heads * 2,
            }
        )
    plan = kvpool.size_for(
        ModelSpec.from_dict(cfg),
        dtype,
        num_tokens=num_tokens,
        page_size=page_size,
        nvfp4_recipe=recipe,
    )
    pool = kvpool.KVPool(plan, device=device)
    g = torch.Generator().manual_seed(123)
    for buf in pool.buffers.values():  # poison: unwritten bytes must stay as they were
        if buf.numel() > 1:
            buf.view(torch.uint8).copy_(
                torch.randint(0, 256, buf.view(torch.uint8).shape, generator=g, dtype=torch.uint8)
            )
    return pool


def heavy_tailed(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    ch = torch.exp(torch.randn(shape[-2:], generator=g) * 0.75)
    ch.view(-1)[torch.randperm(ch.numel(), generator=g)[: max(1, ch.numel() // 32)]] *= 20.0
    z = torch.randn(shape, generator=g)
    tails = torch.distributions.StudentT(torch.tensor(3.0)).sample(shape[:1] + (1, 1))
    return (z * ch * (1 + tails.abs())).to(dtype)


def u8(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def snapshot(pool):
    return {n: u8(b).detach().cpu().clone() for n, b in pool.buffers.items()}


def expected_after(pool, before, layer, loc, k, v):
    """Buffers after a write, built from formats.quantize and explicit indexing (CPU)."""
    exp = {n: b.clone() for n, b in before.items()}
    view = pool.layer(layer)
    loc = loc.cpu().to(torch.int64)
    ps = view.page_size
    for which, x in (("k", k), ("v", v)):
        if x is None:
            continue
        name = f"layers.{layer}.{'kv' if view.is_mla else which}"
        sc = pool.buffers.get(name + "_scale", pool.buffers.get(name + "_global_scale"))
        data, bs = formats.quantize(x.cpu(), view.dtype, 1.0 if sc is None else sc.cpu())
        exp[name][loc] = u8(data)
        if bs is None:
            continue
        bs = u8(bs)
        if name + "_block_scale" in exp:
            buf = exp[name + "_block_scale"]
            buf.view(buf.shape[0], -1)[loc] = bs.reshape(len(loc), -1)
        if name + "_block_scale_page_major" in exp:
            pm = exp[name + "_block_scale_page_major"]  # [P, H, ps, DB]
            pages, offs = loc // ps, loc % ps
            db = pm.shape[-1]
            for h in range(pm.shape[1]):
                if which == "v":  # 4-token interleave: [P, H, ps/4, DB, 4]
                    pm.view(pm.shape[0], pm.shape[1], ps // 4, db, 4)[
                        pages, h, offs // 4, :, offs % 4
                    ] = bs[:, h]
                else:
                    pm[pages, h, offs, :] = bs[:, h]
    return exp


def assert_buffers_equal(pool, exp):
    got = snapshot(pool)
    for n in exp:
        g, e = got[n].view(torch.uint8), exp[n].view(torch.uint8)
        if not torch.equal(g, e):
            bad = (g != e).nonzero()
            raise AssertionError(
                f"{n}: {len(bad)} bytes differ, first at {bad[0].tolist()}: "
                f"got {g[tuple(bad[0])]}, expected {e[tuple(bad[0])]}"
            )


def set_scales(pool, ks, vs):
    n = pool.plan.spec.num_layers
    pool.set_kv_scales([ks] * n, [vs] * n, source="test")


def shape_for(mode):
    # interpreter: tiny; torch / GPU: enough tokens for many programs and both page layouts
    return (
        dict(t=7, heads=2, head_dim=64)
        if mode == "interpret"
        else dict(t=300, heads=8, head_dim=128)
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,recipe", CASES)
def test_write_matches_reference(mode, dtype, recipe):
    dev = device_for(mode)
    s = shape_for(mode)
    pool = make_pool(
        dtype,
        dev,
        recipe=recipe,
        heads=s["heads"],
        head_dim=s["head_dim"],
        page_size=16,
        num_tokens=512,
    )
    set_scales(pool, 0.37, 0.011) if dtype != "nvfp4" else set_scales(pool, 0.0173, 0.0031)
    in_dtypes = [torch.bfloat16]
    if mode == "torch" or (dtype, recipe) in (
        ("fp8_e4m3", "linear"),
        ("nvfp4", "mixed"),
        ("fp4_mx_block16", "linear"),
    ):
        in_dtypes += [torch.float16, torch.float32]
    for i, in_dt in enumerate(in_dtypes):
        shape = (s["t"], s["heads"], s["head_dim"])
        k = heavy_tailed(shape, 10 + i, in_dt)
        v = heavy_tailed(shape, 20 + i, in_dt) * 0.05
        g = torch.Generator().manual_seed(i)
        loc = (torch.randperm(512, generator=g)[: s["t"]] + 16).to(
            torch.int32 if i % 2 else torch.int64
        )
        before = snapshot(pool)
        write_kv(pool.layer(1), loc.to(dev), k.to(dev), v.to(dev), backend=backend_for(mode))
        assert_buffers_equal(pool, expected_after(pool, before, 1, loc, k, v))
        # read back: the dequantize path equals the reference dequantization exactly
        for which, x in (("k", k), ("v", v)):
            got = dequantize_kv(pool.layer(1), loc.to(dev), which, backend=backend_for(mode)).cpu()
            name = f"layers.1.{which}"
            sc = pool.buffers.get(name + "_scale", pool.buffers.get(name + "_global_scale"))
            ref = formats.dequantize(
                *formats.quantize(x, dtype, 1.0 if sc is None else sc.cpu()),
                dtype,
                1.0 if sc is None else sc.cpu(),
            )
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_edge_values_bit_exact(mode):
    """Ties, subnormals, boundaries, signed zeros, huge and tiny blocks (finite: the rules for
    non-finite values have their own test)."""
    dev = device_for(mode)
    d = 64
    vals = torch.tensor(
        [
            0.0,
            -0.0,
            464.0,
            465.0,
            -465.0,
            448.0,
            1e-3,
            -1.3e-3,
            2.0**-10,
            3 * 2.0**-11,
            2.0**-7 * 1.0625,
            57344.0,
            61440.0,
            1e30,
            -3e38,
            1e-40,
            -1e-44,
            0.25,
            0.75,
            1.25,
            1.75,
            2.5,
            3.5,
            5.0,
            6.0,
            7.0,
            0.0625,
            1.5,
            2.0**-126,
            2.0**-127,
            3.0,
            1000.0,
        ]
    )
    rows = [
        vals.repeat(2)[:d],
        torch.zeros(d),
        torch.full((d,), 1e-39),
        torch.full((d,), 2.0**-130),
        torch.linspace(-7, 7, d),
        torch.full((d,), -0.0),
        torch.full((d,), 3.3e38),
        torch.arange(d, dtype=torch.float32) * 2.0**-12,
    ]
    x = torch.stack(rows)[:, None, :].repeat(1, 2, 1)  # [T, H=2, D]
    x[:, 1] *= -0.5
    t = x.shape[0]
    loc = torch.arange(t) + 8
    for dtype, scale in (
        ("fp8_e4m3", 1.0),
        ("fp8_e4m3", 0.01171875),
        ("fp8_e5m2", 1.0),
        ("nvfp4", 1.0),
        ("nvfp4", 3e-5),
        ("fp4_mx_block16", 1.0),
    ):
        pool = make_pool(dtype, dev, heads=2, head_dim=d, page_size=8, num_tokens=32)
        set_scales(pool, scale, scale)
        before = snapshot(pool)
        write_kv(
            pool.layer(0), loc.to(dev), x.to(dev), x.flip(0).to(dev).contiguous(), backend="triton"
        )
        assert_buffers_equal(pool, expected_after(pool, before, 0, loc, x, x.flip(0)))


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_nonfinite_rules(mode):
    """NaN/Inf on the kernel path follow formats' documented rules (no host sync, no raise)."""
    dev = device_for(mode)
    nan, inf = float("nan"), float("inf")
    row = torch.tensor([nan, inf, -inf, 1.0] + [0.5] * 12 + [1.0] * 16)  # two FP4 blocks
    x = row[None, None, :].repeat(1, 1, 1)  # [1, 1, 32]
    for dtype, data_exp, bs_exp in (
        ("fp8_e4m3", [0x7F, 0x7E, 0xFE, 0x38], None),
        ("fp8_e5m2", [0x7F, 0x7B, 0xFB, 0x3C], None),
        ("bf16", None, None),
        # nvfp4: NaN -> 0, +-inf -> +-FLT_MAX: block scale saturates at 448 (0x7E), element +-6
        ("nvfp4", [0x70, 0x0F], [0x7E]),
        # mx: +-inf -> +-MX_MAX = 6 * 2^125: exponent byte 252, element +-6
        ("fp4_mx_block16", [0x70, 0x0F], [252]),
    ):
        pool = make_pool(dtype, dev, heads=1, head_dim=32, page_size=4, num_tokens=8, layers=1)
        if dtype != "bf16":
            set_scales(pool, 1.0, 1.0)
        loc = torch.tensor([5], device=dev)
        write_kv(pool.layer(0), loc, x.to(dev), x.to(dev), backend="triton")
        k = u8(pool.buffers["layers.0.k"])[5, 0].cpu()
        if dtype == "bf16":
            got = pool.buffers["layers.0.k"][5, 0, :4].float().cpu()
            assert got[0].isnan() and got[1] == inf and got[2] == -inf and got[3] == 1.0
            continue
        assert k[: len(data_exp)].tolist() == data_exp, dtype
        if bs_exp is not None:
            buf = u8(pool.buffers["layers.0.k_block_scale"])
            bs = buf.reshape(buf.shape[0], -1)[5].cpu()
            assert bs[0].item() == bs_exp[0], dtype
        # the reference follows the same rules
        ref, _ = formats.quantize(x[0], dtype)
        assert u8(ref)[0, : len(data_exp)].tolist() == data_exp


def _bits_f32(ints):
    return torch.tensor(ints, dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_fp4_short_and_safe_paths(mode):
    """The FP4 kernel takes a short path for tiles without NaN (nvfp4: also 2^-90 <= g <=
    2^100) and an exact sanitizing path otherwise; both must equal the reference bit for bit.

    Covers: +-inf without NaN (safe path too: an inf block saturates its scale), -NaN (safe
    path: +0, no sign), the mx exponent byte around the subnormal boundary of amax / 6 (amax
    bits 0x01400001 rounds to 2^-127 -> byte 0, its neighbours), e4m3 block scales at every
    value, tie and one ulp off, and nvfp4 with a global scale below 2^-90 (safe path) and at
    it (short path)."""
    dev = device_for(mode)
    d = 32  # two blocks per head
    inf, nan = float("inf"), float("nan")
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    mx_edges = [0x01400001, 0x01400000, 0x01400002, 0x01C00000, 0x01BFFFFF, 0x00800000,
                0x007FFFFF, 0x01000001, 0x013FFFFF, 0x01400003]  # fmt: skip
    amaxes = torch.cat(
        [
            _bits_f32(mx_edges),
            torch.cat([e4m3, mids, torch.nextafter(mids, torch.tensor(inf))]) * 6,
        ]
    )
    rows = [
        torch.tensor([inf, -inf, 1.0, -0.5] + [0.25] * 12 + [-inf] + [3.0] * 15),
        torch.tensor([-nan, 1.0, -2.0, -0.0] + [0.75] * 12 + [nan] * 16),
    ]
    g = torch.Generator().manual_seed(5)
    for a in amaxes.split(2):  # blocks with these amaxes (and a spread of smaller elements)
        blk = torch.rand(len(a), 16, generator=g) * 2 - 1
        blk = blk * (a[:, None] / blk.abs().amax(dim=1, keepdim=True))
        blk[:, 0] = a
        rows.append(blk.reshape(-1))
    x = torch.stack([torch.cat([r, torch.zeros(d - len(r))]) if len(r) < d else r[:d]
                     for r in rows])[:, None, :]  # fmt: skip
    x = x[:8] if mode == "interpret" else x
    x = torch.cat([x, -x.flip(0)], dim=1)  # [T, H=2, D]
    t = x.shape[0]
    loc = torch.arange(t) + 8
    cases = [("fp4_mx_block16", 1.0), ("nvfp4", 1.0), ("nvfp4", 2.0**-90), ("nvfp4", 2.0**-100)]
    for dtype, scale in cases:
        pool = make_pool(dtype, dev, heads=2, head_dim=d, page_size=8, num_tokens=t + 8)
        set_scales(pool, scale, scale)
        for xin in (x, x * 2.0**-118 if scale < 1 else x):  # tiny blocks for tiny g
            for bt in (1, 4):  # one token per program: each row takes its own path
                before = snapshot(pool)
                xv = xin.flip(0).contiguous()
                write_kv(pool.layer(0), loc.to(dev), xin.to(dev), xv.to(dev), backend="triton",
                         block_t=bt)  # fmt: skip
                assert_buffers_equal(pool, expected_after(pool, before, 0, loc, xin, xv))


@pytest.mark.parametrize("mode", MODES)
def test_out_of_range_and_checks(mode):
    """Kernel path: out-of-range slots are skipped; torch path and debug raise, naming `loc`."""
    dev = device_for(mode)
    pool = make_pool("fp8_e4m3", dev, heads=2, head_dim=64, page_size=8, num_tokens=32, layers=1)
    set_scales(pool, 1.0, 1.0)
    k = heavy_tailed((3, 2, 64), 1)
    loc = torch.tensor([9, 40, -1], device=dev)  # rows = 40
    before = snapshot(pool)
    if mode == "torch":
        with pytest.raises(ValueError, match=r"`loc\[1\]` = 40 is outside"):
            pool.write(0, loc, k.to(dev), k.to(dev))
        assert_buffers_equal(pool, before)
        with pytest.raises(ValueError, match="non-finite"):
            bad = k.clone()
            bad[0, 1, 3] = float("nan")
            pool.write(0, torch.tensor([9, 10, 11]), bad, k)
        with pytest.raises(ValueError, match="repeats a slot"):
            pool.write(0, torch.tensor([9, 9, 11]), k, k)
        return
    with pytest.raises(ValueError, match=r"`loc\[1\]` = 40"):
        write_kv(pool.layer(0), loc, k.to(dev), k.to(dev), backend="triton", debug=True)
    with pytest.raises(ValueError, match="non-finite"):
        bad = k.clone()
        bad[2, 0, 0] = float("inf")
        write_kv(
            pool.layer(0),
            torch.tensor([9, 10, 11], device=dev),
            bad.to(dev),
            k.to(dev),
            backend="triton",
            debug=True,
        )
    assert_buffers_equal(pool, before)
    write_kv(pool.layer(0), loc, k.to(dev), k.to(dev), backend="triton")
    exp = expected_after(pool, before, 0, torch.tensor([9]), k[:1], k[:1])
    assert_buffers_equal(pool, exp)


@pytest.mark.parametrize("mode", MODES)
def test_padding_slots_may_repeat_and_strided_input(mode):
    dev = device_for(mode)
    pool = make_pool(
        "nvfp4", dev, recipe="mixed", heads=2, head_dim=64, page_size=4, num_tokens=16, layers=1
    )
    set_scales(pool, 0.01, 0.02)
    qkv = heavy_tailed((5, 8, 64), 3)  # q (4 heads) | k (2) | v (2): k and v are strided views
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    loc = torch.tensor([0, 0, 13, 6, 0])  # padded tokens go to slot 0 (the padding page)
    before = snapshot(pool)
    write_kv(pool.layer(0), loc.to(dev), k.to(dev), v.to(dev), backend=backend_for(mode))
    real = torch.tensor([2, 3])
    exp = expected_after(pool, before, 0, loc[real], k[real], v[real])
    got = snapshot(pool)
    for n in exp:  # rows of the padding page hold one of the padded tokens: not compared
        if n.endswith("page_major"):
            torch.testing.assert_close(got[n][1:], exp[n][1:], rtol=0, atol=0)
        elif got[n].dim() > 1:
            torch.testing.assert_close(got[n][4:], exp[n][4:], rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "nvfp4", "fp4_mx_block16"])
def test_mla_latent(mode, dtype):
    dev = device_for(mode)
    pool = make_pool(
        dtype, dev, heads=1, head_dim=128, page_size=8, num_tokens=32, layers=1, mla=True
    )
    view = pool.layer(0)
    assert view.is_mla and view.head_dim == 128
    set_scales(pool, 0.05, 0.05)
    kv = heavy_tailed((4, 1, 128), 4)
    loc = torch.tensor([8, 9, 31, 12])
    before = snapshot(pool)
    write_kv(view, loc.to(dev), kv.to(dev), backend=backend_for(mode))
    assert_buffers_equal(pool, expected_after(pool, before, 0, loc, kv, None))
    with pytest.raises(ValueError, match="`v` must be None"):
        write_kv(view, loc.to(dev), kv.to(dev), kv.to(dev), backend=backend_for(mode))


def test_argument_checks_name_the_argument():
    pool = make_pool("fp8_e4m3", "cpu", heads=2, head_dim=64, page_size=8, num_tokens=32, layers=1)
    set_scales(pool, 1.0, 1.0)
    k = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    loc = torch.tensor([8, 9, 10])
    cases = [
        (dict(loc=loc.float()), "`loc` has dtype"),
        (dict(loc=loc[None]), "`loc` must be 1-D"),
        (dict(k=k[:, :1]), r"`k` has shape \(3, 1, 64\)"),
        (dict(k=k.to(torch.int32)), "`k` has dtype"),
        (dict(v=k[:2]), "`v` has shape"),
        (dict(v=None), "`v` is required"),
        (dict(k=k.to("meta")), "`k` is on meta"),
        (dict(backend="cuda"), "`backend`"),
        (dict(backend="triton", block_t=3), "`block_t`|needs CUDA"),
    ]
    for kw, msg in cases:
        args = dict(loc=loc, k=k, v=k, backend="torch")
        args.update(kw)
        with pytest.raises(ValueError, match=msg):
            write_kv(pool.layer(0), **args)
    with pytest.raises(ValueError, match="`which`"):
        dequantize_kv(pool.layer(0), loc, "q")
    with pytest.raises(ValueError, match="`out_dtype`"):
        dequantize_kv(pool.layer(0), loc, "k", torch.int8)


@pytest.mark.parametrize("mode", MODES)
def test_page_copied_out_and_back(mode):
    """KVB-07: a page copied out (host/offload) and back dequantizes to exactly the same values:
    block scales (both layouts) travel with the data; a copy of the data alone does not."""
    dev = device_for(mode)
    for dtype, recipe in (("nvfp4", "mixed"), ("fp4_mx_block16", "linear"), ("fp8_e4m3", "linear")):
        pool = make_pool(
            dtype, dev, recipe=recipe, heads=2, head_dim=64, page_size=4, num_tokens=16, layers=1
        )
        set_scales(pool, 0.02, 0.03)
        page = 2
        loc = torch.arange(page * 4, page * 4 + 4)
        k, v = heavy_tailed((4, 2, 64), 7), heavy_tailed((4, 2, 64), 8)
        write_kv(pool.layer(0), loc.to(dev), k.to(dev), v.to(dev), backend=backend_for(mode))
        before = pool.dequantize(0, loc.to(dev))

        def page_rows(name, buf, page=page):
            return buf[page] if name.endswith("page_major") else buf[page * 4 : (page + 1) * 4]

        per_page = {
            n: b for n, b in pool.buffers.items() if n.startswith("layers.") and b.numel() > 1
        }
        host = {n: page_rows(n, b).cpu().clone() for n, b in per_page.items()}
        for n, b in per_page.items():  # the page is reused by someone else meanwhile
            page_rows(n, u8(b)).fill_(0x3C)
        for n, b in per_page.items():
            page_rows(n, b).copy_(host[n].to(dev))
        after = pool.dequantize(0, loc.to(dev))
        for a, b in zip(before, after, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if dtype != "fp8_e4m3":  # data without its scales comes back wrong
            for n, b in per_page.items():
                if "scale" in n:
                    page_rows(n, u8(b)).fill_(0x3C)
            assert not torch.equal(pool.dequantize(0, loc.to(dev))[0], before[0])


@pytest.mark.parametrize("mode", MODES)
def test_kvb12_kvb13_kvb14_through_every_write_path(mode):
    dev = device_for(mode)
    cases = [
        (
            "fp8_e4m3",
            1.0,
            [1000.0, -600.0, 3.0, 0.01, 464.0, 465.0, 0.0, 0.0],
            [0x7E, 0xFE, 0x44, 0x05, 0x7E, 0x7E],
        ),
        (
            "fp8_e5m2",
            1.0,
            [1.0, 2.0, 3.5, 0.25, 1000.0, 70000.0, 0.0, 0.0],
            [0x3C, 0x40, 0x43, 0x34, 0x64, 0x7B],
        ),
        ("fp8_e4m3", 1.0, [1.0, 2.0, 3.5, 0.25, 0.0, 0.0, 0.0, 0.0], [0x38, 0x40, 0x46, 0x28]),
    ]
    for dtype, scale, vals, exp in cases:
        pool = make_pool(dtype, dev, heads=1, head_dim=16, page_size=4, num_tokens=8, layers=1)
        set_scales(pool, scale, scale)
        x = torch.tensor(vals + [0.0] * 8)[None, None, :]
        pool_write(pool, mode, torch.tensor([5], device=dev), x.to(dev), x.to(dev))
        assert u8(pool.buffers["layers.0.k"])[5, 0, : len(exp)].cpu().tolist() == exp
        got = dequantize_kv(
            pool.layer(0), torch.tensor([5], device=dev), "v", backend=backend_for(mode)
        )
        want = {
            0x7E: 448.0,
            0xFE: -448.0,
            0x44: 3.0,
            0x05: 0.009765625,
            0x3C: 1.0,
            0x40: 2.0,
            0x43: 3.5,
            0x34: 0.25,
            0x64: 1024.0,
            0x7B: 57344.0,
            0x38: 1.0,
            0x46: 3.5,
            0x28: 0.25,
        }
        assert got[0, 0, : len(exp)].cpu().tolist() == [want[b] for b in exp]
    b0 = [3.2, 1.0, -0.3, 0, 0.6, -1.4, 2.2, 0.1, 0, 0, 0, 0, 0, 0, 0, -3.2]
    b1 = [19.0, -7.2, 5.4, 1.2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -13.0]
    pool = make_pool(
        "fp4_mx_block16", dev, heads=1, head_dim=32, page_size=4, num_tokens=8, layers=1
    )
    x = torch.tensor(b0 + b1)[None, None, :]
    pool_write(pool, mode, torch.tensor([6], device=dev), x.to(dev), x.to(dev))
    assert pool.buffers["layers.0.k"][6, 0].cpu().tolist() == [
        0x25,
        0x09,
        0xB1,
        0x04,
        0,
        0,
        0,
        0xD0,
        0xC6,
        0x13,
        0,
        0,
        0,
        0,
        0,
        0xD0,
    ]
    assert pool.buffers["layers.0.k_block_scale"][6].cpu().tolist() == [0x7F, 0x81]
    got = dequantize_kv(
        pool.layer(0), torch.tensor([6], device=dev), "k", backend=backend_for(mode)
    )
    assert got[0, 0].cpu().tolist() == [
        3,
        1,
        -0.5,
        0,
        0.5,
        -1.5,
        2,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        -3,
        16,
        -8,
        6,
        2,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        -12,
    ]


def pool_write(pool, mode, loc, k, v):
    """pool.write for the torch and GPU modes (the public path); the kernel on CPU tensors for
    the interpreter."""
    if mode == "interpret":
        write_kv(pool.layer(0), loc, k, v, backend="triton")
    else:
        pool.write(0, loc, k, v)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype,heads,head_dim",
    [("fp8_e4m3", 3, 80), ("fp8_e5m2", 5, 24), ("nvfp4", 3, 48), ("fp4_mx_block16", 5, 16)],
)
def test_head_sizes_that_are_not_powers_of_two(mode, dtype, heads, head_dim):
    """H * D not a power of two: the padded tile columns must neither load nor store."""
    dev = device_for(mode)
    pool = make_pool(
        dtype, dev, heads=heads, head_dim=head_dim, page_size=4, num_tokens=32, layers=1
    )
    set_scales(pool, 0.03, 0.07)
    k = heavy_tailed((6, heads, head_dim), 11)
    v = heavy_tailed((6, heads, head_dim), 12)
    loc = torch.tensor([4, 35, 17, 9, 22, 5])
    before = snapshot(pool)
    write_kv(pool.layer(0), loc.to(dev), k.to(dev), v.to(dev), backend=backend_for(mode))
    assert_buffers_equal(pool, expected_after(pool, before, 0, loc, k, v))
    for which, x in (("k", k), ("v", v)):
        got = dequantize_kv(pool.layer(0), loc.to(dev), which, backend=backend_for(mode)).cpu()
        sc = pool.buffers.get(
            f"layers.0.{which}_scale", pool.buffers.get(f"layers.0.{which}_global_scale")
        )
        ref = formats.dequantize(
            *formats.quantize(x, dtype, sc.cpu() if sc is not None else 1.0),
            dtype,
            sc.cpu() if sc is not None else 1.0,
        )
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype, src, big, cap",
    [
        ("fp16", torch.float32, 1e6, 65504.0),  # fp16's largest finite value
        ("fp16", torch.bfloat16, 1e6, 65504.0),  # (bf16 itself rounds 65504 up to 65536)
        ("bf16", torch.float32, 3.4e38, 3.3895313892515355e38),  # (2 - 2^-7) * 2^127
    ],
)
def test_16_bit_caches_saturate_finite_inputs(mode, dtype, src, big, cap):
    # a finite input beyond the cache dtype's max is stored as +-max, never Inf (formats'
    # saturation rule; a plain cast rounded it to Inf)
    dev = device_for(mode)
    pool = make_pool(dtype, dev)
    k = torch.full((2, 2, 64), 3.0)
    k[0, 0, :4] = torch.tensor([big, -big, 1.5, -0.25])
    k = k.to(src).to(dev)
    loc = torch.tensor([8, 9], device=dev)
    write_kv(pool.layer(0), loc, k, k, backend=backend_for(mode))
    for which in ("k", "v"):
        got = dequantize_kv(pool.layer(0), loc, which)
        assert got[0, 0, :4].float().cpu().tolist() == [cap, -cap, 1.5, -0.25]
        assert bool((got[1].float() == 3.0).all())
    # NaN and +-Inf are not finite inputs: they pass as the plain cast keeps them
    y = torch.tensor([float("nan"), float("inf"), -float("inf"), big]).to(src)
    q, _ = formats.quantize(y, dtype)
    assert q[0].isnan() and q[1:].float().tolist() == [float("inf"), -float("inf"), cap]


def test_write_takes_numpy_slots_as_the_batch_helpers_return_them():
    """Issue 21 point 1: ``pool.write`` takes ``kvpool.decode_slots``' numpy int32 array."""
    import numpy as np

    plan = kvpool.size_for(
        "meta-llama/Llama-3.1-8B", "bf16", 0.9, num_tokens=64, page_size=16, weights=0, gpu="H200"
    )
    pool = kvpool.KVPool(plan, device="cpu")
    table = np.array([[1, 2], [3, 0]], dtype=np.int32)
    seq = np.array([20, 5], dtype=np.int32)
    loc = kvpool.decode_slots(table, seq, 16)  # page 2 offset 3 = 35, page 3 offset 4 = 52
    assert loc.tolist() == [35, 52]
    k = torch.randn(2, 8, 128).to(torch.bfloat16)
    v = torch.randn(2, 8, 128).to(torch.bfloat16)
    pool.write(0, loc, k, v)
    assert torch.equal(pool.layer(0).k[[35, 52]], k)
    assert torch.equal(pool.layer(0).v[[35, 52]], v)
    with pytest.raises(ValueError, match=r"`loc` is a numpy float64 array, expected numpy int32"):
        pool.write(0, loc.astype(np.float64), k, v)
