# ruff: noqa: E501  (the patch strings must match decode.py line for line)
"""Probe variants of the decode kernel, built from ``triton_kernels/decode.py`` at run time.

Each variant is the shipped kernel's source with one small textual change, written to a
temporary file and imported (``@triton.jit`` reads the source of a real file), so the probes
always measure the current kernel plus exactly one change:

- ``head_fast``: program ids ``(kv_head, request, split)`` instead of ``(request, kv_head,
  split)``: the programs reading the 8 heads of one page run side by side (DRAM page locality).
- ``page_ahead``: the page ids of tile ``i + 1`` are loaded during tile ``i`` (a loop-carried
  register), so the K/V loads no longer wait on a load of their own iteration and Triton's
  pipeliner keeps ``num_stages - 1`` K/V tiles in flight through ``cp.async`` (without it the
  page-id load takes a pipeline stage and the ring stays at one tile ahead).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import kvpool.triton_kernels.decode as shipped

_DIR = Path(tempfile.mkdtemp(prefix="kvpool_probe_"))


def _patch(src: str, old: str, new: str, count: int = 1) -> str:
    if src.count(old) < count:
        raise RuntimeError(f"probe patch no longer applies to decode.py: {old[:60]!r}")
    return src.replace(old, new, count)


def _head_fast(src: str) -> str:
    src = _patch(
        src,
        "    SWAP: tl.constexpr = False,\n):",
        "    SWAP: tl.constexpr = False,\n    HF: tl.constexpr = False,\n):",
    )
    src = _patch(
        src,
        "    b = tl.program_id(0)\n    hk = tl.program_id(1)\n    split",
        "    if HF:\n        b = tl.program_id(1)\n        hk = tl.program_id(0)\n        nhk = tl.num_programs(0)\n"
        "    else:\n        b = tl.program_id(0)\n        hk = tl.program_id(1)\n        nhk = tl.num_programs(1)\n    split",
    )
    return _patch(
        src, "row = (b * (G * tl.num_programs(1)) + heads)", "row = (b * (G * nhk) + heads)"
    )


_PA_LOOP_OLD = """        for s in range(start, end, BLOCK_N):
            t = s + tl.arange(0, BLOCK_N)
            tm = t < end
            page = tl.load(pt_row + (t >> page_shift), mask=tm, other=0)
            slot = page.to(tl.int64) * (page_mask + 1) + (t & page_mask)
            kx, ks = load_raw(K, KBS, slot, tm, hk, stride_kr, stride_kbr, D, FMT, ASM)"""
_PA_LOOP_NEW = """        t0 = start + tl.arange(0, BLOCK_N)
        page_a = tl.load(pt_row + (t0 >> page_shift), mask=t0 < end, other=0)
        for s in range(start, end, BLOCK_N):
            t = s + tl.arange(0, BLOCK_N)
            tm = t < end
            page = page_a
            t1 = t + BLOCK_N
            page_a = tl.load(pt_row + (t1 >> page_shift), mask=t1 < end, other=0)
            slot = page.to(tl.int64) * (page_mask + 1) + (t & page_mask)
            kx, ks = load_raw(K, KBS, slot, tm, hk, stride_kr, stride_kbr, D, FMT, ASM)"""
_PA_PLAIN_OLD = """            else:
                page = tl.load(pt_row + (t >> page_shift), mask=tm, other=0)
                slot = page.to(tl.int64) * (page_mask + 1) + (t & page_mask)"""
_PA_PLAIN_NEW = """            else:
                page = page_a
                t1 = t + BLOCK_N
                page_a = tl.load(pt_row + (t1 >> page_shift), mask=t1 < end, other=0)
                slot = page.to(tl.int64) * (page_mask + 1) + (t & page_mask)"""
_PA_PRE_OLD = """            page_next = tl.load(pt_row + (t1 >> page_shift), mask=t1 < end, other=0)

        for s in range(start, end, BLOCK_N):"""
_PA_PRE_NEW = """            page_next = tl.load(pt_row + (t1 >> page_shift), mask=t1 < end, other=0)
        else:
            t0 = start + tl.arange(0, BLOCK_N)
            page_a = tl.load(pt_row + (t0 >> page_shift), mask=t0 < end, other=0)

        for s in range(start, end, BLOCK_N):"""


def _page_ahead(src: str) -> str:
    src = _patch(src, _PA_LOOP_OLD, _PA_LOOP_NEW)  # transposed-dot loop (fp8, 16-bit)
    src = _patch(src, _PA_PRE_OLD, _PA_PRE_NEW)  # untransposed loop (FP4): prologue
    return _patch(src, _PA_PLAIN_OLD, _PA_PLAIN_NEW)


_BUILD = {"head_fast": _head_fast, "page_ahead": _page_ahead}


def module(name: str):
    """The kernel module of variant ``name`` (``shipped`` for the unchanged kernel)."""
    if name == "shipped":
        return shipped
    path = _DIR / f"decode_{name}.py"
    path.write_text(_BUILD[name](Path(shipped.__file__).read_text()))
    spec = importlib.util.spec_from_file_location(f"kvpool_probe_decode_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Launcher:
    """``kernel[grid](...)`` with the variant's grid order and flag."""

    def __init__(self, kernel, swap_grid: bool, **flags):
        self.kernel, self.swap_grid, self.flags = kernel, swap_grid, flags

    def __getitem__(self, grid):
        if self.swap_grid:
            grid = (grid[1], grid[0], *grid[2:])
        f = self.kernel[grid]
        return lambda *a, **kw: f(*a, **self.flags, **kw)


def use(name: str) -> None:
    """Make ``kvpool.attention.decode`` launch variant ``name`` (it imports the kernel module
    at each call)."""
    mod = module(name)
    shim = type(sys)("kvpool.triton_kernels.decode")
    if name == "head_fast":
        shim.decode_kernel = _Launcher(mod.decode_kernel, True, HF=True)
    elif name == "page_ahead":
        shim.decode_kernel = _Launcher(mod.decode_kernel, False)
    else:
        shim.decode_kernel = mod.decode_kernel
    shim.merge_kernel = shipped.merge_kernel
    sys.modules["kvpool.triton_kernels.decode"] = shim
