"""Fused paged attention (kvpool.attention): torch reference, Triton kernels (interpreted at tiny
shapes, on the GPU at real shapes), KVB-16 (docs/architecture.md, failure cases) for every dtype.

Oracle: an fp64 attention written here over *dense* K/V (dequantized with kvpool.formats before
they are scattered into pages), so it shares no paging/indexing code with the launchers.

Tolerances (max |out - ref| / max |ref|, against the fp64 oracle on the same dequantized values):
the kernels' dots run in fp16 (fp16, fp8, nvfp4 caches: q and p rounded to fp16), bf16 (bf16 and
fp4_mx_block16 caches) or fp32 (fp32 cache), with fp32 accumulation; output rounded to q's dtype.
"""

import math
import os
import re

import pytest

torch = pytest.importorskip("torch")

from kvpool import attention, formats  # noqa: E402
from kvpool.pool import LayerView  # noqa: E402

DTYPES = formats.DTYPES
FP4 = ("nvfp4", "fp4_mx_block16")
WORDS = ("fp8_e4m3", "fp8_e5m2", *FP4)  # caches with the word-level decode (asm)
# q in bf16 for every cache except fp32 (fp32 q): relative tolerance of the Triton path
TOL = {
    "fp32": 2e-5,
    "fp16": 8e-3,
    "bf16": 1.6e-2,
    "fp8_e4m3": 8e-3,
    "fp8_e5m2": 8e-3,
    "nvfp4": 8e-3,
    "fp4_mx_block16": 1.6e-2,
}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------- builders


