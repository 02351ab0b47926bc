"""MLA attention over the latent cache (kvpool.attention.mla): torch reference, Triton kernels
(interpreted at tiny shapes, on the GPU at DeepSeek shapes), dispatch from decode/extend, errors.

Oracle: fp64 absorbed attention written here over *dense* latents (dequantized with
kvpool.formats before they are scattered into pages): scores ``q . latent`` over the whole row,
values the first ``kv_lora_rank`` entries, so it shares no paging or indexing code with the
launchers. Tolerances as in attention_helpers.py (dots in fp16 or bf16, fp32 accumulation).
"""

import math
import os

import pytest

torch = pytest.importorskip("torch")

from kvpool import attention, formats  # noqa: E402
from kvpool.pool import LayerView  # noqa: E402

DTYPES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16")
FP4 = ("nvfp4", "fp4_mx_block16")
TOL = {"bf16": 1.6e-2, "fp16": 8e-3, "fp8_e4m3": 8e-3, "fp8_e5m2": 8e-3, "nvfp4": 8e-3}
TOL["fp4_mx_block16"] = 1.6e-2
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpret = pytest.mark.interpret
gpu = pytest.mark.gpu
# DeepSeek-V3's softmax scale: 1/sqrt(192) x mscale^2, mscale = 0.1 * ln(40) + 1
DEEPSEEK_SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)


