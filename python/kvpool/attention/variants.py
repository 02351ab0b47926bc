"""Which kernel variant runs a layer.

The Gluon decode kernels' fit and device checks, the word-level (inline PTX) decode, the
measured per-dtype variant tables, and tile limits.
"""

from __future__ import annotations

import functools
import os
import re
from typing import TYPE_CHECKING

from kvpool._torch import torch
from kvpool.attention._common import _FP4, _interpreting, _pow2

if TYPE_CHECKING:
    from kvpool.pool import LayerView


def _asm_ok(view: LayerView) -> bool:
    """Whether the word-level decode applies to ``view``.

    FP4 and fp8 caches whose K/V rows start on 4-byte boundaries: the kernels load rows as int32
    words. A pool's buffers always qualify; a view sliced from a larger buffer may not, and then
    takes the byte-wise path.
    """
    return view.dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16") and all(
        t.stride(0) * t.element_size() % 4 == 0 and t.data_ptr() % 4 == 0 for t in (view.k, view.v)
    )


#: Triton releases the Gluon decode kernel is compiled and tested with (major, minor). Gluon is
#: experimental and its API moves: Triton 3.9 removed ``async_copy_global_to_shared`` (the e4m3
#: ring then fails to compile, a CompilationError at the first decode), so other releases take
#: the Triton kernel until the Gluon one is checked there.
GLUON_TRITON = ((3, 6),)


#: Largest query group the Gluon decode kernels run at each head_dim (K and V alike), as
#: compiled for sm_90 with Triton 3.6 (``tests/test_gluon_compile.py`` checks registers <= 255
#: without spills and shared memory): head_dim 256 with a group of 9..16 needs 255 registers
#: and spills (136-248 bytes a thread) for e5m2 and FP4, so those layers take the Triton
#: kernel; no bundled model has one (Qwen3.5 and gemma-2: groups 2..8).
_GLUON_GROUPS = {64: 16, 128: 16, 256: 8}

#: Environment switch: ``KVPOOL_GLUON_WIDE=0`` sends every layer but head_dim 128 with a group
#: of <= 8 (the measured Gluon path) to the Triton kernel, for side-by-side runs; per plan,
#: ``plan_decode(..., gluon=False)`` does the same for one layer.
GLUON_WIDE_ENV = "KVPOOL_GLUON_WIDE"


def _gluon_base(view: LayerView, group: int) -> bool:
    """Whether ``view`` is the Gluon kernels' measured geometry (head_dim 128, group <= 8).

    Its tuned parameters (``_GLUON_CONFIG``) stay as they are.
    """
    return view.head_dim == 128 and group <= 8


def _gluon_kernel_name(view: LayerView, group: int) -> str:
    """``plan.kernel`` of a Gluon plan.

    ``gluon_fp8`` / ``gluon_fp4`` at head_dim 128 with a group of <= 8, else with ``_hd64`` /
    ``_hd256`` and ``_g16`` (groups of 9..16: 16-wide PV dots) appended.
    """
    if view.dtype in _GLUON_16BIT:
        name = f"gluon_{view.dtype}"
    else:
        name = "gluon_fp4" if view.dtype in _FP4 else "gluon_fp8"
    if view.head_dim != 128:
        name += f"_hd{view.head_dim}"
    return name + ("_g16" if group > 8 else "")


def _gluon_programs_per_sm(view: LayerView, group: int) -> int:
    """Programs per multiprocessor in the split model of a Gluon plan.

    ``_GLUON_CONFIG``'s at the measured geometry; elsewhere what the registers of the
    slowest-fitting dtype allow (65,536 per SM, 8-register steps; sm_90 Triton 3.6 builds,
    ``tests/test_gluon_compile.py``): head_dim 64 85-127 registers, capped at 16 as run 7's fp8
    model; head_dim 128 with 16-wide dots 168-202: 9; head_dim 256 207-236: 8. Not measured
    on a GPU yet.
    """
    if _gluon_base(view, group):
        return _GLUON_CONFIG[view.dtype][1]
    return _GLUON_PER_SM[view.head_dim]


