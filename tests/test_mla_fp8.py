"""MLA decode with fp8 dots (``plan_mla_decode(..., dots="fp8")``, kvpool.attention.mla_dots):
the knob's checks, the kernel under the interpreter (tiny latents, 32 + 32) and on the GPU
(DeepSeek's 512 + 64), against fp64 oracles over the dense dequantized latents (test_mla.py).

Oracle and tolerances. The kernel rounds each head's q row, scaled by ``amax / 448``, to e4m3
(deterministic, the same fp32 ops as here), and the softmax weights ``P`` to e4m3 as
``P * 448``. ``ref_q8`` is the fp64 oracle run on that rounded q, so the kernel differs from
it by P's rounding alone: every weight moves by at most 2^-4 of itself (3 mantissa bits, to
nearest), so the output, a weighted mean of V rows with fp32 row sums, moves by at most
``2^-4 * max|V|`` (``P_BOUND``, plus bf16 output rounding and subnormal weights: ``2^-8``).
Those errors are independent across tokens and the token at the running max is exact
(``P = 1``), so they mostly cancel: ``P_TYPICAL`` = 1.6e-2 of ``max|V|`` is about 3x what these
seeds measure (~5e-3). Against the plain oracle (q unrounded) the error also holds q's
rounding, which moves a score by ~3.6% / sqrt(576) of ``|q| |k|``; it is bounded here by
``Q_TOL`` (measured 1.2-1.6e-2 on the tiny latents, up to ~9e-2 at DeepSeek's shapes in a
torch emulation). The GPU adds the fp8 tensor cores' reduced-precision sums (``P_TYPICAL_GPU``).
"""

import pytest

torch = pytest.importorskip("torch")

from kvpool import attention  # noqa: E402
from test_mla import DEEPSEEK_SCALE, Latent, _q, oracle, rel_err  # noqa: E402

FP8 = ("fp8_e4m3", "fp8_e5m2")
P_BOUND = 2.0**-4 + 2.0**-8
P_TYPICAL = 1.6e-2
P_TYPICAL_GPU = 3.2e-2
Q_TOL = {"interp": 4e-2, "gpu": 0.15}
interpret = pytest.mark.interpret
gpu = pytest.mark.gpu


def q_e4m3(q: torch.Tensor) -> torch.Tensor:
    """q with each head's row rounded to e4m3 as the kernel does (fp32 scale amax / 448)."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    sq = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (qf / sq).to(torch.float8_e4m3fn).double() * sq.double()


def check(c: Latent, q, out, p_typical, q_tol):
    """``out`` against both oracles (module docstring), per request's own ``max|V|``."""
    n = [1] * len(c.lens)
    ref8 = oracle(c, q_e4m3(q), n, DEEPSEEK_SCALE)
    ref = oracle(c, q, n, DEEPSEEK_SCALE)
    for b in range(len(c.lens)):
        vmax = c.dense[b][:, : c.rank].abs().max().item()
        err = (out[b].double().cpu() - ref8[b]).abs().max().item() / vmax
        assert err <= P_BOUND, (b, err)
        assert err <= p_typical, (b, err)
    assert rel_err(out, ref) < q_tol


def plan(c: Latent, heads, **kw):
    kw = {"dots": "fp8", **kw}
    return attention.plan_mla_decode(
        c.view, heads, c.page_table, c.seq_lens, kv_lora_rank=c.rank, **kw
    )


# ----------------------------------------------------------------------------- the knob


def test_dots_knob_is_checked_and_shown():
    """``dots`` defaults to "f16", shows in the plan (repr too); "fp8" turns the word decode
    off; wrong values, non-fp8 caches and tiles below k = 32 are refused with the reason."""
    c = Latent("fp8_e4m3", [40, 3], rank=32, rope=32)
    p = attention.plan_mla_decode(c.view, 8, c.page_table, c.seq_lens, kv_lora_rank=32)
    assert p.dots == "f16" and p.asm and p.kernel == "mla_small"  # (8 heads: tokens on M)
    p8 = plan(c, 8)
    assert p8.dots == "fp8" and not p8.asm and "dots='fp8'" in repr(p8)
    with pytest.raises(ValueError, match="`dots` = 'bf16': must be one of 'f16', 'fp8'"):
        plan(c, 8, **{"dots": "bf16"})
    with pytest.raises(ValueError, match=r"block_n >= 32 .* got 32, 32, 16"):
        plan(c, 8, block_n=16)
    bf = Latent("bf16", [40, 3], rank=32, rope=32)
    with pytest.raises(ValueError, match="`dots` = 'fp8' runs on fp8 caches .* is bf16"):
        plan(bf, 8)
    small = Latent("fp8_e5m2", [40, 3], rank=32, rope=16)
    with pytest.raises(ValueError, match="got 32, 16, 64"):  # (block_n 64 with 64-row blocks)
        plan(small, 8)


