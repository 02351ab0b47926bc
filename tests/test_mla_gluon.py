"""The Gluon MLA decode kernel (kvpool.attention.mla_gluon, plan kernel "mla_gluon"): the
planner's routing, knobs and refusals on the CPU, and on the GPU (H200) at DeepSeek's latent
(512 + 64) with 128 heads (TP 1), pages 1 / 16 / 64, every tile the planner takes, one split
and several (empty splits included), against test_mla's fp64 oracle over the dense latents
(no paging or indexing code shared with the launcher); tolerances as there.
"""

import functools

import pytest

torch = pytest.importorskip("torch")

from kvpool import attention  # noqa: E402
from kvpool.attention import mla_gluon  # noqa: E402
from test_mla import DEEPSEEK_SCALE, TOL, Latent, _q, oracle, rel_err  # noqa: E402

gpu = pytest.mark.gpu
LENS = [1, 63, 64, 65, 333, 1000, 4099]  # (tile edges, a long one)


def _plan(c, heads, **knobs):
    """``plan_mla_decode(kernel="mla_gluon")``, or with ``pipeline`` ``plan_mla_gluon_decode``."""
    if "pipeline" in knobs:
        return mla_gluon.plan_mla_gluon_decode(
            c.view, heads, c.page_table, c.seq_lens, kv_lora_rank=c.rank, **knobs
        )
    return attention.plan_mla_decode(
        c.view, heads, c.page_table, c.seq_lens, kv_lora_rank=c.rank, kernel="mla_gluon", **knobs
    )


def _run(c, heads, q_dtype=torch.bfloat16, **knobs):
    """Decode with an ``mla_gluon`` plan and the oracle: ``(out, ref, plan)``."""
    q = _q(len(c.lens), heads, c.d, "cuda").to(q_dtype)
    plan = _plan(c, heads, **knobs)
    out = attention.mla_decode(c.view, q, plan=plan, sm_scale=DEEPSEEK_SCALE, backend="triton")
    assert out.dtype == q_dtype and out.shape == (len(c.lens), heads, c.rank)
    return out, oracle(c, q, [1] * len(c.lens), DEEPSEEK_SCALE), plan


# ----------------------------------------------------------------------------- CPU


def test_default_routing_unchanged():
    """128 heads on a cache mla_gluon cannot run (here: a CPU tensor) take the head-block Triton
    kernel. (The default on Hopper is mla_gluon: test_review_mla checks that routing.)"""
    c = Latent("bf16", [40, 3], rank=512, rope=64)
    p = attention.plan_mla_decode(c.view, 128, c.page_table, c.seq_lens, kv_lora_rank=512)
    assert p.kernel == "mla_triton"


def test_refusals_name_the_value():
    """What the kernel does not take is a ValueError naming it (mla_triton runs those)."""
    c = Latent("bf16", [40, 3], rank=512, rope=64)
    with pytest.raises(ValueError, match="CPU tensor"):
        _plan(c, 128)
    with pytest.raises(ValueError, match="nvfp4 cache"):
        _plan(Latent("nvfp4", [40, 3], rank=512, rope=64), 128)
    with pytest.raises(ValueError, match="kv_lora_rank 32 \\+ qk_rope_head_dim 16"):
        _plan(Latent("bf16", [40, 3]), 128)
    with pytest.raises(ValueError, match="16-bit dots"):
        _plan(c, 128, dots="fp8")
    for knob, v in (("block_h", 32), ("num_warps", 4)):
        with pytest.raises(ValueError, match=f"`{knob}` = {v}"):
            _plan(c, 128, **{knob: v})


def test_knobs_and_workspace(monkeypatch):
    """With the device check passed (a CPU cache here): the default tile (64 tokens, 2 stages,
    64 heads x 8 warps), explicit tiles, the split workspace ``[B, H, splits, 512]`` fp32, and
    tiles that do not fit shared memory refused."""
    monkeypatch.setattr(mla_gluon, "_device_unfit", lambda device: None)
    c = Latent("fp16", [40, 3, 17], rank=512, rope=64)
    p = _plan(c, 128, num_splits=1)
    assert (p.kernel, p.block_h, p.block_n, p.num_warps, p.num_stages) == (
        "mla_gluon", 64, 64, 8, 2,
    )  # fmt: skip
    assert p.num_splits == 1 and p.part_out is None and p.dots == "f16" and not p.asm
    p = _plan(c, 128, block_n=32, num_splits=5)
    assert (p.block_n, p.num_stages, p.num_splits) == (32, 3, 5)
    assert p.part_out.shape == (3, 128, 5, 512) and p.part_out.dtype == torch.float32
    assert p.part_lse.shape == (3, 128, 5)
    assert _plan(c, 128, block_n=32, num_stages=4).num_stages == 4
    assert _plan(c, 128).num_splits >= 1
    with pytest.raises(ValueError, match="`num_stages` = 3 with block_n 64"):
        _plan(c, 128, block_n=64, num_stages=3)
    with pytest.raises(ValueError, match="`block_n` = 128"):
        _plan(c, 128, block_n=128)
    with pytest.raises(ValueError, match="`num_splits`"):
        _plan(c, 128, num_splits=0)
    with pytest.raises(ValueError, match="`num_stages` = 6 with block_n 32"):
        _plan(c, 128, block_n=32, num_stages=6)
    # fp8 caches: the ring holds bytes, so 32-token tiles take up to 6 stages
    c8 = Latent("fp8_e5m2", [40, 3, 17], rank=512, rope=64)
    p = _plan(c8, 128, block_n=32, num_stages=6, num_splits=2)
    assert (p.kernel, p.block_n, p.num_stages, p.num_splits) == ("mla_gluon", 32, 6, 2)
    assert _plan(c8, 128).num_stages == 2
    # the pipelined loop: fp8 holds two widened tiles (32-token tiles, <= 4 stages)
    p = _plan(c8, 128, pipeline=True)
    assert isinstance(p, mla_gluon.MLAGluonDecodePlan) and p.pipeline
    assert (p.block_n, p.num_stages) == (32, 3)
    with pytest.raises(ValueError, match="`num_stages` = 5 with block_n 32"):
        _plan(c8, 128, pipeline=True, num_stages=5)
    with pytest.raises(ValueError, match="`block_n` = 64"):
        _plan(c8, 128, pipeline=True, block_n=64)
    p = _plan(c, 128, pipeline=True, num_splits=3)
    assert (p.pipeline, p.block_n, p.num_stages, p.num_splits) == (True, 64, 2, 3)
    assert _plan(c, 128).pipeline is False
    with pytest.raises(ValueError, match="`pipeline` = 1"):
        _plan(c, 128, pipeline=1)