def _gluon_config(dtype: str) -> tuple:
    """``(ring stages, programs per SM, register cap)`` of the Gluon kernel for ``dtype``."""
    return _GLUON_16BIT[dtype] if dtype in _GLUON_16BIT else _GLUON_CONFIG[dtype]


_GLUON_PER_SM = {64: 16, 128: 9, 256: 8}


def _gluon_unfit(view: LayerView, group: int) -> str | None:
    """Why the Gluon decode kernel cannot run ``view`` (a phrase), or None when it can.

    It needs fp8 or FP4 caches (bf16 and fp16 at head_dim 64 only: ``_GLUON_16BIT``), K and V
    head_dim 64, 128 or 256 (alike), a query group of
    1..16 heads (1..8 at head_dim 256: ``_GLUON_GROUPS``), rows whose start and stride are
    multiples of 16 bytes with each head's ``head_dim`` (fp8) or ``head_dim / 2`` (FP4) bytes
    contiguous (128-bit loads), FP4 block scales 2-byte aligned with a head's ``head_dim / 16``
    contiguous (FP4 at head_dim 256 also pages of >= 16 tokens and 16-byte aligned scale rows:
    its ring; register prefetch would spill), ``KVPOOL_GLUON_WIDE`` not 0 outside head_dim 128
    with a group of <= 8, and :func:`_gluon_device_unfit`'s device and Triton. The layout
    checks come first, so they are named (and testable) on any device.
    """
    hd = view.head_dim
    if view.dtype in _GLUON_16BIT:
        if hd != 64 or view.v_head_dim != 64:
            return (
                f"{view.dtype} caches at head_dim {hd} / v_head_dim {view.v_head_dim} (64 only; "
                f"{', '.join(_GLUON_CONFIG)} at 64, 128 and 256)"
            )
    elif view.dtype not in _GLUON_CONFIG:
        return f"{view.dtype} caches ({', '.join(_GLUON_CONFIG)} only)"
    if hd != view.v_head_dim or hd not in _GLUON_GROUPS:
        return f"head_dim {hd} / v_head_dim {view.v_head_dim} (64, 128 or 256, K and V alike)"
    if not 1 <= group <= _GLUON_GROUPS[hd]:
        return f"a query group of {group} heads (1..{_GLUON_GROUPS[hd]} only at head_dim {hd})"
    if not _gluon_base(view, group) and os.environ.get(GLUON_WIDE_ENV, "1") == "0":
        return f"head_dim {hd} with a group of {group} while {GLUON_WIDE_ENV}=0"
    row = hd // 2 if view.dtype in _FP4 else hd
    for t in (view.k, view.v):
        if t.stride(0) % 16 or t.data_ptr() % 16 or t.stride(2) != 1 or t.stride(1) != row:
            return (
                f"K/V rows not 16-byte aligned or a head's {row} bytes not contiguous (address "
                f"{t.data_ptr()} mod 16 = {t.data_ptr() % 16}, strides {tuple(t.stride())})"
            )
    nb = hd // 16
    for t in (view.k_block_scale, view.v_block_scale):
        # FP4: lanes read a head's hd / 16 scale bytes in pairs ([R, H, hd / 16] or flat rows)
        if t is not None and (
            t.stride(0) % 2
            or t.data_ptr() % 2
            or t.stride(-1) != 1
            or (t.dim() == 3 and t.stride(1) != nb)
        ):
            return (
                f"block scale rows not 2-byte aligned or a head's {nb} bytes not contiguous "
                f"(address {t.data_ptr()}, strides {tuple(t.stride())})"
            )
        if t is not None and hd == 256 and (t.stride(0) % 16 or t.data_ptr() % 16):
            return (
                f"FP4 block scale rows not 16-byte aligned at head_dim 256 (address "
                f"{t.data_ptr()}, strides {tuple(t.stride())}; its cp.async ring needs them)"
            )
    if view.dtype in _FP4 and hd == 256 and view.page_size < 16:
        return f"an FP4 cache of page_size {view.page_size} at head_dim 256 (pages >= 16 only)"
    return _gluon_device_unfit(view.k.device)


