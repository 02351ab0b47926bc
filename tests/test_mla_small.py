"""The few-heads MLA decode kernel (kvpool.attention.mla_small, plan kernel "mla_small"):
routing and knobs, the kernel interpreted at tiny latents (32 + 16) for every dtype, and on the
GPU at DeepSeek's latent (512 + 64) with 16 and 8 heads (DeepSeek-V3 / Kimi-K2 at TP 8).

Oracle: test_mla's fp64 absorbed attention over the dense dequantized latents (no paging or
indexing code shared with the launchers); tolerances as there.
"""

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")

from kvpool import attention  # noqa: E402
from kvpool.attention import mla_small  # noqa: E402
from test_mla import DEEPSEEK_SCALE, DTYPES, TOL, Latent, _q, oracle, rel_err  # noqa: E402

interpret = pytest.mark.interpret
gpu = pytest.mark.gpu
WORDS = ("fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16")  # caches with the word decode


def _run(c, heads, device="cpu", kernel=None, **knobs):
    """Plan (``plan_mla_small_decode`` with ``knobs``, or ``plan_mla_decode(kernel=...)``),
    decode with the Triton kernels, and the oracle: ``(out, ref, plan)``."""
    q = _q(len(c.lens), heads, c.d, device)
    if kernel is None:
        plan = mla_small.plan_mla_small_decode(
            c.view, heads, c.page_table, c.seq_lens, kv_lora_rank=c.rank, **knobs
        )
    else:
        plan = attention.plan_mla_decode(
            c.view, heads, c.page_table, c.seq_lens, kv_lora_rank=c.rank, kernel=kernel, **knobs
        )
    out = attention.mla_decode(c.view, q, plan=plan, sm_scale=DEEPSEEK_SCALE, backend="triton")
    return out, oracle(c, q, [1] * len(c.lens), DEEPSEEK_SCALE), plan


# ----------------------------------------------------------------------------- routing


def test_default_routing_by_heads(monkeypatch):
    """<= 32 heads take mla_small (one program for all heads, padded to >= 16), more the
    head-block kernel; ``kernel=`` forces either; ``KVPOOL_MLA_SMALL=0`` turns the default off."""
    c = Latent("fp8_e4m3", [40, 3])
    monkeypatch.delenv(mla_small.MLA_SMALL_ENV, raising=False)
    for h, kernel, bh in ((8, "mla_small", 16), (16, "mla_small", 16), (20, "mla_small", 32),
                          (32, "mla_small", 32), (33, "mla_triton", 64)):  # fmt: skip
        p = attention.plan_decode(c.view, h, c.page_table, c.seq_lens, kv_lora_rank=32)
        assert (p.kernel, p.block_h) == (kernel, bh), h
        assert isinstance(p, attention.MLADecodePlan)
        assert isinstance(p, mla_small.MLASmallDecodePlan) == (kernel == "mla_small")
    p = attention.plan_mla_decode(c.view, 64, c.page_table, c.seq_lens, kv_lora_rank=32,
                                  kernel="mla_small")  # fmt: skip
    assert (p.kernel, p.block_h) == ("mla_small", 64)
    p = attention.plan_mla_decode(c.view, 16, c.page_table, c.seq_lens, kv_lora_rank=32,
                                  kernel="mla_triton")  # fmt: skip
    assert (p.kernel, p.block_h) == ("mla_triton", 16)
    monkeypatch.setenv(mla_small.MLA_SMALL_ENV, "0")
    p = attention.plan_decode(c.view, 16, c.page_table, c.seq_lens, kv_lora_rank=32)
    assert p.kernel == "mla_triton"
    p = attention.plan_mla_decode(c.view, 16, c.page_table, c.seq_lens, kv_lora_rank=32,
                                  kernel="mla_small")  # fmt: skip
    assert p.kernel == "mla_small"  # (the knob wins over the environment)