class Latent:
    """A one-layer paged MLA cache filled from dense per-request latents, plus dense fp64
    dequantized copies for the oracle. Unused slots are NaN (16-bit) or NaN-coded bytes."""

    def __init__(self, dtype, lens, *, rank=32, rope=16, page=16, device="cpu", seed=0):
        gen = torch.Generator().manual_seed(seed)
        d = rank + rope
        self.rank, self.d, self.lens = rank, d, list(lens)
        pages_per = [max(1, -(-n // page)) for n in lens]
        num_pages = 1 + sum(pages_per) + 2
        rows = num_pages * page
        fp4 = dtype in FP4
        k = torch.empty(rows, 1, d // 2 if fp4 else d, dtype=attention._STORAGE[dtype])
        if k.dtype.is_floating_point and k.element_size() == 2:
            k.fill_(float("nan"))
        else:
            k.view(torch.uint8).fill_(0x7F)  # fp8 NaN; FP4: +6 in every nibble
        kbs = None
        if dtype == "nvfp4":
            kbs = torch.full((rows, 1, d // 16), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
        elif dtype == "fp4_mx_block16":
            kbs = torch.full((rows, d // 16), 254, dtype=torch.uint8)
        scaled = dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4")
        ks = torch.tensor([0.05 / (50 if dtype == "nvfp4" else 1)])
        perm = (torch.randperm(num_pages - 3, generator=gen) + 1).tolist()
        poison = num_pages - 1
        self.page_table = torch.full((len(lens), max(pages_per) + 1), poison, dtype=torch.int32)
        self.dense = []
        for b, n in enumerate(lens):
            mine = [perm.pop() for _ in range(pages_per[b])]
            self.page_table[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
            x = torch.randn(n, 1, d, generator=gen)
            pos = torch.arange(n)
            slots = torch.tensor(mine)[pos // page] * page + pos % page
            qd, qb = formats.quantize(x, dtype, scale=ks)
            k[slots] = qd
            if kbs is not None:
                kbs[slots] = qb.reshape(kbs[slots].shape)
            self.dense.append(formats.dequantize(qd, qb, dtype, scale=ks).double()[:, 0])
        self.view = LayerView(
            layer=0, dtype=dtype, page_size=page, num_kv_heads=1, head_dim=d, v_head_dim=0,
            k=k.to(device), v=None,
            k_block_scale=None if kbs is None else kbs.to(device),
            k_scale=ks.to(device) if scaled else None,
        )  # fmt: skip
        self.page_table = self.page_table.to(device)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)


def oracle(c: Latent, q, q_lens, scale):
    """fp64 absorbed attention over the dense latents; q rows ordered request by request."""
    out, row = [], 0
    for b, n in enumerate(c.lens):
        lat = c.dense[b]
        for i in range(q_lens[b]):
            p = n - q_lens[b] + i  # the query's position
            s = (q[row].double().cpu() @ lat[: p + 1].T) * scale  # [H, p + 1]
            out.append(torch.softmax(s, -1) @ lat[: p + 1, : c.rank])
            row += 1
    return torch.stack(out) if out else torch.zeros(0)


def rel_err(out, ref):
    out = out.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _q(rows, heads, d, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, d, generator=gen).to(torch.bfloat16).to(device)


def _decode(c, heads, backend, device="cpu", **plan_kw):
    q = _q(len(c.lens), heads, c.d, device)
    plan = None
    if plan_kw:
        plan = attention.plan_decode(c.view, heads, c.page_table, c.seq_lens, **plan_kw)
    out = attention.decode(
        c.view, q, c.page_table, c.seq_lens, sm_scale=DEEPSEEK_SCALE, kv_lora_rank=c.rank,
        backend=backend, plan=plan,
    )  # fmt: skip
    return out, oracle(c, q, [1] * len(c.lens), DEEPSEEK_SCALE), plan


def _extend(c, heads, q_lens, backend, device="cpu", use_plan=True):
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(device)
    q = _q(sum(q_lens), heads, c.d, device)
    plan = None
    if use_plan:
        plan = attention.plan_extend(
            c.view, heads, cu, c.page_table, c.seq_lens, kv_lora_rank=c.rank
        )
    out = attention.extend(
        c.view, q, cu, c.page_table, c.seq_lens, sm_scale=DEEPSEEK_SCALE, backend=backend,
        plan=plan, kv_lora_rank=c.rank,
    )  # fmt: skip
    return out, oracle(c, q, q_lens, DEEPSEEK_SCALE)


# ----------------------------------------------------------------------------- torch reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 16])
def test_reference_decode_and_extend_match_the_oracle(dtype, page):
    """The torch path (what CPU callers get) against the fp64 oracle, decode and ragged extend
    (a request without new tokens, one plain prefill, prefixes ending mid-page)."""
    c = Latent(dtype, [1, 17, 40, 5], page=page)
    out, ref, _ = _decode(c, 4, "torch")
    assert out.shape == (4, 4, 32) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 8e-3  # bf16 output rounding only
    out, ref = _extend(c, 4, [1, 0, 40, 3], "torch", use_plan=False)
    assert out.shape == (44, 4, 32)
    assert rel_err(out, ref) < 8e-3


def test_decode_dispatch_needs_sm_scale_and_refuses_gqa_options():
    c = Latent("bf16", [9, 3])
    q = _q(2, 4, c.d)
    with pytest.raises(ValueError, match="`sm_scale` is required for MLA layers"):
        attention.decode(c.view, q, c.page_table, c.seq_lens)
    with pytest.raises(ValueError, match="`window`, `softcap`: not supported on MLA layers"):
        attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.1, window=4, softcap=30.0)
    with pytest.raises(ValueError, match="`q` has 32 values per head, the MLA latent 48"):
        attention.decode(
            c.view, q[..., :32], c.page_table, c.seq_lens, sm_scale=0.1, kv_lora_rank=32
        )
    with pytest.raises(ValueError, match="`kv_lora_rank` = 48: must be less than the latent"):
        attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.1, kv_lora_rank=48)
    with pytest.raises(ValueError, match="`sm_scale` = True"):
        attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=True)


def test_kv_lora_rank_defaults():
    """Without ``kv_lora_rank``: ``out``'s last dim, else head_dim - 64 (refused at 48 values:
    a rank of -16)."""
    c = Latent("bf16", [9, 3])
    q = _q(2, 4, c.d)
    out = torch.empty(2, 4, 32, dtype=torch.bfloat16)
    attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.1, out=out)
    ref = attention.reference_mla_decode(
        c.view, q, c.page_table, c.seq_lens, sm_scale=0.1, kv_lora_rank=32
    )
    assert torch.allclose(out.float(), ref, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="`kv_lora_rank` = -16"):
        attention.decode(c.view, q, c.page_table, c.seq_lens, sm_scale=0.1)


def test_kernel_geometry_refused_with_what_is_supported():
    """A latent the kernels do not tile (rank 48 + rope 16) is refused naming both parts and
    what is supported; the torch path runs it."""
    c = Latent("bf16", [9, 3], rank=48, rope=16)
    with pytest.raises(ValueError, match=r"kv_lora_rank 48 \+ qk_rope_head_dim 16: the MLA"):
        attention.plan_decode(c.view, 4, c.page_table, c.seq_lens, kv_lora_rank=48)
    out, ref, _ = _decode(c, 4, "torch")
    assert rel_err(out, ref) < 8e-3


def test_plans_name_the_kernel():
    """Every plan names the kernel that runs (a slow fallback is never silent)."""
    c = Latent("fp8_e4m3", [40, 3])
    p = attention.plan_decode(c.view, 8, c.page_table, c.seq_lens, kv_lora_rank=32)
    assert p.kernel == "mla_small" and p.block_h == 16  # <= 32 heads: tokens on M
    p = attention.plan_mla_decode(
        c.view, 8, c.page_table, c.seq_lens, kv_lora_rank=32, kernel="mla_triton"
    )
    assert p.kernel == "mla_triton" and p.block_h == 16
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    pe = attention.plan_extend(c.view, 8, cu, c.page_table, c.seq_lens, kv_lora_rank=32)
    assert pe.kernel == "mla_triton" and pe.work.tolist() == [[0, 0], [1, 0]]
    from attention_helpers import Cache

    gqa = Cache("fp8_e4m3", [40, 3], heads=2, d=32)  # an MLA plan on a GQA layer, and back
    with pytest.raises(ValueError, match="`plan` is a MLADecodePlan: layer 0 needs a DecodePlan"):
        attention.decode(gqa.view, _q(2, 4, 32), plan=p)
    gp = attention.plan_decode(gqa.view, 4, gqa.page_table, gqa.seq_lens)
    with pytest.raises(
        ValueError, match="`plan` is a DecodePlan: MLA layers need an MLADecodePlan"
    ):
        attention.decode(c.view, _q(2, 8, c.d), plan=gp, sm_scale=0.1)
    with pytest.raises(ValueError, match="swap: options of the GQA decode kernels"):
        attention.plan_decode(c.view, 8, c.page_table, c.seq_lens, swap=True)


# ----------------------------------------------------------------------------- interpreter


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 16])
def test_mla_decode_interpreted(dtype, page):
    """The decode kernel at a tiny latent (32 + 16), 8 heads in one 16-row block: one split and
    3 splits (merged), requests ending mid-tile and mid-page."""
    c = Latent(dtype, [1, 37, 70], page=page, seed=2)
    for kw in ({"num_splits": 1}, {"num_splits": 3}):
        out, ref, plan = _decode(c, 8, "triton", kv_lora_rank=32, **kw)
        assert plan.num_splits == kw["num_splits"]
        assert rel_err(out, ref) < TOL[dtype], kw


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_extend_interpreted(dtype):
    """The extend kernel: ragged new tokens over cached prefixes (one request without new
    tokens, a plain prefill), 4 heads (4 x 16 rows a program), with and without a plan."""
    c = Latent(dtype, [19, 6, 33], page=16, seed=3)
    for use_plan in (True, False):
        out, ref = _extend(c, 4, [5, 0, 33], "triton", use_plan=use_plan)
        assert rel_err(out, ref) < TOL[dtype], use_plan


@interpret
def test_mla_decode_interpreted_head_blocks_and_page_1():
    """20 heads: two 16-head blocks, the second one partly masked; page 1."""
    c = Latent("fp8_e4m3", [3, 50], page=1, seed=4)
    out, ref, plan = _decode(c, 20, "triton", kv_lora_rank=32, num_splits=2)
    assert plan.block_h == 32 or plan.block_h == 16
    assert rel_err(out, ref) < TOL["fp8_e4m3"]


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_mla_decode_gpu_deepseek(dtype, heads, page):
    """DeepSeek geometry (512 + 64 latent) at TP 1 (128 heads) and TP 8 (16): default plan and
    an explicit split count, against the oracle."""
    c = Latent(dtype, [1, 100, 1000, 4093, 16], rank=512, rope=64, page=page, device="cuda")
    for kw in ({"max_seq_len": 4093}, {"num_splits": 5}):
        out, ref, _ = _decode(c, heads, "triton", "cuda", kv_lora_rank=512, **kw)
        assert rel_err(out, ref) < TOL[dtype], kw


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("page", [16, 64])
def test_mla_extend_gpu_deepseek(dtype, heads, page):
    """Extend at DeepSeek geometry: chunks of new tokens over cached prefixes, a plain prefill."""
    c = Latent(dtype, [700, 64, 300], rank=512, rope=64, page=page, device="cuda")
    out, ref = _extend(c, heads, [100, 64, 1], "triton", "cuda")
    assert rel_err(out, ref) < TOL[dtype]


# ----------------------------------------------------------------------------- through the pool


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpret)])
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
def test_pool_decode_and_extend_dispatch_to_mla(dtype, backend):
    """``pool.write`` then ``pool.decode`` / ``pool.extend`` on a DeepSeek-V3 layer (a CPU pool of
    4 pages of 16): the absorbed MLA path, against the oracle over the pool's own dequantized
    latents (``pool.dequantize``)."""
    import kvpool

    plan = kvpool.size_for("deepseek-ai/DeepSeek-V3", dtype, num_tokens=48, page_size=16)
    pool = kvpool.KVPool(plan, device="cpu")
    pool.set_kv_scales([0.02] * 61, [0.02] * 61)
    gen = torch.Generator().manual_seed(5)
    loc = torch.arange(16, 16 + 40, dtype=torch.int32)  # pages 1..3, 40 tokens
    pool.write(3, loc, torch.randn(40, 1, 576, generator=gen))
    pt = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    sl = torch.tensor([40], dtype=torch.int32)
    q = torch.randn(1, 16, 576, generator=gen).to(torch.bfloat16)
    out = pool.decode(3, q, pt, sl, sm_scale=DEEPSEEK_SCALE, backend=backend)
    lat = pool.dequantize(3, loc)[0][:, 0].double()  # [40, 576]
    ref = torch.softmax(q[0].double() @ lat.T * DEEPSEEK_SCALE, -1) @ lat[:, :512]
    assert out.shape == (1, 16, 512)
    assert rel_err(out[0], ref) < 8e-3
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q3 = torch.randn(3, 16, 576, generator=gen).to(torch.bfloat16)
    out = pool.extend(3, q3, cu, pt, sl, sm_scale=DEEPSEEK_SCALE, backend=backend)
    for i, p in enumerate(range(37, 40)):
        s = q3[i].double() @ lat[: p + 1].T * DEEPSEEK_SCALE
        assert rel_err(out[i], torch.softmax(s, -1) @ lat[: p + 1, :512]) < 8e-3