def _gluon_device_unfit(device: torch.device) -> str | None:
    """Why the Gluon decode kernel cannot run on ``device`` (a phrase), or None.

    An NVIDIA GPU (not ROCm: the kernel is inline PTX) of compute capability 8.9 or newer (the
    ``cvt.rn.f16x2.e4m3x2`` conversion), never the CPU interpreter, and a Triton release in
    :data:`GLUON_TRITON` whose Gluon imports.
    """
    if device.type != "cuda" or _interpreting():
        return "a CPU tensor or the Triton interpreter (CUDA only)"
    return _gluon_cuda_unfit(_cuda_index(device))


def _cuda_index(device: torch.device) -> int:
    """The GPU index of CUDA ``device`` (the current GPU when it names none)."""
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    """CUDA ``device``'s compute capability, cached per GPU (decode asks on every call)."""
    return _capability_of(_cuda_index(device))


@functools.cache
def _gluon_cuda_unfit(index: int) -> str | None:
    """The CUDA half of :func:`_gluon_device_unfit` for GPU ``index``, cached per GPU.

    The answer cannot change within a process, and ``decode`` asks on every call (once per layer).
    """
    if torch.version.hip is not None:
        return "a ROCm GPU (the kernel is NVIDIA PTX)"
    if torch.cuda.get_device_capability(index) < (8, 9):
        return "a GPU older than compute capability 8.9"
    import triton

    ver = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    if ver not in GLUON_TRITON:
        have = ", ".join(f"{a}.{b}" for a, b in GLUON_TRITON)
        return f"Triton {triton.__version__} (checked with Triton {have} only)"
    try:
        import kvpool.triton_kernels.decode_gluon  # noqa: F401
    except ImportError:
        return "a Triton without Gluon"
    return None