def test_knobs_and_workspace():
    """Explicit knobs land in the plan; the split workspace is ``[B, H, splits, Dl]`` /
    ``[B, H, splits]`` fp32 (decode.merge_kernel's ``[B*H, splits, Dl]``); one split has none."""
    c = Latent("nvfp4", [40, 3, 17])
    p = mla_small.plan_mla_small_decode(
        c.view, 8, c.page_table, c.seq_lens, kv_lora_rank=32, num_splits=5, block_h=8,
        block_n=64, num_warps=4, num_stages=1, prefetch=True,
    )  # fmt: skip
    fields = (p.num_splits, p.block_h, p.block_n, p.num_warps, p.num_stages, p.prefetch)
    assert fields == (5, 8, 64, 4, 1, True)
    assert p.part_out.shape == (3, 8, 5, 32) and p.part_out.dtype == torch.float32
    assert p.part_lse.shape == (3, 8, 5)
    p = mla_small.plan_mla_small_decode(
        c.view, 8, c.page_table, c.seq_lens, kv_lora_rank=32, num_splits=1
    )
    assert p.part_out is None and p.part_lse is None
    assert (p.block_n, p.num_warps, p.num_stages, p.prefetch) == mla_small.QUANT_TILE
    bf = Latent("bf16", [40, 3, 17])
    p = mla_small.plan_mla_small_decode(bf.view, 8, bf.page_table, bf.seq_lens, kv_lora_rank=32)
    assert (p.block_n, p.num_warps, p.num_stages, p.prefetch) == mla_small.DEFAULT_TILE
    with pytest.raises(ValueError, match=r"`prefetch` with `num_warps` = 8: .* at most 4 warps"):
        mla_small.plan_mla_small_decode(
            c.view, 8, c.page_table, c.seq_lens, kv_lora_rank=32, num_warps=8, prefetch=True
        )
    p = mla_small.plan_mla_small_decode(c.view, 20, c.page_table, c.seq_lens, kv_lora_rank=32)
    assert (p.block_h, p.num_warps) == (32, mla_small.WIDE_WARPS)  # (a 512 x 32 accumulator)
    assert p.asm  # (a pool-like contiguous FP4 cache: the word decode)


def test_bad_knobs_are_named():
    c = Latent("fp8_e4m3", [40, 3])
    pt, sl = c.page_table, c.seq_lens

    def plan(h=16, **kw):
        return attention.plan_mla_decode(c.view, h, pt, sl, kv_lora_rank=32, **kw)

    with pytest.raises(ValueError, match=r"`kernel` = 'flash': MLA decode kernels are mla_tri"):
        plan(kernel="flash")
    with pytest.raises(ValueError, match=r"'mla_small' with 65 heads: it takes at most 64"):
        plan(65, kernel="mla_small")
    with pytest.raises(ValueError, match=r"`block_h` = 8: must be a power of two in 16\.\.64"):
        plan(block_h=8)  # 16 heads padded to 8
    with pytest.raises(ValueError, match=r"`block_h` = 24: must be a power of two"):
        plan(block_h=24)
    with pytest.raises(ValueError, match=r"`block_n` = 8: must be a power of two in 16\.\.256"):
        plan(block_n=8)
    with pytest.raises(ValueError, match=r"`num_splits` = 0"):
        plan(num_splits=0)
    with pytest.raises(ValueError, match=r"`prefetch` = 1: must be a bool"):
        mla_small.plan_mla_small_decode(c.view, 16, pt, sl, kv_lora_rank=32, prefetch=1)
    # a plan that names mla_small without being one (hand-edited) is refused at launch
    p = dataclasses.replace(plan(kernel="mla_triton"), kernel="mla_small")
    with pytest.raises(ValueError, match="names kernel 'mla_small' but is a MLADecodePlan"):
        attention.mla_decode(c.view, _q(2, 16, c.d), plan=p, sm_scale=0.1, backend="triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled Triton only")
def test_step_varying_ints_are_not_specialized():
    """The page table's row stride and the split count change from step to step: Triton must
    not specialize them (a recompile when they hit 1 or a multiple of 16)."""
    from kvpool.triton_kernels.mla_small import mla_small_decode_kernel as k

    names = {k.arg_names[a] if isinstance(a, int) else a for a in k.do_not_specialize}
    assert names == {"stride_pt", "num_splits"}


# ----------------------------------------------------------------------------- interpreter


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("heads", [8, 16])
def test_small_decode_interpreted(dtype, page, heads):
    """Latent 32 + 16, requests of 1, 37 and 70 tokens (mid-tile, mid-page; the 1-token request
    leaves splits empty): one split, 3 splits merged (the byte decode for word caches), the
    prefetch variant with 16-token tiles."""
    c = Latent(dtype, [1, 37, 70], page=page, seed=2)
    variants = [{"num_splits": 1}, {"num_splits": 3}]
    variants.append({"num_splits": 2, "prefetch": True, "block_n": 16})
    if dtype in WORDS:
        variants[1]["asm"] = False
    for kw in variants:
        out, ref, plan = _run(c, heads, **kw)
        assert plan.kernel == "mla_small" and plan.num_splits == kw["num_splits"]
        assert out.shape == (3, heads, 32) and out.dtype == torch.bfloat16
        assert rel_err(out, ref) < TOL[dtype], kw


