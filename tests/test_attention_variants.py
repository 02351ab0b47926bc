"""Which kernel variant runs a layer (kvpool.attention.variants): the Gluon decode kernel's choice,
its layout and device checks, and a Gluon plan refused on a layer it cannot run. The kernels
themselves run in test_attention_decode.py (GPU).
"""


import pytest

torch = pytest.importorskip("torch")

from attention_helpers import (  # noqa: E402
    Cache,
    _misaligned,
)
from kvpool import attention  # noqa: E402

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu


# --------------------------------------------------------------------------------------- host


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