# Split model of the Gluon decode kernel with its 3-stage cp.async ring (126 registers x 32
# threads, 13 KiB of shared memory: 16 programs per SM; 12 since run 8, below), fitted to run 7
# on the H200
# (``results/run7_h200/gluon_ring/call10_ring_check_and_sweep.json``): B=64/8k 3 splits
# 0.286 ms, 4 (2,048 programs, one wave): 0.289, 6: 0.304; B=128/8k 2: 0.558, 3 (1.45 waves):
# 0.638, 4: 0.560; and a program costs ~256 tokens besides its own (q, page ids, the partial
# output): many short splits lose (with register prefetch, B=64/8k 10 splits: 0.332 ms, 14:
# 0.323 vs 3: 0.298).
# e5m2 with the ring needs 137 registers (14 programs per SM, so the 4 splits of this model at
# B=64/8k took two waves: 0.319-0.329 ms; 3 splits were not measured); it keeps the measured
# register prefetch (STAGES=0, 138 registers, 12 programs per SM in the model), call 9's grid
# and key sections (``results/run7_h200/gluon/attention.json``, ``stdout.txt``): B=64/8k
# 0.297-0.300 ms (1.66x SDPA), B=128/8k 0.581-0.584, B=16/8k 0.088-0.089.
# dtype -> (ring stages, 0 = register prefetch; programs per SM in the split model; register
# cap per thread, ptxas ``.maxnreg``, None: none)
# nvfp4 (``decode_gluon_fp4.py``): a 2-stage ring of two 16-token tiles a stage, data by TMA
# (140 registers, 9 KiB of shared memory), split model of 12 programs per SM: run 9
# (``results/run9_h200/NOTES.md``), B=64/8k: 3 splits 0.216 ms, 4: 0.222, 2: 0.226; 3 stages
# 0.223, one tile a stage 0.227-0.232, run 8's cp.async ring of 3 single tiles 0.240-0.245.
# Run 8 (call 9): with the head-fast grid 3 splits beat 4 at B=64/8k for both fp8 dtypes, so
# e4m3's model counts 12 programs per SM as well (3 splits there); call 12: e5m2 with the ring
# at 3 splits 0.274 ms vs register prefetch 0.278 (1.80x vs 1.78x SDPA), so it takes the ring.
# fp4_mx_block16 (decode_gluon_fp4.py with DEC 2: bf16 operands) as nvfp4.
# Register caps (run 11, ``results/run11_h200/NOTES.md``): 128 on FP4 / e5m2 and 112 on e4m3
# (16-18 programs per SM, no spills) with the split count that fills them were equal or slower
# at every measured shape but nvfp4 B=64/8k page 16 (215.6 vs 218.6 us, lost at page 64) and
# nvfp4 and e4m3 at B=128/4k (-0.3%, -1.8%); fp8 at 4 splits 5% slower. So none is set; probes
# may set one.
_GLUON_CONFIG = {
    "fp8_e4m3": (3, 12, None),
    "fp8_e5m2": (3, 12, None),
    "nvfp4": (2, 12, None),
    "fp4_mx_block16": (2, 12, None),
}
# nvfp4 nibble decode (K, V): 0 = integer bit moves, 1 = via e4m3 bytes and cvt; the same speed
# in run 8 (0.287-0.289 ms at 4 splits, every pair); 1 (fewer integer instructions) stays, 0 is
# kept for the record (both matched the Triton kernel there)
_GLUON_FP4_DEC = (1, 1)
# FP4 kernel options: (KV head fastest in the grid, so a request's heads read their shared token
# rows and scale sectors side by side: run 8, 0.273 -> 0.251 ms at B=64/8k; ablate 1 = the
# loads without the math, probes only, wrong results; the ring's data tiles by TMA on sm_90+
# (run 9: B=64/8k 0.231 vs 0.240 ms, B=128/4k 0.233 vs 0.278; loads alone 0.177 vs 0.244);
# 16-token tiles per ring stage allowed, 1 or 2: ``_gluon_plan`` picks).
_GLUON_FP4_OPTIONS = (True, 0, True, 2)
# fp8 kernel options per dtype: (one page id per 16-aligned tile where page_size >= 16; lazy
# softmax rescale threshold in log2 units, < 0: every tile; KV-head-fast grid). Run 8 call 9
# (``results/run8_h200/call9_fp8_diet.json``, B=64/8k, 3 splits, SDPA 0.492 ms): e4m3 run 7's
# addressing 0.287 ms, one page id per tile 0.285, + head-fast grid 0.272 (1.81x SDPA), + lazy
# rescale 0.273 (136 registers instead of 128, so kept eager); e5m2 0.303 -> 0.292 -> lazy 0.282
# -> head-fast 0.277 (1.78x). 4 splits were slower in every pair (0.287-0.386).
_GLUON_FP8_OPTIONS = {"fp8_e4m3": (True, -1.0, True), "fp8_e5m2": (True, 8.0, True)}
# 16-bit caches in decode_gluon.py (``WIDE``: the words are the MMA operands, no decode), at
# head_dim 64 only (gpt-oss: the Triton kernel reached 0.87x SDPA there, run 12): a 3-stage
# cp.async ring of 2 KiB tiles (96 registers, 12 KiB: 16 programs per SM in the split model);
# at 128 the Triton kernel stays (the measured default, 0.95x), at 256 a tile is 8 KiB (a
# 3-stage ring of 48 KiB: 4 programs per SM) and the Triton kernel is at 1.00-1.08x. Options
# as e4m3's (eager rescale, one page id per tile, head-fast grid). Not measured on a GPU yet.
_GLUON_16BIT = {"bf16": (3, 16, None), "fp16": (3, 16, None)}
_GLUON_FP8_OPTIONS.update(bf16=(True, -1.0, True), fp16=(True, -1.0, True))
_GLUON_OVERHEAD = 256