# ----------------------------------------------------------------------------- GPU


# the default plan, one split (the direct output), 3 and 7 splits (the merge; with 7, the
# 1-token request's later splits are empty), 32-token tiles at 2..4 stages, the pipelined loop
# (tile i's scores under tile i - 1's P V); fp8 also 32 x 6, 16-bit caches the pipelined 64 x 2
VARIANTS = [
    {},
    {"num_splits": 1},
    {"num_splits": 3},
    {"num_splits": 7},
    {"block_n": 32, "num_stages": 2, "num_splits": 1},
    {"block_n": 32, "num_stages": 3, "num_splits": 4},
    {"block_n": 32, "num_stages": 4, "num_splits": 1},
    {"pipeline": True, "block_n": 32, "num_stages": 3, "num_splits": 1},
    {"pipeline": True, "block_n": 32, "num_stages": 4, "num_splits": 7},
    {"pipeline": True, "block_n": 32, "num_stages": 2, "num_splits": 1},
    {"block_n": 32, "num_stages": 6, "num_splits": 2, "only": "fp8"},
    {"pipeline": True, "block_n": 64, "num_stages": 2, "num_splits": 3, "only": "16-bit"},
]


@functools.cache
def _latent(dtype, page):
    """The DeepSeek-shaped cache of the GPU tests (shared by a (dtype, page)'s variants)."""
    return Latent(dtype, LENS, rank=512, rope=64, page=page, device="cuda")


@gpu
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_gluon_decode_gpu_deepseek(dtype, page, kw):
    """DeepSeek-V3 at TP 1 (128 heads), every variant of :data:`VARIANTS` against the oracle;
    fp8's scale: in the scores, the direct output and the merge."""
    kw = dict(kw)
    only = kw.pop("only", None)
    if only is not None and (only == "fp8") != dtype.startswith("fp8"):
        pytest.skip(f"a variant for {only} caches")
    out, ref, plan = _run(_latent(dtype, page), 128, **kw)
    assert plan.kernel == "mla_gluon"
    assert rel_err(out, ref) < TOL[dtype], kw


@gpu
@pytest.mark.parametrize("heads", [64, 16, 80])
def test_gluon_decode_gpu_head_counts(heads):
    """One head block (64), a partial one (16: rows past the heads masked), and a partial
    second block (80), with fp32 and fp16 queries (cast to the cache's dtype in the kernel)."""
    c = Latent("bf16", [5, 700, 2048], rank=512, rope=64, page=16, device="cuda", seed=3)
    for q_dtype, splits in ((torch.bfloat16, 1), (torch.float32, 2), (torch.float16, 3)):
        for pipe in (False, True):
            out, ref, _ = _run(c, heads, q_dtype, num_splits=splits, pipeline=pipe)
            assert rel_err(out, ref) < TOL["bf16"], (q_dtype, splits, pipe)


@gpu
def test_gluon_matches_triton_kernel():
    """Same cache, same q: the Gluon and head-block Triton kernels agree to bf16 rounding."""
    c = Latent("bf16", [4096, 8192, 31], rank=512, rope=64, page=64, device="cuda", seed=5)
    q = _q(3, 128, c.d, "cuda", seed=9)
    outs = []
    for kernel in ("mla_gluon", "mla_triton"):
        p = attention.plan_mla_decode(c.view, 128, c.page_table, c.seq_lens, kernel=kernel)
        outs.append(attention.mla_decode(c.view, q, plan=p, sm_scale=DEEPSEEK_SCALE).float())
    ref = oracle(c, q, [1, 1, 1], DEEPSEEK_SCALE)
    assert rel_err(outs[0], ref) < TOL["bf16"]
    assert (outs[0] - outs[1]).abs().max().item() < 2 * TOL["bf16"] * ref.abs().max().item()
