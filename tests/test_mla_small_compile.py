"""The few-heads MLA decode kernel (``triton_kernels/mla_small.py``) compiled for sm_90 on the
CPU (no GPU needed) at DeepSeek's latent (512 + 64) with 16 heads: the default tile of every
dtype and the 64-token prefetch tile the sweep measures have no register spills (no stack, no
local memory, ``cuobjdump -res-usage``), and the default tile's shared memory lets two programs
share a multiprocessor (what ``mla_small._programs_per_sm`` tells the split model).

Triton 3.6 only (the device's release; 3.9 allocates differently: fp4_mx_block16 spills 24
bytes there), else skipped; run with it on the path:
``PYTHONPATH=python:/tmp/gluon-deps pytest tests/test_mla_small_compile.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from kvpool.attention import mla_small  # noqa: E402

_VER = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
pytestmark = pytest.mark.skipif(
    _VER != (3, 6) or os.environ.get("TRITON_INTERPRET") == "1",
    reason=f"Triton {triton.__version__}: the register figures are Triton 3.6's (compiled)",
)
SMEM_PER_SM = 227 * 1024  # bytes of shared memory per multiprocessor for blocks (H100 / H200)


def compile_sm90(dtype: str, block_n: int, num_warps: int, num_stages: int, prefetch: bool,
                 final: bool = False, hp: int = 16):  # fmt: skip
    """``triton.compile`` of ``mla_small_decode_kernel`` for sm_90 with the launcher's
    constants for ``dtype`` (``hp`` padded heads, pointers and row strides 16-divisible as in
    a pool)."""
    import triton.language as tl
    from kvpool.triton_kernels.mla_small import mla_small_decode_kernel as fn
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kv, fmt, cdt, has_scale, asm = {
        "bf16": ("bf16", 0, tl.bfloat16, False, 0),
        "fp16": ("fp16", 0, tl.float16, False, 0),
        "fp8_e4m3": ("fp8e4nv", 1, tl.float16, True, 1),
        "fp8_e5m2": ("fp8e5", 1, tl.float16, True, 1),
        "nvfp4": ("u8", 2, tl.float16, True, 1),
        "fp4_mx_block16": ("u8", 3, tl.bfloat16, False, 1),
    }[dtype]
    ptrs = dict(Q="*bf16", KV="*" + kv, KBS="*u8", KSC="*fp32", PT="*i32", SEQ="*i32",
                OUT="*bf16", PO="*fp32", PL="*fp32")  # fmt: skip
    consts = dict(DL=512, DR=64, HP=hp, BLOCK_N=block_n, FINAL=final, FMT=fmt, CDT=cdt,
                  IS_F32=False, HAS_SCALE=has_scale, FP4_MUL=64.0 if fmt == 2 else 1.0,
                  ASM=asm, PREFETCH=prefetch)  # fmt: skip
    aligned = {"stride_qb", "stride_qh", "stride_kr", "stride_ob", "stride_oh", *ptrs}
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        else:
            sig[n] = ptrs.get(n, "fp32" if n == "sm_scale" else "i32")
        if n in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def resources(kernel) -> dict:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of the cubin (``cuobjdump -res-usage``)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4",
                                   "fp4_mx_block16"])  # fmt: skip
def test_default_tile_fits_two_programs_per_sm(dtype, final):
    bn, nw, ns, pf = mla_small.DEFAULT_TILE
    k = compile_sm90(dtype, bn, nw, ns, pf, final)
    r = resources(k)
    assert r["STACK"] == 0 and r["LOCAL"] == 0, r
    assert mla_small._programs_per_sm(bn, nw) == 2
    assert 2 * k.metadata.shared <= SMEM_PER_SM, k.metadata.shared
    assert 2 * nw * 32 * (-(-r["REG"] // 8) * 8) <= 65536, r  # (registers per warp: x 8)
    assert "wgmma.mma_async" in k.asm["ptx"]  # (O^T = K^T P^T: the latent on M)


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4", "fp4_mx_block16"])
def test_default_tile_at_32_heads_has_no_spills(dtype):
    """17..32 heads (DeepSeek-V3 at TP 4) pad to 32: the planner's 8 warps hold the doubled
    accumulator without spills."""
    bn, _, ns, pf = mla_small.DEFAULT_TILE
    r = resources(compile_sm90(dtype, bn, mla_small.WIDE_WARPS, ns, pf, hp=32))
    assert r["STACK"] == 0 and r["LOCAL"] == 0, r


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
def test_prefetch_tile_has_no_spills_and_smem_operands(dtype):
    """The 64-token, 8-warp prefetch tile: both products are warpgroup MMAs reading the
    dequantized tile from shared memory (no register A operand, so no spills)."""
    k = compile_sm90(dtype, 64, 8, 1, True)
    r = resources(k)
    assert r["STACK"] == 0 and r["LOCAL"] == 0, r
    ttgir = k.asm["ttgir"]
    dots = re.findall(r"ttng\.warp_group_dot %\S+, %\S+, %\S+ \{[^}]*\} : (\S+)", ttgir)
    assert len(dots) == 3 and all(a.startswith("!ttg.memdesc") for a in dots), dots
