"""The MLA decode kernel compiled for sm_90 on the CPU (no GPU needed) at DeepSeek's latent
(512 + 64) with the tiles the planner picks for 128 heads (TP 1) and 16 (TP 8), both ``dots``
variants: shared memory <= 227 KiB, and where it matters for speed the code is what was meant:

- the 16-bit path's latent tiles go global -> shared by the pipeliner's async copies
  (``cp.async``) straight into the wgmma at 128 heads (no spills);
- ``dots="fp8"`` runs fp8 wgmma on the raw bytes (``e4m3.e4m3``, ``e4m3.e5m2`` for e5m2
  caches) with no fp8 -> f16 conversion of the cache, its K tiles by async copies too, and
  no spills, at 16 heads too (its default ``block_h`` of 64: with 16 rows Triton 3.6 would
  run mma.sync on operands converted to fp16).

Needs Triton 3.6 (the H200's; other releases differ in register allocation), else skipped:
``PYTHONPATH=<triton 3.6>:python pytest tests/test_mla_compile.py``.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from test_gluon_compile import SMEM_MAX, resources  # noqa: E402

_VER = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
pytestmark = pytest.mark.skipif(
    _VER != (3, 6), reason=f"Triton {triton.__version__}: expectations are for 3.6"
)

KV = {"bf16": "bf16", "fp8_e4m3": "fp8e4nv", "fp8_e5m2": "fp8e5"}


def default_plan(dtype: str, dots: str, heads: int):
    """``plan_mla_decode``'s defaults for the head-block kernel (``mla_triton``: the one these
    builds compile) at B=64 x 8k for a DeepSeek layer (a CPU view)."""
    from kvpool import attention
    from test_mla import Latent

    c = Latent(dtype, [16], rank=512, rope=64)
    pt = torch.ones(64, 512, dtype=torch.int32)
    sl = torch.full((64,), 8192, dtype=torch.int32)
    p = attention.plan_mla_decode(
        c.view, heads, pt, sl, kv_lora_rank=512, dots=dots, kernel="mla_triton"
    )
    return c.view, p


def compile_decode(dtype: str, dots: str, heads: int):
    """``mla_decode_kernel`` with the default plan's tiles and the constants ``mla_decode``
    passes (pointers and strides 16-divisible as a pool's are, the per-step ints not)."""
    from kvpool.attention import mla
    from kvpool.triton_kernels.mla import mla_decode_kernel as fn
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    view, p = default_plan(dtype, dots, heads)
    consts = {**mla._kernel_consts(view, 512, p.asm), **mla._dots_consts(p.dots)}
    consts.update(BLOCK_H=p.block_h, BLOCK_N=p.block_n, FINAL=p.num_splits == 1)
    consts.setdefault("F8DOT", 0)
    ptrs = dict(Q="*bf16", KV="*" + KV[dtype], KBS="*u8", KSC="*fp32", PT="*i32", SEQ="*i32",
                OUT="*bf16", PO="*fp32", PL="*fp32")  # fmt: skip
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n], attrs[(i,)] = ptrs[n], [["tt.divisibility", 16]]
        elif n == "sm_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride") and n != "stride_pt" or n == "H":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, consts, attrs)
    opts = {"num_warps": p.num_warps, "num_stages": p.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("dtype, dots", [("bf16", "f16"), ("fp8_e4m3", "f16"),
                                         ("fp8_e4m3", "fp8"), ("fp8_e5m2", "fp8")])  # fmt: skip
def test_decode_compiles(dtype, dots, heads):
    k = compile_decode(dtype, dots, heads)
    ptx = k.asm["ptx"]
    res = resources(k)
    assert k.metadata.shared <= SMEM_MAX, k.metadata.shared
    assert "cp.async" in ptx  # the latent tiles are pipelined
    if heads == 128 and dtype == "bf16" or dots == "fp8":
        assert res["REG"] <= 255 and res["STACK"] == 0 and res["LOCAL"] == 0, res
    if dots == "fp8":
        b = "e5m2" if dtype == "fp8_e5m2" else "e4m3"
        assert re.search(rf"wgmma\.mma_async\S*\.e4m3\.{b}", ptx), "no fp8 wgmma"
        assert "cvt.rn.f16x2.e4m3x2" not in ptx and "cvt.rn.f16x2.e5m2x2" not in ptx