def test_launch_refuses_an_fp8_plan_on_another_dtype():
    """A plan is shared by the pool's MLA layers: one made for an fp8 layer and given with a
    bf16 one is refused before a kernel sees mismatched bytes."""
    c = Latent("fp8_e4m3", [40, 3], rank=32, rope=32)
    bf = Latent("bf16", [40, 3], rank=32, rope=32)
    p8 = plan(c, 8)
    with pytest.raises(ValueError, match="runs on fp8 caches"):
        attention.mla_decode(bf.view, _q(2, 8, 64), plan=p8, sm_scale=0.1, backend="triton")


def test_kernels_do_not_specialize_on_per_step_ints():
    """A serving loop's page-table width and split count change between steps; the kernels take
    them unspecialized (Triton would recompile when one becomes 1 or a multiple of 16)."""
    from kvpool.triton_kernels import mla

    for fn, names in (
        (mla.mla_decode_kernel, {"stride_pt", "num_splits"}),
        (mla.mla_extend_kernel, {"stride_pt", "blocks_per_req"}),
    ):
        # (the interpreter's wrapper keeps the jit options; names, or indices in older Tritons)
        dns = getattr(fn, "do_not_specialize", None) or fn.kwargs["do_not_specialize"]
        params = {fn.arg_names[i] if isinstance(i, int) else i for i in dns}
        assert params == names, params


# ----------------------------------------------------------------------------- interpreter


@interpret
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("page", [1, 16])
def test_fp8_dots_interpreted(dtype, page):
    """Requests ending mid-tile and mid-page, one split and 3 (merged), 8 heads in a 16-row
    block and 20 heads (a second, partly masked block)."""
    c = Latent(dtype, [1, 37, 70], rank=32, rope=32, page=page, seed=2)
    for heads, kw in ((8, {"num_splits": 1}), (8, {"num_splits": 3}), (20, {"num_splits": 2})):
        q = _q(3, heads, c.d)
        p = plan(c, heads, block_n=32, **kw)
        out = attention.mla_decode(c.view, q, plan=p, sm_scale=DEEPSEEK_SCALE, backend="triton")
        check(c, q, out, P_TYPICAL, Q_TOL["interp"])


@interpret
def test_fp8_dots_interpreted_zero_and_large_rows():
    """A head whose q row is all zero (scale 1, not 0/0: uniform weights, the mean of V) and
    one 1000x larger (its own scale: nothing saturates) next to ordinary rows."""
    c = Latent("fp8_e4m3", [50, 9], rank=32, rope=32, seed=6)
    q = _q(2, 8, c.d)
    q[0, 3] = 0
    q[1, 5] *= 1000
    out = attention.mla_decode(
        c.view, q, plan=plan(c, 8, num_splits=2), sm_scale=DEEPSEEK_SCALE, backend="triton"
    )
    mean = c.dense[0][:, :32].mean(0)
    assert (out[0, 3].double() - mean).abs().max() < 1e-2 * mean.abs().max()
    check(c, q, out, P_TYPICAL, Q_TOL["interp"])


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_fp8_dots_gpu_deepseek(dtype, heads, page):
    """DeepSeek's latent at TP 1 and TP 8: the default tiles, an explicit split count, and the
    32-token tile; the tensor cores' own fp8 sums included (``P_TYPICAL_GPU``)."""
    c = Latent(dtype, [1, 100, 1000, 4093, 16], rank=512, rope=64, page=page, device="cuda")
    q = _q(5, heads, c.d, "cuda")
    for kw in ({"max_seq_len": 4093}, {"num_splits": 5}, {"block_n": 32, "num_splits": 1}):
        p = plan(c, heads, **kw)
        out = attention.mla_decode(c.view, q, plan=p, sm_scale=DEEPSEEK_SCALE)
        check(c, q, out, P_TYPICAL_GPU, Q_TOL["gpu"])