class Cache:
    """A one-layer paged cache filled from dense per-request K/V, plus the dense dequantized
    copies the oracle uses. Unused slots and pages are poisoned (NaN / NaN-coded scale bytes)."""

    def __init__(
        self,
        dtype,
        lens,
        *,
        heads=2,
        d=32,
        dv=None,
        page=16,
        device="cpu",
        heavy=False,
        k_scale=None,
        v_scale=None,
        seed=0,
        extra_pages=3,
    ):
        gen = torch.Generator().manual_seed(seed)
        dv = dv or d
        self.dtype, self.lens, self.page, self.heads, self.d, self.dv = (
            dtype,
            list(lens),
            page,
            heads,
            d,
            dv,
        )
        pages_per = [max(1, -(-n // page)) for n in lens]
        num_pages = 1 + sum(pages_per) + extra_pages
        rows = num_pages * page
        fp4 = dtype in FP4
        store = attention._STORAGE[dtype]
        self.k = torch.empty(rows, heads, d // 2 if fp4 else d, dtype=store)
        self.v = torch.empty(rows, heads, dv // 2 if fp4 else dv, dtype=store)
        _poison(self.k)
        _poison(self.v)
        kbs = vbs = None
        if dtype == "nvfp4":
            kbs = torch.empty(rows, heads, d // 16, dtype=torch.float8_e4m3fn)
            vbs = torch.empty(rows, heads, dv // 16, dtype=torch.float8_e4m3fn)
        elif dtype == "fp4_mx_block16":
            kbs = torch.empty(rows, heads * d // 16, dtype=torch.uint8)
            vbs = torch.empty(rows, heads * dv // 16, dtype=torch.uint8)
        for t in (kbs, vbs):
            if t is not None:
                _poison(t)
        has_scale = dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4")
        ks = torch.tensor([k_scale if k_scale is not None else (0.05 if has_scale else 1.0)])
        vs = torch.tensor([v_scale if v_scale is not None else (0.03 if has_scale else 1.0)])
        if dtype == "nvfp4":  # global scales: amax / (6 * 448) convention, order of magnitude
            ks, vs = ks / 50, vs / 50
        # page table: shuffled pages; entries past each request's pages point at a NaN page
        perm = (torch.randperm(num_pages - 1 - extra_pages, generator=gen) + 1).tolist()
        self.poison_page = num_pages - 1
        maxp = max(pages_per) + 2
        self.page_table = torch.full((len(lens), maxp), self.poison_page, dtype=torch.int32)
        self.dense_k, self.dense_v = [], []
        kxs, vxs, slots = [], [], []
        for b, n in enumerate(lens):
            mine = [perm.pop() for _ in range(pages_per[b])]
            self.page_table[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
            kxs.append(_sample((n, heads, d), gen, heavy))
            vxs.append(_sample((n, heads, dv), gen, heavy))
            pos = torch.arange(n)
            slots.append(torch.tensor(mine)[pos // page] * page + pos % page)
        # one quantize call for all requests (rows are independent): per-request calls made
        # the B=256 GPU test spend minutes on the host
        slots = torch.cat(slots)
        for xs, data, bs, sc, dense in (
            (kxs, self.k, kbs, ks, self.dense_k),
            (vxs, self.v, vbs, vs, self.dense_v),
        ):
            qd, qb = formats.quantize(torch.cat(xs), dtype, scale=sc)
            data[slots] = qd
            if bs is not None:
                bs[slots] = qb.reshape(bs[slots].shape)
            deq = formats.dequantize(qd, qb, dtype, scale=sc).double()
            dense.extend(torch.split(deq, list(lens)))
        self.view = LayerView(
            layer=0,
            dtype=dtype,
            page_size=page,
            num_kv_heads=heads,
            head_dim=d,
            v_head_dim=dv,
            k=self.k.to(device),
            v=self.v.to(device),
            k_block_scale=None if kbs is None else kbs.to(device),
            v_block_scale=None if vbs is None else vbs.to(device),
            k_scale=ks.to(device) if has_scale else None,
            v_scale=vs.to(device) if has_scale else None,
        )
        self.page_table = self.page_table.to(device)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)


def _poison(t):
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        t.fill_(float("nan"))
    elif t.dtype == torch.float8_e4m3fn or t.dtype == torch.float8_e5m2:
        t.view(torch.uint8).fill_(0x7F)
    else:  # packed FP4 data: any byte; scales: NaN in e4m3 (0x7F) and e8m0 (0xFF)
        t.view(torch.uint8).fill_(0xFF)


def _sample(shape, gen, heavy):
    x = torch.randn(shape, generator=gen)
    if heavy:  # Student-t-like tails plus a few outlier channels, as real K has
        x = x / torch.rand(shape, generator=gen).clamp_min(0.02).sqrt()
        x[..., 3] *= 20
    return x


def oracle(
    cache, q, positions_per_req, rows_per_req, *, sm_scale, window=None, sinks=None, softcap=None
):
    """fp64 attention over the dense dequantized K/V. ``rows_per_req[b]`` are q's rows of
    request b and ``positions_per_req[b]`` their positions."""
    hq = q.shape[1]
    g = hq // cache.heads
    out = torch.zeros(q.shape[0], hq, cache.dv, dtype=torch.float64)
    for b in range(len(cache.lens)):
        k = cache.dense_k[b].repeat_interleave(g, dim=1)  # [L, Hq, D]
        v = cache.dense_v[b].repeat_interleave(g, dim=1)
        idx = torch.arange(k.shape[0])
        for r, p in zip(rows_per_req[b], positions_per_req[b], strict=True):
            s = torch.einsum("hd,lhd->hl", q[r].double(), k) * sm_scale  # [Hq, L]
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            ok = idx <= p
            if window is not None:
                ok &= idx > p - window
            s = s.masked_fill(~ok[None, :], -math.inf)
            mx = s.max(dim=1).values
            if sinks is not None:
                mx = torch.maximum(mx, sinks.double())
            e = torch.exp(s - mx[:, None])
            den = e.sum(1)
            if sinks is not None:
                den = den + torch.exp(sinks.double() - mx)
            out[r] = torch.einsum("hl,lhd->hd", e, v) / den[:, None]
    return out


def rel_err(out, ref):
    out = out.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def q_dtype(dtype):
    return torch.float32 if dtype == "fp32" else torch.bfloat16


def run_decode(cache, hq, *, backend, device="cpu", seed=1, plan_kw=None, **opts):
    gen = torch.Generator().manual_seed(seed)
    b = len(cache.lens)
    q = torch.randn(b, hq, cache.d, generator=gen).to(q_dtype(cache.dtype))
    sm = opts.pop("sm_scale", 1 / math.sqrt(cache.d))
    if opts.get("sinks") is not None:
        opts["sinks"] = opts["sinks"].to(device)
    plan = None
    if plan_kw is not None:
        plan = attention.plan_decode(cache.view, hq, cache.page_table, cache.seq_lens, **plan_kw)
    out = attention.decode(
        cache.view,
        q.to(device),
        cache.page_table,
        cache.seq_lens,
        sm_scale=sm,
        backend=backend,
        plan=plan,
        **opts,
    )
    sinks = opts.get("sinks")
    ref = oracle(
        cache,
        q,
        [[n - 1] for n in cache.lens],
        [[i] for i in range(b)],
        sm_scale=sm,
        window=opts.get("window"),
        sinks=None if sinks is None else sinks.cpu(),
        softcap=opts.get("softcap"),
    )
    return out, ref


def run_extend(
    cache, hq, qlens, *, backend, device="cpu", seed=2, use_plan=False, plan_kw=None, **opts
):
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in qlens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, cache.d, generator=gen).to(q_dtype(cache.dtype))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    sm = opts.pop("sm_scale", 1 / math.sqrt(cache.d))
    if opts.get("sinks") is not None:
        opts["sinks"] = opts["sinks"].to(device)
    plan = None
    if use_plan:
        plan = attention.plan_extend(
            cache.view, hq, cu_t, cache.page_table, cache.seq_lens, **(plan_kw or {})
        )
    out = attention.extend(
        cache.view,
        q.to(device),
        cu_t,
        cache.page_table,
        cache.seq_lens,
        sm_scale=sm,
        backend=backend,
        plan=plan,
        **opts,
    )
    rows = [list(range(cu[b], cu[b + 1])) for b in range(len(qlens))]
    pos = [list(range(n - ql, n)) for n, ql in zip(cache.lens, qlens, strict=True)]
    sinks = opts.get("sinks")
    ref = oracle(
        cache,
        q,
        pos,
        rows,
        sm_scale=sm,
        window=opts.get("window"),
        sinks=None if sinks is None else sinks.cpu(),
        softcap=opts.get("softcap"),
    )
    return out, ref


# ----------------------------------------------------------------------------- KVB-16


def kvb16_cache(dtype, seq_len, device="cpu"):
    """KVB-16: head_dim padded to 64 with zeros, 1 KV head, page_size 16."""
    d = 64
    page = 16
    fp4 = dtype in FP4
    rows = 8 * page
    store = attention._STORAGE[dtype]
    k = torch.empty(rows, 1, d // 2 if fp4 else d, dtype=store)
    v = torch.empty_like(k)
    _poison(k)
    _poison(v)
    kbs = vbs = None
    if dtype == "nvfp4":
        kbs = torch.empty(rows, 1, d // 16, dtype=torch.float8_e4m3fn)
        vbs = torch.empty_like(kbs)
    elif dtype == "fp4_mx_block16":
        kbs = torch.empty(rows, d // 16, dtype=torch.uint8)
        vbs = torch.empty_like(kbs)
    for t in (kbs, vbs):
        if t is not None:
            _poison(t)
    kd = torch.zeros(seq_len, 1, d)
    vd = torch.zeros(seq_len, 1, d)
    for i in range(4):
        kd[i, 0, i] = 1
        vd[i, 0, i] = 1
    vd[4, 0, :4] = 1
    if seq_len <= 16:
        pt = [1, 7, 7, 7]
    else:
        pt = [1, 3, 7, 7]
    slots = torch.tensor([pt[i // page] * page + i % page for i in range(seq_len)])
    # fp8: scale 1 (values exact); nvfp4: the calibrated global scale amax / (6 * 448), which
    # makes every block scale 448 and the values exact (with g = 1 the e4m3 block scale of 1/6
    # rounds to 0.171875 and 1.0 would come back as 1.03)
    scale = torch.tensor([1.0 / (6 * 448) if dtype == "nvfp4" else 1.0])
    for x, data, bs in ((kd, k, kbs), (vd, v, vbs)):
        qd, qb = formats.quantize(x, dtype, scale=scale)
        data[slots] = qd
        if bs is not None:
            bs[slots] = qb.reshape(bs[slots].shape)
    has_scale = dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4")
    view = LayerView(
        layer=0,
        dtype=dtype,
        page_size=page,
        num_kv_heads=1,
        head_dim=d,
        v_head_dim=d,
        k=k.to(device),
        v=v.to(device),
        k_block_scale=None if kbs is None else kbs.to(device),
        v_block_scale=None if vbs is None else vbs.to(device),
        k_scale=scale.to(device) if has_scale else None,
        v_scale=scale.to(device) if has_scale else None,
    )
    return view, torch.tensor([pt], dtype=torch.int32, device=device)


E = math.e
KVB16 = [
    (5, [1, 0, 0, 0], [0.5534573, 0.2976952, 0.2976952, 0.2976952]),
    (5, [0, 0, 0, 0], [0.4, 0.4, 0.4, 0.4]),
    (16, [1, 0, 0, 0], [(E + 1) / (E + 15), 2 / (E + 15), 2 / (E + 15), 2 / (E + 15)]),
    (17, [1, 0, 0, 0], [(E + 1) / (E + 16), 2 / (E + 16), 2 / (E + 16), 2 / (E + 16)]),
]


def check_kvb16(dtype, backend, device="cpu", what="decode"):
    for seq_len, qv, expect in KVB16:
        view, pt = kvb16_cache(dtype, seq_len, device)
        seq = torch.tensor([seq_len], dtype=torch.int32, device=device)
        qdt = torch.float32 if dtype == "fp32" else torch.bfloat16
        q = torch.zeros(1, 1, 64, dtype=qdt)
        q[0, 0, :4] = torch.tensor(qv, dtype=qdt)
        if what == "decode":
            out = attention.decode(view, q.to(device), pt, seq, sm_scale=1.0, backend=backend)
        else:  # the last token as a one-token extend
            cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
            out = attention.extend(view, q.to(device), cu, pt, seq, sm_scale=1.0, backend=backend)
        out = out.float().cpu()
        assert torch.isfinite(out).all(), (dtype, seq_len)
        tol = 1e-3 if dtype == "fp32" else 4e-3  # bf16 q and output: 2^-9 relative rounding
        assert out[0, 0, :4].tolist() == pytest.approx(expect, abs=tol), (dtype, seq_len, qv)
        assert out[0, 0, 4:].abs().max().item() == 0.0


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


# ----------------------------------------------------------------------------- CPU reference


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


# ----------------------------------------------------------------------------- validation


def test_errors_name_the_argument():
    cache = Cache("bf16", [4], heads=2, d=16, page=4)
    pt, sl = cache.page_table, cache.seq_lens
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="`q`"):
        attention.decode(cache.view, q[..., :8], pt, sl)
    with pytest.raises(ValueError, match="`q` has 3 heads"):
        attention.decode(cache.view, q[:, :3], pt, sl)
    with pytest.raises(ValueError, match="`page_table`"):
        attention.decode(cache.view, q, pt.long(), sl)
    with pytest.raises(ValueError, match="`seq_lens`"):
        attention.decode(cache.view, q, pt, torch.tensor([4, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="`window`"):
        attention.decode(cache.view, q, pt, sl, window=0)
    with pytest.raises(ValueError, match="`softcap`"):
        attention.decode(cache.view, q, pt, sl, softcap=-1.0)
    with pytest.raises(ValueError, match="`sinks`"):
        attention.decode(cache.view, q, pt, sl, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="`sm_scale`"):
        attention.decode(cache.view, q, pt, sl, sm_scale=float("nan"))
    with pytest.raises(ValueError, match="`backend`"):
        attention.decode(cache.view, q, pt, sl, backend="cuda")
    with pytest.raises(ValueError, match="`cu_seqlens_q`"):
        attention.extend(cache.view, q, torch.tensor([0, 1, 2], dtype=torch.int32), pt, sl)
    with pytest.raises(ValueError, match="`page_table` and `seq_lens` are required"):
        attention.decode(cache.view, q)


def test_reference_path_refuses_pages_outside_the_pool():
    """Found by the user review of 2026-11-29: on the torch path a page id of -1 wrapped to the
    pool's last rows silently, one past the end raised a bare IndexError from torch, and a
    seq_len beyond the page table did the same."""
    cache = Cache("bf16", [4], heads=2, d=16, page=4)  # 1 + 1 + 3 extra pages = 5 pages
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    assert cache.page_table.shape == (1, 3) and cache.view.k.shape[0] == 5 * 4
    for bad in (-1, 5, 1 << 30):
        pt = cache.page_table.clone()
        pt[0, 0] = bad
        for call in (
            lambda: attention.decode(cache.view, q, pt, cache.seq_lens, backend="torch"),
            lambda: attention.extend(cache.view, q, torch.tensor([0, 1], dtype=torch.int32), pt,
                                     cache.seq_lens, backend="torch"),
        ):
            with pytest.raises(ValueError, match=rf"`page_table\[0, 0\]` = {bad} is outside the "
                                                 r"pool's pages 0\.\.4"):
                call()
    pt = cache.page_table.clone()
    pt[0, 0] = 4  # the last page is fine
    attention.decode(cache.view, q, pt, cache.seq_lens, backend="torch")
    with pytest.raises(ValueError, match=r"`seq_lens\[0\]` = 13 exceeds the page table's 3 pages"):
        attention.decode(cache.view, q, cache.page_table, torch.tensor([13], dtype=torch.int32),
                         backend="torch")


# ----------------------------------------------------------------------------- Triton, interpreted

interpret = pytest.mark.interpret


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


# ----------------------------------------------------------------------------- GPU, real shapes

gpu = pytest.mark.gpu


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


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "nvfp4"])
def test_word_decode_needs_4_byte_rows(dtype):
    """The word-level decode loads K/V rows as int32 words: a view whose rows do not start on
    4-byte boundaries (sliced from a wider buffer) must take the byte-wise path in both plans,
    even when asked for the word path."""
    import dataclasses

    cache = Cache(dtype, [37, 5], heads=2, d=32)
    aligned = attention.plan_decode(cache.view, 4, cache.page_table, cache.seq_lens)
    assert aligned.asm  # the default for these dtypes

    def odd_rows(t):  # same bytes, rows 1 element (1 byte) apart from 4-byte alignment
        n, h, w = t.shape
        wide = torch.zeros(n, h * w + 1, dtype=torch.uint8)
        wide[:, : h * w] = t.view(torch.uint8).reshape(n, -1)
        return wide.as_strided((n, h, w), (h * w + 1, w, 1)).view(t.dtype)

    view = dataclasses.replace(cache.view, k=odd_rows(cache.view.k), v=odd_rows(cache.view.v))
    assert view.k.stride(0) % 4 and torch.equal(
        view.k.view(torch.uint8), cache.view.k.view(torch.uint8)
    )
    assert not attention.plan_decode(view, 4, cache.page_table, cache.seq_lens, asm=True).asm
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert not attention.plan_extend(view, 4, cu, cache.page_table, cache.seq_lens).asm
    assert not attention.plan_extend(view, 4, cu, cache.page_table, cache.seq_lens, asm=True).asm


# ----------------------------------------------------------------------------- decode plan defaults


def test_default_splits_wave_model(monkeypatch):
    """The split count minimizes waves x (tokens per split + half a tile); values by hand for
    132 multiprocessors: 3 programs per SM with 4 warps (396 slots), 12 with 1 warp (1,584)."""
    monkeypatch.setattr(attention.splits, "_num_sms", lambda device: 132)
    ds = attention.default_splits
    # 4 warps, B=64/8k, 128-token tiles: 512 programs. s=1: 2 waves x 8256 = 16512;
    # s=2: 3 waves x 4160 = 12480; s=3: chunk 2816 (ceil(8192/3)=2731 -> 22 tiles), 4 waves x
    # 2880 = 11520; s=4: 6 waves x 2112 = 12672: 3 wins
    assert ds(64, 8, 8192, "cpu", 128, 4) == 3
    # 1 warp, 32-token tiles: s=3 -> 1,536 programs, one wave x (2752 + 16) = 2768; s=4 -> 2,048
    # programs, 2 waves x (2048 + 16) = 4128; s=6: 2 waves x (1376 + 16) = 2784: 3 wins
    assert ds(64, 8, 8192, "cpu", 32, 1) == 3
    # B=16: 128 programs; s=12 -> 1,536 (one wave), chunk 704 -> 720; s=13 -> 1,664: 2 waves
    assert ds(16, 8, 8192, "cpu", 32, 1) == 12
    # latency-bound (<= 16 programs): 4 warps take the most splits, 128 of >= 256 tokens
    assert ds(1, 8, 32768, "cpu", 128, 4) == 128
    # 1 warp: about 2 * sqrt(B * H * n) programs. B=1/32k: 2 * sqrt(262,144) = 1,024 programs,
    # 128 splits of 256 tokens; B=1/8k: 512 programs, 64 splits of 128 tokens
    assert ds(1, 8, 32768, "cpu", 16, 1) == 128
    assert ds(1, 8, 8192, "cpu", 16, 1) == 64
    # B=1/128k: 2,048 programs (256 splits) exceed 12 x 132 = 1,584 slots: 198 splits, chunk
    # 16 * ceil(ceil(131072 / 198) / 16) = 672 tokens, so 196 splits (none empty); with 16 per
    # SM (2,112 slots) the 256 fit
    assert ds(1, 8, 131072, "cpu", 16, 1) == 196
    assert ds(1, 8, 131072, "cpu", 16, 1, 16) == 256
    # B=2/32k: 2 * sqrt(524,288) / 16 = 90.5 -> 90 splits, chunk 16 * ceil(365 / 16) = 368
    # tokens: 90 splits; with 32-token tiles chunk 384: 86 splits
    assert ds(2, 8, 32768, "cpu", 16, 1) == 90
    assert ds(2, 8, 32768, "cpu", 32, 1) == 86
    # short requests: at most n // 128 splits (1000 tokens: 7 of 144 tokens), at least 1
    assert ds(1, 8, 1000, "cpu", 16, 1) == 7
    assert ds(1, 8, 100, "cpu", 16, 1) == 1
    # fp8 one-warp ring (16-token tiles, 3 stages, 128 registers): 16 programs per SM = 2,112
    # slots. B=64/8k, 512 programs: s=3 -> 1,536 programs, chunk 2736 (171 tiles), one wave x
    # (2736 + 8) = 2744; s=4 -> 2,048 programs, one wave x (2048 + 8) = 2056; s=5 -> 2,560, two
    # waves x (1648 + 8); s=8 -> 4,096, two waves x 1032 = 2064: 4 wins
    assert ds(64, 8, 8192, "cpu", 16, 1, 16) == 4
    assert ds(64, 8, 8192, "cpu", 16, 1) == 3  # 12 per SM: s=4 would be 1.3 waves
    # the Gluon kernel's model: 16 per SM (2,112 slots) and 256 tokens per program besides its
    # own. B=64/8k: s=3 one wave x (2736 + 256) = 2992; s=4 (2,048 programs) one wave x (2048 +
    # 256) = 2304; s=5 (2,560) two x 1904; s=8 two x 1280 = 2560: 4. B=128/8k (1,024 per split):
    # s=1 8448; s=2 one wave x 4352; s=3 two x 2992; s=4 two x 2304 = 4608: 2. B=16/8k: s=16
    # (2,048) 512 + 256 = 768; s=17 (2,176) two waves: 16
    assert ds(64, 8, 8192, "cpu", 16, 1, 16, 256) == 4
    assert ds(128, 8, 8192, "cpu", 16, 1, 16, 256) == 2
    assert ds(16, 8, 8192, "cpu", 16, 1, 16, 256) == 16
    assert ds(32, 8, 8192, "cpu", 16, 1, 16, 256) == 8
    # its model since run 8 (head-fast grid): 12 per SM (1,584 slots). B=64/8k: s=2 one wave x
    # (4096 + 256) = 4352; s=3 (1,536) one wave x (2736 + 256) = 2992; s=4 (2,048) two x 2304 =
    # 4608; s=6 two x (1376 + 256) = 3264: 3. B=128/8k: s=1 8448; s=2 (2,048) two x 4352;
    # s=3 (3,072) two x 2992 = 5984; s=4 three x 2304 = 6912; s=6 four x 1632 = 6528: 3
    assert ds(64, 8, 8192, "cpu", 16, 1, 12, 256) == 3
    assert ds(128, 8, 8192, "cpu", 16, 1, 12, 256) == 3


@pytest.mark.parametrize(
    "dtype, d, b, expect",
    [
        # (num_warps, block_n, swap, group_pad)
        ("fp8_e4m3", 128, 64, (1, 16, True, 4)),  # 16-token tiles, 3 stages (run 7)
        ("fp8_e5m2", 128, 64, (1, 16, True, 4)),
        ("fp8_e4m3", 128, 1, (1, 16, True, 4)),
        ("nvfp4", 128, 64, (1, 32, False, 16)),
        ("fp4_mx_block16", 64, 64, (1, 32, False, 16)),
        ("bf16", 128, 64, (4, 64, True, 4)),
        ("fp32", 128, 64, (4, 64, False, 16)),
        ("fp8_e4m3", 256, 64, (4, 64, True, 4)),  # wide heads keep 4-warp tiles
        ("nvfp4", 256, 64, (4, 64, False, 16)),
        ("nvfp4", 1024, 64, (4, 32, False, 16)),  # FP4 tiles never shorter than 32 tokens
    ],
)
def test_plan_decode_defaults(dtype, d, b, expect):
    cache = Cache(dtype, [5] * b, heads=8, d=d, page=16)
    plan = attention.plan_decode(cache.view, 32, cache.page_table, cache.seq_lens)
    assert (plan.num_warps, plan.block_n, plan.swap, plan.group_pad) == expect
    assert plan.asm == (dtype not in ("bf16", "fp32"))
    assert plan.maxnreg is None
    one_warp_fp8 = dtype.startswith("fp8") and plan.num_warps == 1
    assert plan.num_stages == (3 if one_warp_fp8 else 2)


def test_plan_decode_knobs_and_errors():
    cache = Cache("fp8_e4m3", [5, 9], heads=2, d=32, page=16)
    pt, sl = cache.page_table, cache.seq_lens
    # an explicit 4-warp plan keeps the 4-warp tiles; prefetch and no-dot plans too
    p4 = attention.plan_decode(cache.view, 8, pt, sl, num_warps=4)
    assert (p4.num_warps, p4.block_n) == (4, 128)
    assert attention.plan_decode(cache.view, 8, pt, sl, prefetch=True).num_warps == 4
    assert attention.plan_decode(cache.view, 8, pt, sl, use_dot=False).num_warps == 4
    p = attention.plan_decode(cache.view, 8, pt, sl, swap=True, group_pad=16, maxnreg=128)
    assert (p.group_pad, p.maxnreg) == (16, 128)
    with pytest.raises(ValueError, match="`group_pad` = 2"):
        attention.plan_decode(cache.view, 8, pt, sl, group_pad=2)
    with pytest.raises(ValueError, match="`group_pad` = 12"):
        attention.plan_decode(cache.view, 8, pt, sl, group_pad=12)
    # a plan padded for a group of 4 cannot serve a group of 8 (16 query heads, same cache)
    q = torch.zeros(2, 16, 32, dtype=torch.bfloat16)
    p8 = attention.plan_decode(cache.view, 16, pt, sl)
    p8.group_pad = 4
    with pytest.raises(ValueError, match="pads the query group to 4 rows, the group is 8"):
        attention.decode(cache.view, q, plan=p8, backend="triton")


def test_fp4_tiles_of_16_tokens_refused_on_the_gpu(monkeypatch):
    """16-token FP4 tiles were miscompiled on the H200 (run 6): refused on CUDA, allowed in the
    CPU interpreter (where they are exact) and for every other dtype."""
    from types import SimpleNamespace

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gpu_view = SimpleNamespace(dtype="nvfp4", k=SimpleNamespace(is_cuda=True))
    with pytest.raises(ValueError, match="`block_n` = 16: nvfp4 caches need KV tiles of at least"):
        attention._check_fp4_tile(gpu_view, 16)
    attention._check_fp4_tile(gpu_view, 32)
    attention._check_fp4_tile(SimpleNamespace(dtype="fp8_e4m3", k=gpu_view.k), 16)
    attention._check_fp4_tile(SimpleNamespace(dtype="nvfp4", k=SimpleNamespace(is_cuda=False)), 16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    attention._check_fp4_tile(gpu_view, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["nvfp4", "fp4_mx_block16"])
def test_fp4_tiles_of_16_tokens_refused_gpu(dtype):
    cache = Cache(dtype, [5, 40], heads=2, d=64, page=16, device="cuda")
    pt, sl = cache.page_table, cache.seq_lens
    with pytest.raises(ValueError, match="`block_n` = 16"):
        attention.plan_decode(cache.view, 8, pt, sl, block_n=16)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="`block_n` = 16"):
        attention.plan_extend(cache.view, 8, cu, pt, sl, block_n=16)
    out, ref = run_decode(cache, 8, backend="triton", device="cuda", plan_kw={"block_n": 32})
    assert rel_err(out, ref) < TOL[dtype]


# ----------------------------------------------------------------------------- plan knobs (review)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"group_pad": 0}, "`group_pad` = 0: must be a power of two >= 4 (the query group is 4)"),
        ({"group_pad": -4}, "`group_pad` = -4: must be a power of two >= 4"),
        ({"group_pad": 12}, "`group_pad` = 12: must be a power of two >= 4"),
        ({"group_pad": 16.0}, "`group_pad` = 16.0: must be an int"),
        ({"group_pad": "16"}, "`group_pad` = '16': must be an int"),
        ({"group_pad": True}, "`group_pad` = True: must be an int"),
        ({"maxnreg": 0}, "`maxnreg` = 0: must be an int in 24..255"),
        ({"maxnreg": -1}, "`maxnreg` = -1: must be an int in 24..255"),
        ({"maxnreg": 23}, "`maxnreg` = 23: must be an int in 24..255"),
        ({"maxnreg": 256}, "`maxnreg` = 256: must be an int in 24..255"),
        ({"maxnreg": True}, "`maxnreg` = True: must be an int"),
        ({"maxnreg": 128.7}, "`maxnreg` = 128.7: must be an int"),
        ({"maxnreg": "x"}, "`maxnreg` = 'x': must be an int"),
        ({"num_warps": 0}, "`num_warps` = 0: must be a power of two in 1..32"),
        ({"num_warps": 3}, "`num_warps` = 3: must be a power of two in 1..32"),
        ({"num_warps": 64}, "`num_warps` = 64: must be a power of two in 1..32"),
        ({"num_warps": True}, "`num_warps` = True: must be an int"),
        ({"block_n": 32.0}, "`block_n` = 32.0: must be an int"),
        ({"block_n": 24}, "`block_n` = 24: must be a power of two >= 16"),
        ({"block_n": 0}, "`block_n` = 0: must be a power of two >= 16"),
        ({"num_splits": 0}, "`num_splits` = 0: must be an int in 1..1024"),
        ({"num_splits": 2.5}, "`num_splits` = 2.5: must be an int"),
        ({"num_stages": 0}, "`num_stages` = 0: must be an int >= 1"),
        ({"num_splits": 1025}, "`num_splits` = 1025: must be an int in 1..1024"),
    ],
)
def test_plan_decode_rejects_bad_knobs(kw, msg):
    cache = Cache("fp8_e4m3", [5, 9], heads=2, d=32, page=16)
    with pytest.raises(ValueError, match=re.escape(msg)):
        attention.plan_decode(cache.view, 8, cache.page_table, cache.seq_lens, **kw)


@pytest.mark.parametrize(
    "q_heads, pad, limit",
    [
        (8, 512, 256),  # a group of 8 (one KV head): 256 rows is the bound
        (8, 1 << 40, 256),
        (512, 1024, 512),  # a group of 512 (one KV head) may only be padded to itself
    ],
)
def test_plan_decode_group_pad_has_an_upper_bound(q_heads, pad, limit, monkeypatch):
    """`group_pad` had no upper bound: 2^40 rows passed the plan and failed (or spilled) in the
    compiler. Past 256 rows (four 64-row warpgroup tiles) the rows are padding; a group larger
    than that keeps its own power of two. The refusal comes before the split workspaces."""
    cache = Cache("fp8_e4m3", [5, 9], heads=1, d=32, page=16)
    pt, sl = cache.page_table, cache.seq_lens
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    msg = f"`group_pad` = {pad}: must be at most {limit} (the query group is {q_heads}"
    with pytest.raises(ValueError, match=re.escape(msg)):
        attention.plan_decode(cache.view, q_heads, pt, sl, num_splits=4, group_pad=pad)
    assert allocated == [] and attention.GROUP_PAD_MAX == 256
    # the bound itself is accepted (and allocates the workspaces), as is the default
    p = attention.plan_decode(cache.view, q_heads, pt, sl, num_splits=4, group_pad=limit)
    assert p.group_pad == limit and len(allocated) == 2
    # fp8 defaults to transposed dots: the group's own power of two, also past 256
    assert attention.plan_decode(cache.view, q_heads, pt, sl).group_pad == q_heads


def test_plan_decode_knobs_accepted_as_exact_ints():
    np = pytest.importorskip("numpy")
    cache = Cache("fp8_e4m3", [5, 9], heads=2, d=32, page=16)
    pt, sl = cache.page_table, cache.seq_lens
    for cap in (24, 127, 255):  # odd caps are legal for ptxas
        assert attention.plan_decode(cache.view, 8, pt, sl, maxnreg=cap).maxnreg == cap
    p = attention.plan_decode(
        cache.view, 8, pt, sl, maxnreg=np.int64(128), group_pad=np.int32(8), block_n=np.int64(32)
    )
    assert (p.maxnreg, p.group_pad, p.block_n) == (128, 8, 32)
    assert all(type(x) is int for x in (p.maxnreg, p.group_pad, p.block_n))
    # group 1 (8 query heads over 8 KV heads): 1 is a legal pad, True is not
    c1 = Cache("fp8_e4m3", [5, 9], heads=8, d=32, page=16)
    assert attention.plan_decode(c1.view, 8, c1.page_table, c1.seq_lens, group_pad=1).group_pad == 1
    with pytest.raises(ValueError, match="`group_pad` = True: must be an int"):
        attention.plan_decode(c1.view, 8, c1.page_table, c1.seq_lens, group_pad=True)


def test_plan_decode_one_warp_needs_the_word_decode_it_will_run():
    """asm=True where the word decode does not apply (bf16; fp8 rows off 4-byte boundaries) runs
    the byte path, so the plan keeps the 4-warp tiles of that path: bf16 64 tokens
    (use_dot, no asm), fp8 128 tokens."""
    import dataclasses

    cb = Cache("bf16", [5, 9], heads=2, d=32, page=16)
    p = attention.plan_decode(cb.view, 8, cb.page_table, cb.seq_lens, asm=True)
    assert (p.asm, p.num_warps, p.block_n) == (False, 4, 64)
    c8 = Cache("fp8_e4m3", [5, 9], heads=2, d=32, page=16)
    n, h, w = c8.view.k.shape
    wide = torch.zeros(n, h * w + 1, dtype=torch.uint8)
    odd = wide.as_strided((n, h, w), (h * w + 1, w, 1)).view(torch.float8_e4m3fn)
    view = dataclasses.replace(c8.view, k=odd, v=odd)
    p = attention.plan_decode(view, 8, c8.page_table, c8.seq_lens, asm=True)
    assert (p.asm, p.num_warps, p.block_n) == (False, 4, 128)
    # explicit num_warps=1 with prefetch or without dots: one warp, the tile of that path
    p = attention.plan_decode(c8.view, 8, c8.page_table, c8.seq_lens, num_warps=1, prefetch=True)
    assert (p.num_warps, p.block_n, p.swap, p.group_pad) == (1, 128, False, 16)
    p = attention.plan_decode(c8.view, 8, c8.page_table, c8.seq_lens, num_warps=1, use_dot=False)
    assert (p.num_warps, p.block_n, p.asm, p.group_pad) == (1, 32, False, 4)


def test_plan_decode_gluon_choice(monkeypatch):
    """Where the Gluon kernel is chosen, and the errors of ``gluon=``; the kernel itself needs a
    GPU (test_decode_gpu_gluon), the choice is planned on the host."""
    c8 = Cache("fp8_e4m3", [2100] * 4, heads=8, d=128, page=16)
    pt, sl = c8.page_table, c8.seq_lens
    # on the CPU: never by default; gluon=True names why
    assert not attention.plan_decode(c8.view, 32, pt, sl).gluon
    with pytest.raises(ValueError, match="`gluon=True`: the Gluon decode kernel does not run a "
                                         "CPU tensor"):
        attention.plan_decode(c8.view, 32, pt, sl, gluon=True)
    with pytest.raises(ValueError, match="`gluon` = 'yes': must be a bool or None"):
        attention.plan_decode(c8.view, 32, pt, sl, gluon="yes")
    assert "bf16 caches" in attention._gluon_unfit(Cache("bf16", [4], heads=8, d=128).view, 4)
    # as if on a GPU that fits: 4 requests x 8 KV heads = 32 programs > 16 -> Gluon, 16-token
    # tiles, splits from the wave model with 12 programs per SM
    monkeypatch.setattr(attention.plans, "_gluon_unfit", lambda view, group: None)
    monkeypatch.setattr(attention.splits, "_num_sms", lambda device: 132)
    p = attention.plan_decode(c8.view, 32, pt, sl)
    assert (p.gluon, p.block_n, p.num_warps) == (True, 16, 1)
    # the page table's capacity (134 pages, 2,144 tokens) bounds the longest request; 32 programs
    # per split never fill the 1,584 slots, so the cost is one wave x (chunk + 256): chunk
    # 16 * ceil(ceil(2144 / s) / 16) is 144 tokens at s=15 and 16, 160 at s=14: 15 (fewest on ties)
    assert pt.shape[1] == 134 and p.num_splits == 15
    # shorter than 2,048 tokens: the Triton kernel (no gain at 1k on the H200)
    assert not attention.plan_decode(c8.view, 32, pt, sl, max_seq_len=1024).gluon
    p = attention.plan_decode(c8.view, 32, pt, sl, num_splits=3)
    assert p.gluon and p.part_out.shape == (4, 32, 3, 128) and p.part_lse.shape == (4, 32, 3)
    assert (p.prefetch, p.num_stages) == (False, 3)  # e4m3: the 3-stage cp.async ring
    c5 = Cache("fp8_e5m2", [2100] * 4, heads=8, d=128, page=16)
    p5 = attention.plan_decode(c5.view, 32, c5.page_table, c5.seq_lens)
    assert p5.gluon and (p5.prefetch, p5.num_stages) == (False, 3)  # e5m2: the ring too (run 8)
    assert p5.num_splits == 15  # 12 per SM (1,584 slots): still one wave, the same 15
    c4 = Cache("nvfp4", [2100] * 4, heads=8, d=128, page=16)
    p4 = attention.plan_decode(c4.view, 32, c4.page_table, c4.seq_lens)
    # nvfp4: decode_gluon_fp4's 2-stage ring of two 16-token tiles a stage (block_n 32), 12 per
    # SM in the split model as e5m2's
    assert p4.gluon and (p4.prefetch, p4.num_stages, p4.block_n) == (False, 2, 32)
    # B=1/32k: 128 splits (2 * sqrt(8 * 32768) = 1,024 programs), two tiles a stage
    c32 = Cache("nvfp4", [32768], heads=8, d=128, page=16)
    p32 = attention.plan_decode(c32.view, 32, c32.page_table, c32.seq_lens, max_seq_len=32768)
    assert (p32.num_splits, p32.block_n) == (128, 32)
    # one tile a stage where only that fits the grid in one wave: 8 heads x 256 splits = 2,048
    # programs, more than 14 x 132 (two tiles a stage), at most 16 x 132 (one)
    assert attention.plan_decode(c32.view, 32, c32.page_table, c32.seq_lens,
                                 num_splits=256).block_n == 16
    assert attention.plan_decode(c32.view, 32, c32.page_table, c32.seq_lens, max_seq_len=32768,
                                 num_splits=200).block_n == 32  # 1,600 programs: one wave
    assert attention.plan_decode(c4.view, 32, c4.page_table, c4.seq_lens,
                                 num_splits=100).block_n == 32  # 3,200: two waves either way
    # the bounds: 14 x 132 = 1,848 programs (231 splits) two tiles, 2,112 (264) one, 2,120 two
    for splits, bn in ((231, 32), (232, 16), (264, 16), (265, 32)):
        assert attention.plan_decode(c32.view, 32, c32.page_table, c32.seq_lens,
                                     num_splits=splits).block_n == bn, splits
    # with two tiles a stage the splits are planned in 32-token stages: 2,144 tokens of capacity
    # in one wave, the cost is chunk + 256 with chunk = 32 * ceil(ceil(2144 / s) / 32): 160
    # tokens from s = 14 on (16 splits at most): 14 splits
    assert p4.num_splits == 14
    # and at any batch and context (faster than the Triton kernel at B=1..4 x 1k..32k)
    one = attention.plan_decode(c4.view, 32, c4.page_table[:1], c4.seq_lens[:1], max_seq_len=1024)
    assert one.gluon and not attention.plan_decode(c8.view, 32, pt[:1], sl[:1]).gluon
    # two requests x 8 heads = 16 programs: latency-bound, the Triton kernel
    assert not attention.plan_decode(c8.view, 32, pt[:2], sl[:2]).gluon
    # a Triton knob keeps the Triton kernel; with gluon=True it is refused by name
    assert not attention.plan_decode(c8.view, 32, pt, sl, block_n=32).gluon
    with pytest.raises(ValueError, match="takes no Triton kernel options, got block_n, swap"):
        attention.plan_decode(c8.view, 32, pt, sl, gluon=True, block_n=32, swap=True)
    assert attention.plan_decode(c8.view, 32, pt, sl, gluon=True, num_splits=5).num_splits == 5


def _misaligned(t, offset=4, pad=0):
    """A copy of ``t`` ``[R, H, D]`` whose data starts ``offset`` bytes past a 16-byte boundary
    and whose rows are ``pad`` bytes longer than ``H * D`` (a view sliced from a larger buffer)."""
    r, h, d = t.shape
    buf = torch.zeros(r * (h * d + pad) + 64, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 16 + offset
    rows = buf[start : start + r * (h * d + pad)].view(r, h * d + pad)[:, : h * d]
    out = rows.view(t.dtype).view(r, h, d)
    out.copy_(t)
    return out


def test_gluon_unfit_layout_checks():
    """The layout checks of the Gluon kernel run (and name the value) on any device; the device
    check comes last (on the CPU: 'a CPU tensor')."""
    import dataclasses

    v = Cache("fp8_e4m3", [40] * 2, heads=8, d=128, page=16).view
    assert attention._gluon_unfit(v, 4).startswith("a CPU tensor")
    assert attention._gluon_unfit(v, 17) == "a query group of 17 heads (1..16 only at head_dim 128)"
    assert attention._gluon_unfit(v, 0) == "a query group of 0 heads (1..16 only at head_dim 128)"
    v32 = Cache("fp8_e5m2", [40] * 2, heads=2, d=32, page=16).view
    assert attention._gluon_unfit(v32, 4) == (
        "head_dim 32 / v_head_dim 32 (64, 128 or 256, K and V alike)"
    )
    bad = dataclasses.replace(v, v=_misaligned(v.v, offset=4))
    assert bad.v.data_ptr() % 16 == 4
    assert torch.equal(bad.v.view(torch.uint8), v.v.view(torch.uint8))
    why = attention._gluon_unfit(bad, 4)
    assert why.startswith("K/V rows not 16-byte aligned") and "mod 16 = 4" in why
    padded = dataclasses.replace(v, k=_misaligned(v.k, offset=0, pad=8))
    assert padded.k.stride() == (8 * 128 + 8, 128, 1)
    assert "strides (1032, 128, 1)" in attention._gluon_unfit(padded, 4)
    # 4-byte aligned rows still suit the Triton kernel's word reads, not the Gluon kernel
    assert attention._asm_ok(bad)


def test_gluon_unfit_nvfp4_layout_checks():
    """nvfp4 and fp4_mx_block16 caches suit the Gluon kernel (decode_gluon_fp4.py) up to the
    device check; its 64-byte head rows must be 16-byte aligned and the block scales 2-byte
    aligned with a head's 8 bytes contiguous; other dtypes are refused by name."""
    import dataclasses

    v = Cache("nvfp4", [40] * 2, heads=8, d=128, page=16).view
    assert v.k_block_scale.shape == (v.k.shape[0], 8, 8)
    assert attention._gluon_unfit(v, 4).startswith("a CPU tensor")
    mx = Cache("fp4_mx_block16", [40] * 2, heads=8, d=128, page=16).view
    assert mx.k_block_scale.shape == (mx.k.shape[0], 64)  # [R, H * 8] rows suit it too
    assert attention._gluon_unfit(mx, 4).startswith("a CPU tensor")
    fp32 = Cache("fp32", [40] * 2, heads=8, d=128, page=16).view
    assert attention._gluon_unfit(fp32, 4) == (
        "fp32 caches (fp8_e4m3, fp8_e5m2, nvfp4, fp4_mx_block16 only)"
    )
    padded = dataclasses.replace(v, k=_misaligned(v.k, offset=0, pad=8))
    assert padded.k.stride() == (8 * 64 + 8, 64, 1)
    assert "a head's 64 bytes not contiguous" in attention._gluon_unfit(padded, 4)
    assert "strides (520, 64, 1)" in attention._gluon_unfit(padded, 4)
    odd = dataclasses.replace(v, v_block_scale=_misaligned(v.v_block_scale, offset=1))
    assert odd.v_block_scale.data_ptr() % 2 == 1
    why = attention._gluon_unfit(odd, 4)
    assert why.startswith("block scale rows not 2-byte aligned") and "strides (64, 8, 1)" in why
    # 16-byte aligned rows of 16 extra bytes are fine (a sliced pool)
    wide = dataclasses.replace(v, k=_misaligned(v.k, offset=0, pad=16))
    assert attention._gluon_unfit(wide, 4).startswith("a CPU tensor")


def test_gluon_device_checks(monkeypatch):
    """The device half of the Gluon checks, as on a CUDA machine: NVIDIA sm_89+, no interpreter,
    and a Triton release the kernel was checked with (3.9 removed the cp.async call it uses)."""
    import triton

    dev = torch.device("cuda", 0)

    def unfit(device=dev):  # the CUDA half is cached per GPU: clear it for each setting
        attention._gluon_cuda_unfit.cache_clear()
        return attention._gluon_device_unfit(device)

    monkeypatch.setattr(attention.variants, "_interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert unfit() is None
    monkeypatch.setattr(triton, "__version__", "3.9.1")
    assert unfit() == "Triton 3.9.1 (checked with Triton 3.6 only)"
    monkeypatch.setattr(triton, "__version__", "3.6.0+git1234")
    assert unfit() is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert unfit() == "a GPU older than compute capability 8.9"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    assert unfit() == "a ROCm GPU (the kernel is NVIDIA PTX)"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention.variants, "_interpreting", lambda: True)
    assert unfit().startswith("a CPU tensor or the Triton interpreter")
    assert unfit(torch.device("cpu")).startswith("a CPU tensor")
    attention._gluon_cuda_unfit.cache_clear()  # leave no answer from the patched settings


def test_decode_gluon_plan_refusals(monkeypatch):
    """A Gluon plan (made as if on a GPU that fits) launched on a layer or batch it cannot run:
    a ValueError naming why, before any launch, ``out`` untouched."""
    import dataclasses

    c = Cache("fp8_e4m3", [40, 17, 3, 33], heads=8, d=128, page=16)
    monkeypatch.setattr(attention.variants, "_gluon_device_unfit", lambda device: None)
    plan = attention.plan_decode(c.view, 32, c.page_table, c.seq_lens, gluon=True, num_splits=2)
    assert plan.gluon and plan.part_out.shape == (4, 32, 2, 128)
    q = torch.randn(4, 32, 128, dtype=torch.float16)
    out = torch.full((4, 32, 128), 7.0, dtype=torch.float16)

    def refused(match, view=c.view, q=q, **kw):
        with pytest.raises(ValueError, match=match):
            attention.decode(view, q, plan=plan, out=kw.pop("out", out), backend="triton", **kw)
        assert bool((out == 7.0).all())

    # misaligned V rows (a view sliced at 4 bytes): the kernel's 128-bit reads would fault
    bad = dataclasses.replace(c.view, v=_misaligned(c.view.v, offset=4))
    refused(r"uses the Gluon kernel, which does not run K/V rows not 16-byte aligned", bad)
    with pytest.raises(ValueError, match=r"`gluon=True`: .* K/V rows not 16-byte aligned"):
        attention.plan_decode(bad, 32, c.page_table, c.seq_lens, gluon=True)
    # the same 32 query heads over 2 KV heads (a group of 16) with the wide geometries off
    c2 = Cache("fp8_e4m3", [40, 17, 3, 33], heads=2, d=128, page=16)
    monkeypatch.setenv("KVPOOL_GLUON_WIDE", "0")
    refused(r"which does not run head_dim 128 with a group of 16 while KVPOOL_GLUON_WIDE=0", c2.view)
    monkeypatch.delenv("KVPOOL_GLUON_WIDE")
    # a bf16 layer of the same geometry
    cb = Cache("bf16", [40, 17, 3, 33], heads=8, d=128, page=16)
    refused("which does not run bf16 caches", cb.view, q=q.bfloat16(), out=out.bfloat16())
    # unit inner strides the kernels assume (no stride argument): refused, not mis-indexed
    out_t = torch.full((4, 128, 32), 7.0, dtype=torch.float16).transpose(1, 2)
    refused(r"`out` must be contiguous in its last dim \(strides \(4096, 1, 32\)\)", out=out_t)
    pt_t = c.page_table.t().contiguous().t()
    assert torch.equal(pt_t, c.page_table) and pt_t.stride(1) != 1
    refused("`page_table` must be contiguous in its last dim", page_table=pt_t)
    sl2 = torch.stack([c.seq_lens, c.seq_lens], 1)[:, 0]
    refused(r"`seq_lens` must be contiguous in its last dim \(strides \(2,\)\)", seq_lens=sl2)
    # without a plan (the Triton kernel's path) the same checks apply
    with pytest.raises(ValueError, match="`page_table` must be contiguous in its last dim"):
        attention.decode(c.view, q, pt_t, c.seq_lens, backend="triton")
    # the torch backend reads any layout: the strided page table gives the reference answer
    ref = attention.decode(c.view, q, c.page_table, c.seq_lens, backend="torch")
    got = attention.decode(c.view, q, pt_t, sl2, backend="torch")
    assert torch.equal(got, ref)


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


def _pretend_gpu(monkeypatch):
    """Run the FP4 tile guard as if the view were on CUDA (the check raises before any launch)."""
    from types import SimpleNamespace

    real = attention._check_fp4_tile
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    def guard(view, bn):
        return real(SimpleNamespace(dtype=view.dtype, k=SimpleNamespace(is_cuda=True)), bn)

    # (each launcher holds the guard: patch it where decode and extend call it)
    monkeypatch.setattr(attention.launch_decode, "_check_fp4_tile", guard)
    monkeypatch.setattr(attention.launch_extend, "_check_fp4_tile", guard)


def test_reused_plan_with_16_token_tiles_refused_for_fp4_at_launch(monkeypatch):
    """A plan is shared by every layer: one made on an fp8 layer (B=1: 16-token tiles by default)
    must not launch 16-token tiles on an FP4 layer of the same geometry; nor an extend plan.
    The output buffer is left untouched."""
    c8 = Cache("fp8_e4m3", [40], heads=2, d=32, page=16)
    c4 = Cache("nvfp4", [40], heads=2, d=32, page=16, seed=3)
    plan = attention.plan_decode(c8.view, 8, c8.page_table, c8.seq_lens)
    assert plan.block_n == 16
    _pretend_gpu(monkeypatch)
    q = torch.randn(1, 8, 32).to(torch.bfloat16)
    out = torch.full((1, 8, 32), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="`block_n` = 16: nvfp4 caches need KV tiles of at least"):
        attention.decode(c4.view, q, plan=plan, backend="triton", out=out)
    assert bool((out == 7).all())
    cu = torch.tensor([0, 1], dtype=torch.int32)
    ep = attention.plan_extend(c8.view, 8, cu, c8.page_table, c8.seq_lens, block_n=16)
    with pytest.raises(ValueError, match="`block_n` = 16: nvfp4 caches need KV tiles of at least"):
        attention.extend(c4.view, q[0:1], plan=ep, backend="triton", out=out)
    assert bool((out == 7).all())


def test_reused_plan_split_workspace_must_match_the_view():
    """The split workspace is sized by the planning view's v_head_dim: a view with wider V heads
    would write past it, so decode refuses (naming both shapes) and leaves ``out`` untouched."""
    small = Cache("bf16", [40, 9], heads=2, d=32, page=16)
    wide = Cache("bf16", [40, 9], heads=2, d=32, dv=64, page=16, seed=4)
    plan = attention.plan_decode(small.view, 4, small.page_table, small.seq_lens, num_splits=2)
    assert tuple(plan.part_out.shape) == (2, 4, 2, 32)
    q = torch.randn(2, 4, 32).to(torch.bfloat16)
    out = torch.full((2, 4, 64), 7.0, dtype=torch.bfloat16)
    msg = "`plan` split workspace is (2, 4, 2, 32), this batch needs (2, 4, 2, 64) on cpu"
    with pytest.raises(ValueError, match=re.escape(msg)):
        attention.decode(wide.view, q, plan=plan, backend="triton", out=out)
    assert bool((out == 7).all())
    plan.part_out = None  # a mutated plan: no workspace for its splits
    with pytest.raises(ValueError, match=re.escape("`plan` split workspace is None")):
        attention.decode(small.view, q, plan=plan, backend="triton")


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


# ----------------------------------------------------------------------------- API attack fixes:
# cu_seqlens_q values, option types, the padding page (review of the attention API)


def _i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


def _attack_cache():
    """bf16, 2 KV heads, head_dim 16, page_size 4, one request of 8 tokens on 2 pages."""
    return Cache("bf16", [8], heads=2, d=16, page=4)


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


NOT_NUMBERS = [True, False, "x", "1.0", None, torch.tensor(1.0), [1.0], 1j]


@pytest.mark.parametrize("what", ["decode", "extend"])
@pytest.mark.parametrize(
    "kw, msg",
    [
        *[({"sm_scale": v}, f"`sm_scale` = {v!r}: must be") for v in NOT_NUMBERS if v is not None],
        *[({"softcap": v}, f"`softcap` = {v!r}: must be") for v in NOT_NUMBERS if v is not None],
        *[
            ({k: v}, f"`{k}` = {v!r}: must be finite and > 0")
            for k in ("sm_scale", "softcap")
            for v in (float("nan"), float("inf"), -float("inf"), 0.0, -1, 10**400)
        ],
        *[
            ({"window": v}, f"`window` = {v!r}: must be an int >= 1")
            for v in (True, False, float("nan"), float("inf"), 4.0, "4", 0, -3)
        ],
    ],
)
def test_options_refuse_bools_strings_and_non_finite_values(what, kw, msg):
    """Before: window=True raised a torch NotImplementedError, NaN/Inf windows "cannot convert
    float NaN to integer"/OverflowError, sm_scale/softcap "x" an unnamed float() error, and
    sm_scale=True / softcap=True passed as 1.0."""
    c = _attack_cache()
    q = torch.randn(1, 4, 16).to(torch.bfloat16)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=re.escape(msg)):
            if what == "decode":
                attention.decode(c.view, q, c.page_table, c.seq_lens, backend=backend, **kw)
            else:
                attention.extend(
                    c.view, q, _i32(0, 1), c.page_table, c.seq_lens, backend=backend, **kw
                )


def test_options_accept_numpy_scalars_and_huge_windows():
    np = pytest.importorskip("numpy")
    c = _attack_cache()
    q = torch.randn(1, 4, 16).to(torch.bfloat16)
    ref = attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.25, window=4,
                           softcap=30.0)
    for sm, win, cap in [(np.float32(0.25), np.int64(4), np.float64(30.0)),
                         (np.float64(0.25), np.int32(4), np.int64(30)), (0.25, 4, 30)]:
        got = attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=sm, window=win,
                               softcap=cap)
        assert torch.equal(got, ref)
        got = attention.extend(c.view, q, _i32(0, 1), c.page_table, c.seq_lens, sm_scale=sm,
                               window=win, softcap=cap)
        assert torch.equal(got, ref)
    # a window longer than any sequence (beyond int32) is no window
    full = attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.25)
    for win in (8, 1 << 40, np.int64(1 << 62)):
        assert torch.equal(
            attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.25, window=win), full
        )
    assert attention._check_options(1 << 40, np.float32(2), None, 4, "cpu") == ((1 << 31) - 1, 2.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton on CPU: checked before launch
def test_bad_page_ids_refused_padding_page_allowed(backend):
    """Ids outside the pool's pages are refused before any read (the torch path indexed out of
    range, or read wrong rows for negative ids). Page 0, the padding page, is allowed: the
    padded requests of a fixed-size batch (a CUDA graph's) point at it; what it holds is
    garbage. Ids past a request's seq_len are never read, so anything goes there."""
    c = _attack_cache()  # 1 + 2 + 3 extra pages = 6 pages
    assert c.view.k.shape[0] == 6 * 4
    q = torch.randn(1, 4, 16).to(torch.bfloat16)
    sl = _i32(8)
    cu = _i32(0, 1)
    for row, bad, msg in [
        ([1, -1], (0, 1), r"`page_table\[0, 1\]` = -1 is outside the pool's pages 0\.\.5 "
                          r"\(request 0, seq_len 8\)"),
        ([6, 2], (0, 0), r"`page_table\[0, 0\]` = 6 is outside the pool's pages 0\.\.5"),
    ]:
        pt = _i32(*row, 0, -5).reshape(1, 4)
        out = torch.full((1, 4, 16), 7.0, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=msg):
            attention.decode(c.view, q, pt, sl, backend=backend, out=out)
        with pytest.raises(ValueError, match=msg):
            attention.extend(c.view, q, cu, pt, sl, backend=backend, out=out)
        assert bool((out == 7).all()), bad
    if backend == "torch":
        with pytest.raises(ValueError, match="is outside the pool's pages"):
            attention.reference_decode(c.view, q, _i32(1, -2).reshape(1, 2), sl)
        with pytest.raises(ValueError, match="is outside the pool's pages"):
            attention.reference_extend(c.view, q, cu, _i32(9, 2).reshape(1, 2), sl)
        # a padded request: seq_len 1 on the padding page; a real one beside it is exact
        c2 = Cache("bf16", [8], heads=2, d=16, page=4)
        q2 = torch.randn(2, 4, 16).to(torch.bfloat16)
        pt2 = torch.cat([c2.page_table[:, :2], torch.zeros(1, 2, dtype=torch.int32)])
        o = attention.decode(c2.view, q2, pt2, _i32(8, 1), backend="torch")
        ref = attention.decode(c2.view, q2[:1], c2.page_table[:, :2], _i32(8), backend="torch")
        assert torch.equal(o[:1], ref)
    # entries past seq_len (4 tokens: one page) are not read: garbage there is fine
    pt = _i32(c.page_table[0, 0].item(), 0, -5, 99).reshape(1, 4)
    attention.decode(c.view, q, pt, _i32(4), backend="torch")
    # the second request of a batch is named
    c2 = Cache("bf16", [8, 5], heads=2, d=16, page=4)
    pt2 = c2.page_table.clone()
    pt2[1, 1] = -3
    with pytest.raises(ValueError, match=r"`page_table\[1, 1\]` = -3 .* \(request 1, seq_len 5\)"):
        attention.decode(c2.view, torch.randn(2, 4, 16).to(torch.bfloat16), pt2, c2.seq_lens,
                         backend=backend)


@gpu
def test_batch_value_checks_on_the_gpu_are_a_debug_option():
    """On CUDA tensors the kernel path reads no device values unless ``debug=True``."""
    c = Cache("bf16", [8], heads=2, d=16, page=4, device="cuda")
    q = torch.randn(1, 4, 16, device="cuda").to(torch.bfloat16)
    pt = torch.tensor([[1, 1 << 20]], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="is outside the pool's pages"):
        attention.decode(c.view, q, pt, c.seq_lens, debug=True)
    with pytest.raises(ValueError, match=r"`cu_seqlens_q\[1\]` = 2: must equal T = 1"):
        attention.extend(c.view, q, cu, c.page_table, c.seq_lens, debug=True)


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
