"""Decode and extend plans (kvpool.attention.plan_decode / plan_extend): defaults per dtype, the
split model, knobs and their errors, plans reused across layers.
"""

import re

import pytest

torch = pytest.importorskip("torch")

from attention_helpers import (  # noqa: E402
    TOL,
    Cache,
    _pretend_gpu,
    rel_err,
    run_decode,
)
from kvpool import attention  # noqa: E402

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu


# --------------------------------------------------------------------------------------- host


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


# --------------------------------------------------------------------------- GPU, real shapes


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
