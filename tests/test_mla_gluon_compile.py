"""The Gluon MLA decode kernel (``triton_kernels/mla_gluon.py``) compiled for sm_90 on the CPU
(no GPU needed) at every tile the planner takes (``mla_gluon.STAGES_FIT``,
``STAGES_FIT_FP8``), bf16, fp16 and fp8 caches, one split and split outputs: registers <= 255
with no spills (no stack, no local memory, ``cuobjdump -res-usage``), shared memory within a
block's 227 KiB, and the products on warpgroup MMAs of the shapes the design says (``S``: m64
x block_n / 2 per warpgroup, 36 k-steps over the 576-value row; ``O``: m64n256, block_n / 16
k-steps), fed by ``cp.async``.

Triton 3.6 only (``attention.GLUON_TRITON``; 3.9 removed the cp.async call), else skipped:
``PYTHONPATH=python:/tmp/gluon-deps pytest tests/test_mla_gluon_compile.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from kvpool.attention import mla_gluon, variants  # noqa: E402

_VER = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
pytestmark = pytest.mark.skipif(
    _VER not in variants.GLUON_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
    reason=f"Triton {triton.__version__}: the Gluon kernels are built with "
    f"{variants.GLUON_TRITON} only",
)
SMEM_MAX = 227 * 1024  # bytes of shared memory a block may take (H100 / H200)
TILES = [("bf16", bn, st) for bn, fit in mla_gluon.STAGES_FIT.items() for st in fit]
TILES += [("fp8e4nv", bn, st) for bn, fit in mla_gluon.STAGES_FIT_FP8.items() for st in fit]
PIPE_TILES = [("bf16", bn, st) for bn, fit in mla_gluon.STAGES_FIT.items() for st in fit]
PIPE_TILES += [("fp8e4nv", 32, st) for st in mla_gluon.STAGES_FIT_FP8_PIPE[32]]


def compile_sm90(block_n: int, stages: int, final: bool, dtype: str = "bf16", pipe=False):
    """``triton.compile`` of ``mla_gluon_decode_kernel`` for sm_90 with the launcher's
    constants (pointers and row strides 16-divisible, as a pool's buffers are)."""
    from kvpool.triton_kernels.mla_gluon import mla_gluon_decode_kernel as fn
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = dict(DL=512, DR=64, BLOCK_N=block_n, STAGES=stages, FINAL=final, PIPE=pipe)
    ptrs = dict(Q="*bf16", KV="*" + dtype, KSC="*fp32", PT="*i32", SEQ="*i32", OUT="*bf16",
                PO="*fp32", PL="*fp32")  # fmt: skip
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
            if n.startswith("stride") and n != "stride_pt":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn, sig, consts, attrs)
    opts = {"num_warps": mla_gluon.NUM_WARPS}
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


@pytest.mark.parametrize("final", [True, False], ids=["final", "splits"])
@pytest.mark.parametrize("dtype, block_n, stages", TILES, ids=lambda x: str(x))
def test_tiles_compile_without_spills(dtype, block_n, stages, final):
    k = compile_sm90(block_n, stages, final, dtype)
    r = resources(k)
    assert r["REG"] <= 255 and r["STACK"] == 0 and r["LOCAL"] == 0, r
    assert k.metadata.shared <= SMEM_MAX, k.metadata.shared
    # the model: Q + the ring (+ fp8's fp16 tile) + P, plus a little compiler scratch (the
    # row reductions)
    fp8 = dtype.startswith("fp8")
    ring = stages * block_n * 576 * (1 if fp8 else 2) + (block_n * 576 * 2 if fp8 else 0)
    model = 64 * 576 * 2 + ring + 64 * block_n * 2
    assert model <= k.metadata.shared <= model + 2048, (k.metadata.shared, model)
    ptx = k.asm["ptx"]
    op = "f16" if fp8 else "bf16"
    wg = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.{op}\.{op}", ptx)
    assert wg.count(f"m64n{block_n // 2}k16") == 576 // 16, sorted(set(wg))
    assert wg.count("m64n256k16") == block_n // 16, sorted(set(wg))
    assert "cp.async.cg.shared.global" in ptx
    if dtype == "fp8e4nv":  # every cache byte of the tile widened once: 144 a thread
        assert ptx.count("cvt.rn.f16x2.e4m3x2") == block_n * 576 // 256 // 2


@pytest.mark.parametrize("final", [True, False], ids=["final", "splits"])
@pytest.mark.parametrize("dtype, block_n, stages", PIPE_TILES, ids=lambda x: str(x))
def test_pipelined_tiles_compile_without_spills(dtype, block_n, stages, final):
    """``PIPE``: the scores' two MMAs and tile i - 1's P V asynchronous, waited down to one
    group (the scores) and then none; fp8 holds two widened tiles."""
    k = compile_sm90(block_n, stages, final, dtype, pipe=True)
    r = resources(k)
    assert r["REG"] <= 255 and r["STACK"] == 0 and r["LOCAL"] == 0, r
    assert k.metadata.shared <= SMEM_MAX, k.metadata.shared
    fp8 = dtype.startswith("fp8")
    ring = stages * block_n * 576 * (1 if fp8 else 2) + (2 * block_n * 576 * 2 if fp8 else 0)
    model = 64 * 576 * 2 + ring + 64 * block_n * 2
    assert model <= k.metadata.shared <= model + 2048, (k.metadata.shared, model)
    ptx = k.asm["ptx"]
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 1
    assert "isAsync = true" in k.asm["ttgir"]


@pytest.mark.parametrize("dtype", ["fp16", "fp8e5"])
def test_other_caches_compile(dtype):
    k = compile_sm90(*mla_gluon.DEFAULT_TILE, False, dtype)
    r = resources(k)
    assert r["REG"] <= 255 and r["STACK"] == 0 and r["LOCAL"] == 0, r
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in k.asm["ptx"]


def test_a_ring_too_large_is_refused_by_the_planner():
    """64-token tiles with 3 stages would need 296 KiB: the planner's table stops at 2."""
    assert 64 * 576 * 2 + 3 * 64 * 576 * 2 + 64 * 64 * 2 > SMEM_MAX
    assert mla_gluon.STAGES_FIT[64] == (2,)
