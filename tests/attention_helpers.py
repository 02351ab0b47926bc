"""Shared builders of the attention tests (test_attention*.py, test_mla.py): paged caches filled
from dense K/V, the fp64 oracle, decode/extend runners, the KVB-16 cache, the tolerances.

Oracle: an fp64 attention written here over *dense* K/V (dequantized with kvpool.formats before
they are scattered into pages), so it shares no paging/indexing code with the launchers.

Tolerances (max |out - ref| / max |ref|, against the fp64 oracle on the same dequantized values):
the kernels' dots run in fp16 (fp16, fp8, nvfp4 caches: q and p rounded to fp16), bf16 (bf16 and
fp4_mx_block16 caches) or fp32 (fp32 cache), with fp32 accumulation; output rounded to q's dtype.
"""

import math
import os

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


# ----------------------------------------------------------------------------- small builders


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


def _i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


def _attack_cache():
    """bf16, 2 KV heads, head_dim 16, page_size 4, one request of 8 tokens on 2 pages."""
    return Cache("bf16", [8], heads=2, d=16, page=4)