@interpret
def test_small_padded_heads_and_head_block_kernel_agree_interpreted():
    """20 heads padded to 32 (12 zero query columns never stored) and 8 heads in an 8-wide
    block: against the oracle and the head-block kernel on the same query."""
    c = Latent("fp8_e4m3", [3, 50, 33], page=16, seed=4)
    out, ref, plan = _run(c, 20, num_splits=2)
    assert plan.block_h == 32 and rel_err(out, ref) < TOL["fp8_e4m3"]
    old, ref2, plan2 = _run(c, 20, kernel="mla_triton", num_splits=2)
    assert plan2.kernel == "mla_triton" and torch.equal(ref, ref2)
    assert (out.float() - old.float()).abs().max().item() < 2 * TOL["fp8_e4m3"] * ref.abs().max()
    out, ref, plan = _run(c, 8, block_h=8, num_splits=3, block_n=32, prefetch=True)
    assert plan.block_h == 8 and rel_err(out, ref) < TOL["fp8_e4m3"]


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_block_kernel_reachable_interpreted(dtype):
    """``kernel="mla_triton"`` keeps the head-block kernel at 8 heads (its interpreted coverage
    now that the default sends these layers to mla_small)."""
    c = Latent(dtype, [1, 37, 70], page=16, seed=2)
    out, ref, plan = _run(c, 8, kernel="mla_triton", num_splits=3)
    assert plan.kernel == "mla_triton" and rel_err(out, ref) < TOL[dtype]


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [16, 8])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_small_decode_gpu_deepseek(dtype, heads, page):
    """DeepSeek latent (512 + 64) at TP 8 (16 heads; Kimi-K2: 8): the default plan, 5 splits,
    and the variants the sweep measures (prefetch at 64 tokens x 4 warps; the cp.async
    pipeline at 64 x 8), against the oracle."""
    c = Latent(dtype, [1, 100, 1000, 4093, 16], rank=512, rope=64, page=page, device="cuda")
    variants = (
        {"max_seq_len": 4093},
        {"num_splits": 5},
        {"num_splits": 7, "prefetch": True, "block_n": 64, "num_warps": 4, "num_stages": 1},
        {"num_splits": 3, "prefetch": False, "block_n": 64, "num_warps": 8, "num_stages": 2},
        {"num_splits": 4, "prefetch": True, "block_n": 32, "num_warps": 4, "num_stages": 1},
    )
    for kw in variants:
        out, ref, plan = _run(c, heads, "cuda", **kw)
        assert plan.kernel == "mla_small"
        assert rel_err(out, ref) < TOL[dtype], kw


@interpret
def test_sweep_script_quick(tmp_path):
    """benches/attention/sweep_mla_small.py --quick end to end (interpreted, tiny latent): a
    record per (variant, page) with its error check, the table, a warm-up worker's results."""
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benches", "attention"))
    import sweep_mla_small

    argv = ["--quick", "--out", str(tmp_path), "--dtypes", "nvfp4", "--models", "kimi-k2-tp8",
            "--variants", "old,small,32:4:1:1:2", "--warm-procs", "0"]  # fmt: skip
    recs = sweep_mla_small.main(argv)
    assert [(r["variant"], r["page"]) for r in recs] == [
        (v, p) for v in ("old", "small", "32:4:1:1:2") for p in (16, 64)
    ]
    assert [r["kernel"] for r in recs[::2]] == ["mla_triton", "mla_small", "mla_small"]
    assert recs[-1]["splits"] == 2 and recs[-1]["prefetch"] is True
    assert all(r["err_ok"] and r["rel_err"] < TOL["nvfp4"] for r in recs)
    with open(tmp_path / "sweep_mla_small.json") as f:
        assert len(json.load(f)["records"]) == 6
    assert (tmp_path / "sweep_mla_small.md").read_text().count("| kimi-k2-tp8 | nvfp4 |") == 2