# Where the word-level decode is the default (``asm=None``), per kernel, as measured on the
# H200 (benches/attention/results): FP4 decode went from 0.721 ms to 0.489 ms at B=64/8k (run 4).
# Run 5: fp8 decode 0.426 -> 0.410 ms at B=64/8k; FP4 extend (4k prefix + 512 new, B=16) 3.71 ->
# 2.11 ms with 128-token tiles; fp8 extend was slower with it (2.08 -> 2.13 ms).
_ASM_DEFAULT = {
    "decode": ("fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16"),
    "extend": ("nvfp4", "fp4_mx_block16"),
}
# Decode with transposed dots by default (``swap``), run 5 at B=64/8k: bf16 0.525 -> 0.506 ms,
# fp8 0.410 -> 0.402 ms; FP4 and fp32 were slower with it.
_SWAP_DEFAULT = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")

#: Largest ``group_pad`` :func:`plan_decode` accepts beyond a group's own power of two. Padding
#: exists to reach a tensor-core tile's row count (16 for untransposed dots, 8 transposed; 64 per
#: Hopper warpgroup MMA), and 256 rows (four 64-row warpgroup tiles) covers every shape worth
#: trying. Past it the rows are pure padding: the kernel keeps a ``[group_pad, head_dim]`` fp32
#: accumulator and a ``[group_pad, block_n]`` score tile per program in registers, so 512 rows of
#: 128-wide heads are 256 KiB of accumulator alone, an H200 multiprocessor's whole register file
#: (65,536 x 4 B; 512 registers per thread at 4 warps, past ptxas' cap of 255): spills, or a
#: failed compile where the dot operands are staged in shared memory (227 KiB per block).
GROUP_PAD_MAX = 256


def _asm_default(view: LayerView, kernel: str) -> bool:
    return view.dtype in _ASM_DEFAULT[kernel] and _asm_ok(view)


def _asm_mode(asm: bool) -> int:
    """Kernel ``ASM`` constant: 0 off, 1 inline PTX, 2 its plain-Triton emulation.

    The CPU interpreter cannot run PTX, so it runs the emulation.
    """
    return (2 if _interpreting() else 1) if asm else 0


def _min_block_n(dtype: str) -> int:
    """Shortest KV tile the GPU kernels run for ``dtype`` (see :func:`_check_fp4_tile`)."""
    return 32 if dtype in _FP4 else 16


def _check_fp4_tile(view: LayerView, block_n: int) -> None:
    """Refuse FP4 KV tiles shorter than 32 tokens on the GPU (ValueError).

    16-token FP4 tiles gave wrong decode outputs on the H200 (Triton 3.6: relative error 2-3,
    with 1 and 4 warps, with and without the word decode and transposed dots, head_dim 64 and
    128); 32-token and larger tiles are exact (run 6, benches/attention/results/run6_h200,
    ``variant_row_offsets/call5_*``, ``call6_*``). Extend was not tried at 16 tokens; its plans
    are refused too, as a precaution. The CPU interpreter runs them correctly, so it may. Checked
    when planning and again at launch (a plan may come from another layer's view).
    """
    if block_n < _min_block_n(view.dtype) and view.k.is_cuda and not _interpreting():
        raise ValueError(
            f"`block_n` = {block_n}: {view.dtype} caches need KV tiles of at least 32 tokens on "
            "the GPU (16-token FP4 decode tiles gave wrong results with Triton 3.6 on the H200)"
        )


def _head_factor(view: LayerView) -> int:
    """How many times wider than 128 the widest head is (a power of two, at least 1).

    The measured tile defaults are for head_dim 128; the K/V tiles a program keeps in shared
    memory (227 KiB per block on the H100/H200) and its accumulator in registers grow with
    head_dim, so wider heads (Gemma-2's 256, MLA's 576) take tiles that many times shorter and
    two pipeline stages.
    """
    return max(1, _pow2(max(view.head_dim, view.v_head_dim)) // 128)
