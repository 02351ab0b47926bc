"""Fused paged attention over the (quantized) KV cache: launchers, plans, and a torch reference.

Two entry points, each with a Triton path (the fused kernels in ``kvpool.triton_kernels.decode``
/ ``.extend``: K/V read straight from the paged cache and dequantized in registers) and a torch
reference path (dequantize with :mod:`kvpool.formats`, then attention in fp32):

- :func:`decode`: one new query token per request, ``q [B, H_q, D]``.
- :func:`extend`: prefill with a cached prefix, ragged ``q [T, H_q, D]`` (``cu_seqlens_q``).

Shapes and layouts (``R`` rows = token slots, ``slot = page * page_size + offset``, page 0 is the
padding page; ``H`` KV heads, ``G = H_q / H`` query heads per KV head):

- ``view``: a :class:`kvpool.pool.LayerView` (``k``/``v`` ``[R, H, D]`` in the cache dtype, or
  ``[R, H, D/2]`` uint8 for FP4; block scales nvfp4 ``[R, H, D/16]`` e4m3, mx ``[R, H*D/16]``
  uint8; per-tensor ``k_scale``/``v_scale`` ``[1]`` fp32 for fp8 and the nvfp4 global scale).
- ``page_table``: ``[B, max_pages]`` int32 page ids; entries past ``ceil(seq_len / page_size)``
  are never read, so they may hold anything.
- ``seq_lens``: ``[B]`` int32, tokens in the cache per request (new tokens included), >= 1.

Semantics: ``softmax(sm_scale * q . k)`` over the request's tokens, with optional
soft-capping (logits become ``softcap * tanh(logits / softcap)``, Gemma 2), a sliding window
(a query at position ``p`` sees positions ``p - window + 1 .. p``, i.e. the last ``window``
tokens including itself; gpt-oss/Gemma ``sliding_window``), and attention sinks (one logit per
query head, natural-log units, added to the softmax denominator only; gpt-oss).

Nothing here forces a host sync on the GPU path: shapes drive the launch, device scalars (fp8
scales, nvfp4 global scales) are read inside the kernels. Plans (:func:`plan_decode`,
:func:`plan_extend`) hold what depends on the batch but not on the layer and are reused by every
layer of a forward step.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvpool import formats
from kvpool._args import as_index
from kvpool._torch import torch

if TYPE_CHECKING:
    from kvpool.pool import LayerView

__all__ = [
    "DecodePlan",
    "ExtendPlan",
    "decode",
    "extend",
    "plan_decode",
    "plan_extend",
    "reference_decode",
    "reference_extend",
]

Backend = Literal["auto", "triton", "torch"]

# dtype -> (kernel format code, compute dtype of the dots, has per-tensor scale, FP4 factor)
_KERNEL_FORMAT = {
    "fp32": (0, torch.float32, False, 1.0),
    "bf16": (0, torch.bfloat16, False, 1.0),
    "fp16": (0, torch.float16, False, 1.0),
    "fp8_e4m3": (1, torch.float16, True, 1.0),
    "fp8_e5m2": (1, torch.float16, True, 1.0),
    "nvfp4": (2, torch.float16, True, 64.0),
    "fp4_mx_block16": (3, torch.bfloat16, False, 1.0),
}
_STORAGE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "nvfp4": torch.uint8,
    "fp4_mx_block16": torch.uint8,
}
_FP4 = ("nvfp4", "fp4_mx_block16")
_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SM_COUNT: dict[int, int] = {}


# ----------------------------------------------------------------------------- checks


def _check(name: str, t, *, shape=None, dtype=None, device=None, ndim=None) -> torch.Tensor:
    """Raise ValueError naming ``name`` unless ``t`` has this shape/dtype/device.

    ``None`` entries of ``shape`` match anything.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"`{name}` must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(
            s is not None and s != a for s, a in zip(shape, t.shape, strict=True)
        ):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"`{name}` must have shape {want}, got {list(t.shape)}")
    if dtype is not None:
        ok = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in ok:
            raise ValueError(f"`{name}` must be {' or '.join(map(str, ok))}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"`{name}` is on {t.device}, expected {device}")
    return t


def _check_view(view: LayerView) -> None:
    if view.v is None:
        raise ValueError(
            f"`view` (layer {view.layer}) is an MLA layer: fused MLA attention is not supported"
        )
    if view.dtype not in _KERNEL_FORMAT:
        raise ValueError(
            f"`view.dtype` = {view.dtype!r} is not a KV dtype ({', '.join(_KERNEL_FORMAT)})"
        )
    fp4 = view.dtype in _FP4
    h, d, dv = view.num_kv_heads, view.head_dim, view.v_head_dim
    want = _STORAGE[view.dtype]
    _check("view.k", view.k, shape=[None, h, d // 2 if fp4 else d], dtype=want)
    _check("view.v", view.v, shape=[view.k.shape[0], h, dv // 2 if fp4 else dv], dtype=want)
    for name, t in (("view.k", view.k), ("view.v", view.v)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"`{name}` must be contiguous within a row (strides {t.stride()})")
    if fp4:
        if view.k_block_scale is None or view.v_block_scale is None:
            raise ValueError(f"`view` is {view.dtype} but has no block scales")
        for name, t, dd in (
            ("view.k_block_scale", view.k_block_scale, d),
            ("view.v_block_scale", view.v_block_scale, dv),
        ):
            if (
                t.shape[0] != view.k.shape[0]
                or t[0].numel() != h * dd // 16
                or not t.is_contiguous()
            ):
                raise ValueError(
                    f"`{name}` must hold {h * dd // 16} contiguous scales per row, "
                    f"got shape {list(t.shape)}"
                )
    if _KERNEL_FORMAT[view.dtype][2] and (view.k_scale is None or view.v_scale is None):
        raise ValueError(f"`view` is {view.dtype} but has no k_scale/v_scale")
    for name, n in (("head_dim", d), ("v_head_dim", dv)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"`view.{name}` = {n}: the kernels need a power of two >= 16")
    ps = view.page_size
    if ps < 1 or ps & (ps - 1):
        raise ValueError(f"`view.page_size` = {ps}: the kernels need a power of two")


def _group(view: LayerView, num_q_heads: int) -> int:
    h = view.num_kv_heads
    if num_q_heads % h:
        raise ValueError(f"`q` has {num_q_heads} heads, not a multiple of the {h} KV heads")
    return num_q_heads // h


def _positive_real(name: str, value) -> float:
    """``value`` as a finite float > 0, else ValueError naming ``name`` and the value.

    Accepts Python and numpy ints and floats; rejects bools (``float(True)`` is 1.0), strings
    (``float("2")`` is 2.0), tensors and other non-numbers, NaN, infinities and values <= 0.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` = {value!r}: must be a finite number > 0")
    try:
        s = float(value)
    except (OverflowError, ValueError):
        s = math.inf
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"`{name}` = {value!r}: must be finite and > 0")
    return s


def _sm_scale(sm_scale, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _positive_real("sm_scale", sm_scale)


#: Largest window passed on (the kernels take it as int32; seq_lens are int32, so a longer
#: window is no window).
_WINDOW_MAX = (1 << 31) - 1


def _check_options(window, softcap, sinks, num_q_heads: int, device):
    """Checked ``(window, softcap)``: an int in ``1.._WINDOW_MAX`` and a float, or None.

    ``window`` takes Python and numpy ints (not bools, floats or strings); ``softcap`` as
    ``sm_scale`` (:func:`_positive_real`). ValueError names the argument and value.
    """
    if window is not None:
        try:
            w = as_index(window)
        except TypeError:
            raise ValueError(
                f"`window` = {window!r}: must be an int >= 1 (tokens, the query included) or None"
            ) from None
        if w < 1:
            raise ValueError(
                f"`window` = {w}: must be an int >= 1 (tokens, the query included) or None"
            )
        window = min(w, _WINDOW_MAX)
    if softcap is not None:
        softcap = _positive_real("softcap", softcap)
    if sinks is not None:
        _check("sinks", sinks, shape=[num_q_heads], device=device, dtype=_Q_DTYPES)
    return window, softcap


def _check_cu_seqlens(cu: torch.Tensor, rows: int | None) -> None:
    """``cu_seqlens_q`` (a CPU int tensor) non-decreasing from 0, ending at ``rows`` if given."""
    if len(cu) == 0:
        raise ValueError("`cu_seqlens_q` is empty: it needs B + 1 entries, from 0")
    if int(cu[0]) != 0:
        raise ValueError(f"`cu_seqlens_q[0]` = {int(cu[0])}: must be 0 (non-decreasing from 0)")
    drop = (cu[1:] < cu[:-1]).nonzero()
    if len(drop):
        i = int(drop[0, 0]) + 1
        raise ValueError(
            f"`cu_seqlens_q[{i}]` = {int(cu[i])} is less than `cu_seqlens_q[{i - 1}]` = "
            f"{int(cu[i - 1])}: must be non-decreasing"
        )
    if rows is not None and int(cu[-1]) != rows:
        raise ValueError(
            f"`cu_seqlens_q[{len(cu) - 1}]` = {int(cu[-1])}: must equal T = {rows}, the rows of `q`"
        )


def _check_batch(view, page_table, seq_lens, cu_seqlens_q=None, rows=None, window=None) -> None:
    """Check the values of a batch on the host; ValueError naming the first bad one.

    Reads the tensors (a host sync for device tensors: the CPU path always calls this, the GPU
    path with ``debug``). Decode (``cu_seqlens_q`` None): each ``seq_len >= 1``. Extend:
    ``cu_seqlens_q`` non-decreasing from 0 to ``rows`` (T) and ``seq_len >= q_len``; requests
    without new tokens are not read, so not checked. Both: ``seq_len`` within the page table
    and the page ids it reads in ``0 .. num_pages - 1`` (page 0 is the padding page: padded
    requests of a fixed-size batch read it, and get garbage).
    With a sliding ``window`` only pages holding a token some query sees are read (from
    ``seq_len - q_len + 1 - window`` on), so entries before them may hold anything (engines
    return pages that left the window; the kernels never touch them).
    """
    ps = view.page_size
    width = page_table.shape[1]
    num_pages = view.k.shape[0] // ps
    lens = seq_lens.cpu().long()
    if cu_seqlens_q is None:
        active = torch.ones_like(lens, dtype=torch.bool)
        short = (lens < 1).nonzero()
        if len(short):
            b = int(short[0, 0])
            raise ValueError(f"`seq_lens[{b}]` = {int(lens[b])}: decode needs at least one token")
    else:
        cu = cu_seqlens_q.cpu().long()
        _check_cu_seqlens(cu, rows)
        qlens = cu[1:] - cu[:-1]
        active = qlens > 0
        short = (active & (lens < qlens)).nonzero()
        if len(short):
            b = int(short[0, 0])
            raise ValueError(
                f"`seq_lens[{b}]` = {int(lens[b])} is shorter than its {int(qlens[b])} new tokens"
            )
    over = (active & (lens > width * ps)).nonzero()
    if len(over):
        b = int(over[0, 0])
        raise ValueError(
            f"`seq_lens[{b}]` = {int(lens[b])} exceeds the page table's {width} pages x "
            f"page_size {ps} = {width * ps} tokens"
        )
    need = torch.where(active, (lens + ps - 1) // ps, 0)  # pages each request reads
    first = torch.zeros_like(need)
    if window is not None:
        q_len = 1 if cu_seqlens_q is None else qlens
        first = (lens - q_len + 1 - window).clamp(min=0) // ps
    pt = page_table.cpu()
    col = torch.arange(width)[None, :]
    read = (col >= first[:, None]) & (col < need[:, None])
    # (page 0, the padding page, may be read: the padded requests of a fixed-size batch, e.g.
    # under a CUDA graph, point at it and their outputs are discarded)
    bad = (read & ((pt < 0) | (pt >= num_pages))).nonzero()
    if len(bad):
        b, i = int(bad[0, 0]), int(bad[0, 1])
        raise ValueError(
            f"`page_table[{b}, {i}]` = {int(pt[b, i])} is outside the pool's pages "
            f"0..{num_pages - 1} (request {b}, seq_len {int(lens[b])})"
        )


def _use_triton(backend: str, q: torch.Tensor) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"`backend` = {backend!r}: expected 'auto', 'triton' or 'torch'")
    if backend == "auto":
        return q.is_cuda
    return backend == "triton"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Most KV splits per request a decode plan takes (an explicit ``num_splits``; the planner never
# picks more than 256). The split merge walks them in steps of at most 256.
MAX_SPLITS = 1024


def _check_knob(name: str, value, lo: int, hi: int | None = None, pow2: bool = False) -> int:
    """``value`` as an int in ``lo..hi`` (a power of two if ``pow2``), else ValueError naming it.

    Accepts Python and numpy integers; rejects bools and non-integers (``16.0``, ``"16"``)
    instead of letting them fail deep in torch or Triton, or pass as 0/1.
    """
    try:
        value = as_index(value)
    except TypeError:
        raise ValueError(f"`{name}` = {value!r}: must be an int") from None
    if value < lo or (hi is not None and value > hi) or (pow2 and value & (value - 1)):
        what = "a power of two" if pow2 else "an int"
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"`{name}` = {value}: must be {what} {rng}")
    return value


# ----------------------------------------------------------------------------- plans


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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


def _gluon_unfit(view: LayerView, group: int) -> str | None:
    """Why the Gluon decode kernel cannot run ``view`` (a phrase), or None when it can.

    It needs fp8 or FP4 caches, K and V head_dim 128, a query group of 1..8 heads, rows whose
    start and stride are multiples of 16 bytes with each head's 128 (fp8) or 64 (FP4) bytes
    contiguous (128-bit loads), FP4 block scales 2-byte aligned with a head's 8 contiguous,
    and :func:`_gluon_device_unfit`'s device and Triton. The layout checks come first, so they
    are named (and testable) on any device.
    """
    if view.dtype not in _GLUON_CONFIG:
        return f"{view.dtype} caches ({', '.join(_GLUON_CONFIG)} only)"
    if view.head_dim != 128 or view.v_head_dim != 128:
        return f"head_dim {view.head_dim} / v_head_dim {view.v_head_dim} (128 only)"
    if not 1 <= group <= 8:
        return f"a query group of {group} heads (1..8 only)"
    row = 64 if view.dtype in _FP4 else 128
    for t in (view.k, view.v):
        if t.stride(0) % 16 or t.data_ptr() % 16 or t.stride(2) != 1 or t.stride(1) != row:
            return (
                f"K/V rows not 16-byte aligned or a head's {row} bytes not contiguous (address "
                f"{t.data_ptr()} mod 16 = {t.data_ptr() % 16}, strides {tuple(t.stride())})"
            )
    for t in (view.k_block_scale, view.v_block_scale):
        # nvfp4: lanes read a head's 8 scale bytes in pairs ([R, H, 8] or [R, H * 8] rows)
        if t is not None and (
            t.stride(0) % 2
            or t.data_ptr() % 2
            or t.stride(-1) != 1
            or (t.dim() == 3 and t.stride(1) != 8)
        ):
            return (
                f"block scale rows not 2-byte aligned or a head's 8 bytes not contiguous "
                f"(address {t.data_ptr()}, strides {tuple(t.stride())})"
            )
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


def default_splits(
    batch: int,
    kv_heads: int,
    max_seq_len: int,
    device: torch.device,
    block_n: int = 128,
    num_warps: int = 4,
    programs_per_sm: int | None = None,
    overhead: int | None = None,
) -> int:
    """KV splits per request for :func:`decode`.

    ``batch * kv_heads * splits`` programs run in waves of so many per multiprocessor: 3 for
    4-warp programs, 12 for 1-warp ones (what their registers and shared memory allow: 146
    registers x 128 threads, 66.5 KiB; 168 x 32, 17-18 KiB; other warp counts: 12 / warps,
    an extrapolation). Each split is rounded up to whole
    ``block_n`` tiles and costs about half a tile more (pipeline fill, partial output). The
    estimated time, waves x (tokens per split + block_n / 2), is minimized (fewest splits on
    ties). With at most 16 programs before splitting (one or two requests) the kernel is
    latency-bound: 4-warp programs take the most splits, at most 128 of at least 256 tokens;
    one-warp programs about ``2 * sqrt(B * kv_heads * max_seq_len)`` programs in all (each
    split's fixed cost, its partial output and its share of the merge, against tokens per
    program), at most one wave and at most 256 splits of at least 128 tokens. Splits are whole
    ``block_n`` tiles and none is empty (the count is what the tiles need).

    Measured on the H200 (benches/attention, 8 KV heads): 4 warps (run 5), B=16 at 8k: 3 splits
    (one wave; 2, 5 and 8 slower); B=1 at 32k: 128 (66, 32 slower). 1 warp, fp8_e4m3 with
    32-token tiles (run 6, ``results/run6_h200/call3_variants.json``): B=64/8k 3 splits 0.336 ms
    (4: 0.396 ms, 1.3 waves; 6 with 3 stages: 0.337; 12: 0.339), B=16/8k 12 splits 0.097 ms
    (3: 0.173, 6: 0.123, 24: 0.101); B=1/32k 256 splits of 16-token tiles 35.8 us (128 splits
    of 32-token tiles: 37.8, 256: 41.8). fp8 with 16-token tiles and 3 stages (run 7,
    ``results/run7_h200``): 16 programs per SM, B=64/8k 4 splits 0.325 ms (3: 0.338).
    One-warp programs at <= 16 programs per split, after the split merge's rewrite (run 10,
    ``results/run10_h200``, sweep of 3-5 split counts per point): B=1/32k 128 splits best
    (nvfp4 26.5 us vs 30.1 at 256; fp8_e4m3 33.1 vs 35.3), B=1/8k 64 (nvfp4 15.0, fp8 16.2),
    B=2/32k 64-128 (nvfp4 40.5, fp8 54.2-55.6), B=1/128k 256 (fp8 91.6 vs 99.7 at 128; nvfp4
    65.5 vs 66.3): 512, 1,024, ~1,500 and 2,048 programs, ``2 * sqrt(B * H * n)``. The
    one-wave cap binds at B=1/128k for the Gluon FP4 model (12 programs per SM: 196 splits,
    not measured; between 128 and 256, which were within 1.3%), not for fp8's 16 (256).

    Parameters
    ----------
    batch, kv_heads : int
        Requests and KV heads per rank (``batch * kv_heads`` programs per split).
    max_seq_len : int
        Longest request in tokens.
    device : torch.device
        Where the kernel runs (its multiprocessor count; 4 for a CPU device).
    block_n : int
        The plan's KV tile in tokens.
    num_warps : int
        The plan's warps per program (1 selects the one-warp limits above).
    programs_per_sm : int, optional
        Programs that fit on one multiprocessor, when known better than ``12 / num_warps``
        (the fp8 one-warp default with 16-token tiles and 3 stages: 128 registers x 32 threads,
        13 KiB of shared memory, so 16).
    overhead : int, optional
        What one program costs besides its tokens, in tokens (default ``block_n // 2``). Used
        by the wave model only (not by the <= 16-program one-warp rule).

    Returns
    -------
    int
        Splits per request, ``1 .. 256``.
    """
    programs = max(batch * kv_heads, 1)
    n = max(int(max_seq_len), 1)
    one_warp = num_warps == 1
    smax = max(1, min(256 if one_warp else 128, n // (128 if one_warp else 256)))
    per_sm = programs_per_sm or max(1, 12 // max(num_warps, 1))
    slots = per_sm * _num_sms(torch.device(device))
    if programs <= 16 and not one_warp:
        return smax
    if programs <= 16:
        s = round(2 * math.sqrt(programs * n) / programs)
        s = max(1, min(s, smax, slots // programs))
        return _cdiv(n, _cdiv(_cdiv(n, s), block_n) * block_n)  # whole tiles, no empty split
    extra = block_n // 2 if overhead is None else overhead
    best, best_cost = 1, None
    for s in range(1, smax + 1):
        chunk = _cdiv(_cdiv(n, s), block_n) * block_n  # tokens per split, whole tiles
        cost = _cdiv(programs * _cdiv(n, chunk), slots) * (chunk + extra)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _out_buffer(out, rows: int, hq: int, view: LayerView, q: torch.Tensor) -> torch.Tensor:
    """``out`` checked as ``[rows, H_q, v_head_dim]`` in q's dtype and device, or a new one."""
    shape = [rows, hq, view.v_head_dim]
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    _check("out", out, shape=shape, dtype=q.dtype, device=q.device)
    return out


@dataclass
class DecodePlan:
    """Launch metadata of :func:`decode` for one batch, reused by every layer.

    Attributes
    ----------
    page_table : torch.Tensor
        ``[B, max_pages]`` int32.
    seq_lens : torch.Tensor
        ``[B]`` int32.
    num_splits : int
        KV splits per request (flash-decoding); 1 writes the output directly.
    block_n, num_warps, num_stages : int
        Kernel tile (tokens per step) and launch options. With ``num_stages >= 3`` (and no
        ``prefetch``) the kernel loads each tile's page ids one tile ahead, so Triton's pipeliner
        keeps ``num_stages - 1`` K/V tiles in flight through ``cp.async``.
    use_dot : bool
        Tensor-core dots (query group padded to ``group_pad`` rows) or CUDA-core FMA.
    prefetch : bool
        Issue the next tile's loads before the current tile's math (register double buffer).
    asm : bool
        FP4 and fp8: decode 32-bit words of the cache with inline PTX (GPU; the CPU interpreter
        runs a plain-Triton emulation); else plain Triton ops on the stored dtype.
    swap : bool
        Transposed dots (``S^T = K q^T``, ``O^T = V^T P^T``): the KV tile is the tensor-core
        tile's M side and the query group its N side (padded to 8, not 16). Needs ``use_dot``,
        no ``prefetch``.
    ablate : int
        Benchmarks only: leave one kernel stage out (0 = none; 1-3 see ``decode_kernel``; 4 = the
        split merge). Results are wrong when nonzero.
    maxnreg : int or None
        Register cap per thread for the split kernel (Triton's ``maxnreg``, 24..255; None: the
        compiler's choice). Fewer registers let more programs share a multiprocessor.
    group_pad : int
        Rows the query group is padded to in the kernel (a power of two >= the group): by
        default ``max(16, group)`` rounded up to a power of two for untransposed dots, the
        group's power of two for transposed dots and FMA; 16 makes Triton use Hopper's
        warpgroup MMA for transposed dots (slower for fp8 on the H200, run 6 call 2).
    part_out, part_lse : torch.Tensor or None
        fp32 workspaces ``[B, H_q, num_splits, Dv]`` / ``[B, H_q, num_splits]`` (split > 1).
    gluon : bool
        Launch a Gluon kernel (``triton_kernels/decode_gluon.py`` for fp8,
        ``decode_gluon_fp4.py`` for nvfp4 and fp4_mx_block16; head_dim 128, 16-token tiles into
        tensor-core fragments without layout conversions, one warp per program; a ring of
        ``num_stages`` stages in shared memory (fp8: 3 cp.async stages; FP4: 2 stages of
        ``block_n`` / 16 tiles, data by TMA on sm_90+, with page_size >= 16 and 16-byte aligned
        scale rows; else register prefetch, ``prefetch``) instead of the Triton one; the other
        kernel options are unused.
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    num_q_heads: int
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    use_dot: bool
    prefetch: bool
    asm: bool
    swap: bool
    ablate: int
    group_pad: int
    maxnreg: int | None
    part_out: torch.Tensor | None
    part_lse: torch.Tensor | None
    gluon: bool = False


def _split_workspace(b: int, hq: int, splits: int, dv: int, dev: torch.device):
    """The split merge's fp32 inputs: ``[b, hq, splits, dv]`` and ``[b, hq, splits]``.

    ``(None, None)`` for one split: the kernel then writes the output directly.
    """
    if splits == 1:
        return None, None
    return (
        torch.empty(b, hq, splits, dv, dtype=torch.float32, device=dev),
        torch.empty(b, hq, splits, dtype=torch.float32, device=dev),
    )


def _gluon_plan(view, num_q_heads, page_table, seq_lens, ctx, num_splits) -> DecodePlan:
    """:func:`plan_decode` for the Gluon kernel (one warp per program).

    ``block_n`` is 16, or 32 for FP4 ring stages of two 16-token tiles.
    """
    b, dev = page_table.shape[0], view.k.device
    stages, per_sm, maxnreg = _GLUON_CONFIG[view.dtype]
    given = num_splits
    if num_splits is None:
        num_splits = default_splits(b, view.num_kv_heads, ctx, dev, 16, 1, per_sm, _GLUON_OVERHEAD)
    num_splits = _check_knob("num_splits", num_splits, 1, MAX_SPLITS)
    block_n = 16
    if view.dtype in _FP4 and _GLUON_FP4_OPTIONS[3] == 2:
        # two 16-token tiles per ring stage (nvfp4 140 registers: 14 programs per SM instead of
        # 16), except where only one tile a stage keeps the grid in one wave (run 9, call 4:
        # 256 splits at B=1/32k, 2,048 programs, 31.6 us vs 35.3; two tiles faster at every
        # other measured shape; since run 10 the planner takes 128 splits there, so this is
        # mostly an explicit num_splits' case); splits then in whole 32-token stages
        sms = _num_sms(torch.device(dev))
        programs = b * view.num_kv_heads * num_splits
        two = 16 if maxnreg is not None and maxnreg <= 128 else 14  # two-tile programs per SM
        block_n = 16 if two * sms < programs <= 16 * sms else 32
        if block_n == 32 and given is None:
            num_splits = default_splits(
                b, view.num_kv_heads, ctx, dev, 32, 1, per_sm, _GLUON_OVERHEAD
            )
    part_out, part_lse = _split_workspace(b, num_q_heads, num_splits, view.v_head_dim, dev)
    return DecodePlan(
        page_table=page_table,
        seq_lens=seq_lens,
        num_q_heads=num_q_heads,
        num_splits=num_splits,
        block_n=block_n,
        num_warps=1,
        num_stages=max(stages, 1),
        use_dot=True,
        prefetch=stages == 0,
        asm=True,
        swap=False,
        ablate=0,
        group_pad=16,
        maxnreg=maxnreg,
        part_out=part_out,
        part_lse=part_lse,
        gluon=True,
    )


def plan_decode(
    view: LayerView,
    num_q_heads: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_dot: bool | None = None,
    prefetch: bool | None = None,
    asm: bool | None = None,
    swap: bool | None = None,
    group_pad: int | None = None,
    maxnreg: int | None = None,
    ablate: int = 0,
    gluon: bool | None = None,
) -> DecodePlan:
    """Plan :func:`decode` for one batch (any layer with ``view``'s geometry may use it).

    Parameters
    ----------
    view : LayerView
        Any layer of the pool (only its geometry is used).
    num_q_heads : int
        Query heads per rank.
    page_table, seq_lens : torch.Tensor
        As in :func:`decode`.
    max_seq_len : int, optional
        Longest request in tokens, if known on the host; sizes the splits (default: the page
        table's capacity, ``max_pages * page_size``). No device value is read.
    num_splits, block_n, num_warps, num_stages, use_dot, prefetch, asm, swap : optional
        Override the heuristics (benchmarks, tuning). ``block_n`` is in tokens (a power of two
        >= 16; >= 32 for FP4 caches on the GPU), ``num_warps`` a power of two in 1..32,
        ``num_splits`` in 1..``MAX_SPLITS`` (1,024). ``asm=True`` is ignored where the word
        decode does not apply (see :class:`DecodePlan`).
        The one-warp default (``num_warps=1``; fp8: 16-token tiles and 3 stages, FP4: 32-token
        tiles and 2 stages) applies with ``use_dot``, the word decode, no ``prefetch`` and heads
        <= 128 wide; otherwise 4 warps.
    group_pad : int, optional
        Rows the query group is padded to in the kernel: a power of two >= the group
        (``num_q_heads / kv_heads``) and at most :data:`GROUP_PAD_MAX` (256), or the group's
        own power of two when the group is larger. Padding only has to reach a tensor-core
        tile (16 rows for untransposed dots, 8 transposed, 64 per Hopper warpgroup MMA); 256
        is four warpgroup tiles, and rows beyond it only grow the per-program fp32
        accumulator (``group_pad x head_dim``) and score tile: spills or a failed compile
        (512 x 128 fp32 is 256 KiB, an H200 multiprocessor's whole register file).
        Default: ``max(16, group)`` rounded up to a power of two for untransposed dots, the
        group's power of two otherwise.
    maxnreg : int, optional
        Register cap per thread of the split kernel, 24..255 (ptxas, sm_90, raises smaller
        caps to 24 and ignores larger ones). Default None: no cap. For experiments: at 128 on
        the H200 (run 6, call 2) it slowed one-warp programs (fp8 0.351 -> 0.377 ms) and sped
        up 2-warp ones, which stayed slower than the one-warp default.
    ablate : int
        Benchmarks only (see :class:`DecodePlan`).
    gluon : bool, optional
        Use the Gluon kernel. Default: where it can run (fp8 or FP4 caches, CUDA compute
        capability 8.9+ NVIDIA, head_dim 128, query group <= 8, 16-byte aligned K/V rows, a
        Triton in ``GLUON_TRITON``; see ``_gluon_unfit``), no Triton knob above is given, and
        for fp8 the batch has more than 16 programs per split (B x KV heads) and the longest
        request is at least 2,048 tokens (at B=1 and at 1k tokens the Triton kernel is as fast
        or faster; the FP4 Gluon kernel is faster at every batch, run 8 calls 11 and 14).
        Run 7 on the H200 (``benches/attention/results/run7_h200/gluon_ring/stdout.txt``, one
        run): e4m3 B=64/8k 0.276-0.278 ms vs 0.327 for the Triton kernel (1.74-1.75x SDPA on
        contiguous bf16 instead of 1.48x). Run 8 (``results/run8_h200/NOTES.md``): e4m3
        0.266-0.272 ms (1.81x), e5m2 0.274 ms (1.80x, ring); nvfp4 B=64/8k 0.243-0.245 ms vs
        0.421-0.425 (1.96-2.01x SDPA instead of 1.15x). Run 9 (``results/run9_h200``, TMA
        tiles, two tiles a ring stage): nvfp4 0.216-0.217 ms (2.24-2.28x), fp4_mx_block16
        0.270 (1.80x). True where it cannot run raises ValueError naming why.

    Returns
    -------
    DecodePlan
        With workspaces allocated on ``view``'s device when ``num_splits > 1``.

    Raises
    ------
    ValueError
        A tensor of the wrong shape, dtype or device; ``num_q_heads`` not a multiple of the KV
        heads; a knob that is not an int (bools included) or out of range; an FP4 tile
        shorter than 32 tokens on the GPU; ``swap`` with ``use_dot=False``, ``prefetch`` or
        ``ablate > 1``; ``gluon=True`` where the Gluon kernel cannot run, or with a Triton
        knob. The message names the value.
    """
    _check_view(view)
    g = _group(view, num_q_heads)
    dev = view.k.device
    _check("page_table", page_table, ndim=2, dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[page_table.shape[0]], dtype=torch.int32, device=dev)
    b = page_table.shape[0]
    cap = page_table.shape[1] * view.page_size
    ctx = cap if max_seq_len is None else min(int(max_seq_len), cap)
    knobs = {
        "block_n": block_n,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "use_dot": use_dot,
        "prefetch": prefetch,
        "asm": asm,
        "swap": swap,
        "group_pad": group_pad,
        "maxnreg": maxnreg,
        "ablate": ablate or None,
    }
    given = [k for k, v in knobs.items() if v is not None]
    if gluon is not None and not isinstance(gluon, bool):
        raise ValueError(f"`gluon` = {gluon!r}: must be a bool or None")
    unfit = _gluon_unfit(view, g)
    if gluon is None:
        # fp8, run 7 grid (H200): 7-14% faster than the Triton kernel from 8k tokens on at
        # B >= 16; at 1k no gain (B=64, 128) or a loss (B=16: 25.3 vs 22.7 us); at <= 16
        # programs the Triton kernel is as fast or faster (run 8 call 11: B=1/32k e4m3 40.6 vs
        # 35.5 us, e5m2 42.4 vs 35.5). FP4: faster at every small batch too (nvfp4, call 11,
        # B=1..4 x 1k..32k: 13.7 vs 17.3 us at B=1/1k, 31.7 vs 45.4 at B=1/32k; mx, call 14)
        small = b * view.num_kv_heads <= 16 or ctx < 2048
        gluon = unfit is None and not given and (view.dtype in _FP4 or not small)
    elif gluon and unfit is not None:
        raise ValueError(f"`gluon=True`: the Gluon decode kernel does not run {unfit}")
    elif gluon and given:
        raise ValueError(f"`gluon=True` takes no Triton kernel options, got {', '.join(given)}")
    if gluon:
        return _gluon_plan(view, num_q_heads, page_table, seq_lens, ctx, num_splits)
    if use_dot is None:
        use_dot = True
    # Measured on the H200 (benches/attention, run 5 at B=64/8k): fp8 is fastest with the word
    # decode, transposed dots, 128-token tiles and 2 stages (0.40 ms vs 0.43 ms); FP4 with the
    # word decode and 128-token tiles, untransposed; 16-bit caches with transposed dots.
    fp8 = view.dtype in ("fp8_e4m3", "fp8_e5m2")
    if asm is None:
        asm = use_dot and _asm_default(view, "decode")
    asm = bool(asm) and _asm_ok(view)  # what the kernel will run (asm=True on bf16: off)
    if num_warps is not None:
        num_warps = _check_knob("num_warps", num_warps, 1, 32, pow2=True)
    # Run 6 (H200, call 12, same run): with 8-bit and 4-bit caches one-warp programs on 32-token
    # tiles beat 4-warp programs on 128-token tiles (B=64/8k: fp8_e4m3 0.367 -> 0.335 ms, nvfp4
    # 0.480 -> 0.424, fp4_mx 0.527 -> 0.464): 12 programs per multiprocessor instead of 3, the
    # same number of warps, and no barriers between warps in the softmax. Heads wider than 128
    # keep 4-warp tiles.
    one_warp = (
        use_dot and asm and not prefetch and _head_factor(view) == 1 and num_warps in (None, 1)
    )
    if num_warps is None:
        num_warps = 1 if one_warp else 4
    if swap is None:
        swap = use_dot and not prefetch and ablate <= 1 and view.dtype in _SWAP_DEFAULT
    # Run 7 (H200, benches/attention/results/run7_h200): fp8 one-warp programs on 16-token tiles
    # with 3 stages (page ids one tile ahead: two tiles in flight) use 128 registers instead of
    # 168-182, so 16 programs share a multiprocessor instead of 11-12: B=64/8k 0.325 ms vs 0.335
    # (4 splits, one wave), B=16/8k 0.093 vs 0.096 ms, B=1/32k unchanged (35.4 us).
    fp8_ring = one_warp and fp8 and block_n in (None, 16) and num_stages in (None, 3)
    if block_n is None:
        if one_warp:
            block_n = 16 if fp8_ring else 32
        else:
            block_n = max(
                _min_block_n(view.dtype),
                ((128 if fp8 or asm else 64) if use_dot else 32) // _head_factor(view),
            )
    if num_stages is None:
        num_stages = 3 if fp8_ring else 2
    num_stages = _check_knob("num_stages", num_stages, 1)
    block_n = _check_knob("block_n", block_n, 16, pow2=True)
    if num_splits is None:
        per_sm = 16 if fp8_ring and swap and maxnreg is None else None
        num_splits = default_splits(b, view.num_kv_heads, ctx, dev, block_n, num_warps, per_sm)
    num_splits = _check_knob("num_splits", num_splits, 1, MAX_SPLITS)
    _check_fp4_tile(view, block_n)
    if swap and (not use_dot or prefetch or ablate > 1):
        raise ValueError("`swap` needs use_dot=True, prefetch=False and ablate 0 or 1")
    if group_pad is None:
        group_pad = max(16, _pow2(g)) if use_dot and not swap else _pow2(g)
    try:
        group_pad = _check_knob("group_pad", group_pad, g, pow2=True)
    except ValueError as e:
        raise ValueError(f"{e} (the query group is {g})") from None
    if group_pad > max(GROUP_PAD_MAX, _pow2(g)):
        raise ValueError(
            f"`group_pad` = {group_pad}: must be at most {max(GROUP_PAD_MAX, _pow2(g))} (the "
            f"query group is {g}; rows past {GROUP_PAD_MAX} are padding that only costs "
            "registers and shared memory)"
        )
    if maxnreg is not None:
        maxnreg = _check_knob("maxnreg", maxnreg, 24, 255)
    part_out, part_lse = _split_workspace(b, num_q_heads, num_splits, view.v_head_dim, dev)
    return DecodePlan(
        page_table=page_table,
        seq_lens=seq_lens,
        num_q_heads=num_q_heads,
        num_splits=num_splits,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        use_dot=use_dot,
        prefetch=bool(prefetch),
        asm=asm,
        swap=bool(swap),
        ablate=int(ablate),
        group_pad=group_pad,
        maxnreg=maxnreg,
        part_out=part_out,
        part_lse=part_lse,
    )


@dataclass
class ExtendPlan:
    """Launch metadata of :func:`extend` for one batch, reused by every layer.

    Attributes
    ----------
    cu_seqlens_q, page_table, seq_lens : torch.Tensor
        As in :func:`extend`.
    work : torch.Tensor or None
        ``[n, 2]`` int32 (request, first new token of the block) of every non-empty block;
        None launches one program per possible block and lets empty ones exit.
    block_t, block_n, num_warps, num_stages : int
        New tokens per program (times the padded group = rows), KV tile, launch options.
    asm : bool
        FP4 and fp8: word-level decode with inline PTX (see :class:`DecodePlan`); on by default
        for FP4 caches, off for fp8 (slower in extend).
    """

    cu_seqlens_q: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    work: torch.Tensor | None
    block_t: int
    block_n: int
    num_warps: int
    num_stages: int
    asm: bool = False


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


def _extend_tiles(
    dtype: str, group: int, block_t, block_n, num_warps, num_stages, head_factor: int = 1
):
    """Extend tile defaults, measured on the H200 (benches/attention, run 5).

    4k prefix + 512 new tokens, B=16, 32 q / 8 KV heads. 16-bit caches: 128 rows of (token,
    head) per program over 8 warps, 128-token KV tiles, 3 stages (bf16 1.85 -> 1.76 ms, fp16
    2.05 -> 1.77 ms); fp8: 128 rows over 8 warps, 128-token tiles, 2 stages (2.08 -> 2.01 ms);
    FP4 (with the word decode): 64 rows, 128-token tiles (3.71 -> 2.11 ms); fp32: 64 rows,
    64-token tiles (larger ones do not fit in shared memory).
    """
    gp = _pow2(group)
    wide = dtype in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
    rows = max(16, (128 if wide else 64) // head_factor)
    if block_t is None:
        block_t = max(1, rows // gp) if gp <= rows else 1
    if block_n is None:
        block_n = max(_min_block_n(dtype), (64 if dtype == "fp32" else 128) // head_factor)
    if num_stages is None:
        num_stages = 3 if dtype in ("bf16", "fp16") and head_factor == 1 else 2
    if num_warps is None:
        num_warps = 8 if wide and block_t * gp >= 128 else 4
    return block_t, block_n, num_warps, num_stages


def plan_extend(
    view: LayerView,
    num_q_heads: int,
    cu_seqlens_q: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_t: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    asm: bool | None = None,
) -> ExtendPlan:
    """Plan :func:`extend` for one batch: the list of non-empty (request, token block) pairs.

    Reads ``cu_seqlens_q`` on the host once (one sync per batch, not per layer) and checks it
    (ValueError unless non-decreasing from 0). Tile options
    left as None take the measured defaults (``_extend_tiles``); ``asm=None`` the default
    decode path of the dtype (word-level for FP4).
    """
    _check_view(view)
    g = _group(view, num_q_heads)
    dev = view.k.device
    block_t, block_n, num_warps, num_stages = _extend_tiles(
        view.dtype, g, block_t, block_n, num_warps, num_stages, _head_factor(view)
    )
    _check_fp4_tile(view, block_n)
    _check("cu_seqlens_q", cu_seqlens_q, ndim=1, dtype=torch.int32, device=dev)
    cu_host = cu_seqlens_q.cpu()
    _check_cu_seqlens(cu_host.long(), None)  # read on the host here anyway
    cu = cu_host.tolist()
    work = [(b, t) for b in range(len(cu) - 1) for t in range(0, cu[b + 1] - cu[b], block_t)]
    work_t = torch.tensor(work or [(0, 0)], dtype=torch.int32).reshape(-1, 2).to(dev)
    if not work:
        work_t = work_t[:0]
    return ExtendPlan(
        cu_seqlens_q,
        page_table,
        seq_lens,
        work_t,
        block_t,
        block_n,
        num_warps,
        num_stages,
        _asm_default(view, "extend") if asm is None else bool(asm) and _asm_ok(view),
    )


# ----------------------------------------------------------------------------- decode


def decode(
    view: LayerView,
    q: torch.Tensor,
    page_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: Backend = "auto",
    plan: DecodePlan | None = None,
    out: torch.Tensor | None = None,
    debug: bool = False,
) -> torch.Tensor:
    """Decode attention of one new token per request over the paged cache of one layer.

    Parameters
    ----------
    view : LayerView
        The layer's buffers (any KV dtype; MLA layers are not supported).
    q : torch.Tensor
        ``[B, H_q, D]`` fp32/bf16/fp16, ``H_q`` a multiple of the KV heads; the query of the
        token at position ``seq_len - 1`` (its K/V already written).
    page_table : torch.Tensor
        ``[B, max_pages]`` int32 (omit when ``plan`` is given).
    seq_lens : torch.Tensor
        ``[B]`` int32, each in ``1 .. max_pages * page_size`` (omit when ``plan`` is given).
    sm_scale : float, optional
        Softmax scale, finite and > 0 (None: ``1 / sqrt(D)``).
    window : int, optional
        Sliding window in tokens (the query's own token included), an int >= 1 (Python or
        numpy; not a bool or float).
    sinks : torch.Tensor, optional
        ``[H_q]`` per-head sink logits (natural-log units).
    softcap : float, optional
        Logit soft-capping ``c`` (``c * tanh(x / c)``), finite and > 0.
    backend : {"auto", "triton", "torch"}
        ``auto``: Triton for CUDA tensors, else the torch reference.
    plan : DecodePlan, optional
        From :func:`plan_decode`, shared by every layer of the batch.
    out : torch.Tensor, optional
        ``[B, H_q, Dv]`` in ``q``'s dtype to write into.
    debug : bool
        Also check the batch's values on the GPU kernel path (a host sync): ``seq_lens`` in
        ``1 .. max_pages * page_size`` and the page ids they read in ``0 .. num_pages - 1``
        (page 0, the padding page, serves padded requests: its contents are garbage). CPU
        tensors are always checked.

    Returns
    -------
    torch.Tensor
        ``[B, H_q, Dv]`` in ``q``'s dtype.

    Raises
    ------
    ValueError
        A tensor of the wrong shape, dtype or device (the message names it), a bad option
        (``sm_scale``, ``softcap``, ``window``: bools, strings, NaN/Inf, out of range); bad
        ``seq_lens`` or page ids (see ``debug``); for the kernels also ``q``, ``out`` or
        ``page_table`` not contiguous in the last dim, ``seq_lens`` not contiguous, and a
        ``plan`` made for another batch or one whose kernel cannot run this layer (a Gluon plan
        on a bf16 or fp32 view, another head_dim, ...).
    """
    _check_view(view)
    dev = view.k.device
    _check("q", q, ndim=3, dtype=_Q_DTYPES, device=dev)
    bsz, hq, d = q.shape
    if d != view.head_dim:
        raise ValueError(f"`q` head dim is {d}, the cache stores {view.head_dim}")
    if q.stride(2) != 1:
        raise ValueError("`q` must be contiguous in its last dim")
    g = _group(view, hq)
    if plan is not None:
        if page_table is None:
            page_table = plan.page_table
        if seq_lens is None:
            seq_lens = plan.seq_lens
        if plan.num_q_heads != hq:
            raise ValueError(f"`plan` was made for {plan.num_q_heads} query heads, `q` has {hq}")
    if page_table is None or seq_lens is None:
        raise ValueError("`page_table` and `seq_lens` are required without a `plan`")
    _check("page_table", page_table, shape=[bsz, None], dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[bsz], dtype=torch.int32, device=dev)
    scale = _sm_scale(sm_scale, d)
    window, softcap = _check_options(window, softcap, sinks, hq, dev)
    out = _out_buffer(out, bsz, hq, view, q)
    if not _use_triton(backend, q):
        out.copy_(
            reference_decode(
                view,
                q,
                page_table,
                seq_lens,
                sm_scale=scale,
                window=window,
                sinks=sinks,
                softcap=softcap,
            )
        )
        return out
    if bsz == 0:
        return out
    _check_unit_inner_strides(out=out, page_table=page_table, seq_lens=seq_lens)
    if debug or dev.type != "cuda":  # reads the values: free on CPU tensors, a sync on the GPU
        _check_batch(view, page_table, seq_lens, window=window)
    if plan is None:
        plan = plan_decode(view, hq, page_table, seq_lens)
    elif plan.page_table.shape[0] != bsz:
        raise ValueError(f"`plan` was made for {plan.page_table.shape[0]} requests, `q` has {bsz}")
    if plan.group_pad < g:
        raise ValueError(f"`plan` pads the query group to {plan.group_pad} rows, the group is {g}")
    # a plan may come from a view of another dtype or geometry (it is shared across layers)
    if plan.gluon and (unfit := _gluon_unfit(view, g)) is not None:
        raise ValueError(f"`plan` uses the Gluon kernel, which does not run {unfit}")
    if not plan.gluon:  # (the Gluon kernel's 16-token tiles are its own code)
        _check_fp4_tile(view, plan.block_n)
    if plan.num_splits > 1 and (
        plan.part_out is None
        or tuple(plan.part_out.shape) != (bsz, hq, plan.num_splits, view.v_head_dim)
        or plan.part_out.device != dev
    ):
        got = None if plan.part_out is None else tuple(plan.part_out.shape)
        raise ValueError(
            f"`plan` split workspace is {got}, this batch needs "
            f"{(bsz, hq, plan.num_splits, view.v_head_dim)} on {dev} (plan made for another view?)"
        )

    from kvpool.triton_kernels.decode import decode_kernel

    fmt, _, has_scale, fp4_mul = _KERNEL_FORMAT[view.dtype]
    cdt = _compute_dtype(view.dtype)
    kbs, vbs, ksc, vsc = _scale_args(view)
    s = plan.num_splits
    gp = plan.group_pad
    dummy = out
    if plan.gluon:
        _launch_gluon(view, q, page_table, seq_lens, plan, out, scale, softcap, window, sinks)
    else:
        decode_kernel[(bsz, view.num_kv_heads, s)](
            q,
            view.k,
            view.v,
            kbs,
            vbs,
            ksc,
            vsc,
            page_table,
            seq_lens,
            sinks if sinks is not None else dummy,
            out,
            plan.part_out if s > 1 else dummy,
            plan.part_lse if s > 1 else dummy,
            q.stride(0),
            q.stride(1),
            view.k.stride(0),
            view.v.stride(0),
            _row_stride(kbs, view),
            _row_stride(vbs, view),
            page_table.stride(0),
            out.stride(0),
            out.stride(1),
            scale,
            float(softcap or 1.0),
            int(window or 0),
            view.page_size.bit_length() - 1,
            s,
            G=g,
            GP=gp,
            D=d,
            DV=view.v_head_dim,
            BLOCK_N=plan.block_n,
            FINAL=s == 1,
            FMT=fmt,
            CDT=_tl_dtype(cdt),
            IS_F32=cdt == torch.float32,
            USE_DOT=plan.use_dot,
            HAS_SCALE=has_scale,
            FP4_MUL=fp4_mul,
            HAS_SOFTCAP=softcap is not None,
            HAS_WINDOW=window is not None,
            HAS_SINKS=sinks is not None,
            PREFETCH=plan.prefetch,
            ABLATE=plan.ablate,
            ASM=_asm_mode(plan.asm and _asm_ok(view)),
            SWAP=plan.swap,
            PAGE_AHEAD=plan.num_stages >= 3 and not plan.prefetch,
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
            **({} if plan.maxnreg is None else {"maxnreg": plan.maxnreg}),
        )
    if s > 1 and plan.ablate != 4:  # ablate 4 (benchmarks only): leave the merge out
        _merge(plan, out, sinks, vsc, has_scale, fp4_mul)
    return out


# Launch the split merge as a programmatic dependent of the split kernel where the GPU can
# (compute capability 9.x and 10.x; see _merge). A module switch for benchmarks' A/B runs
# (benches/attention, section ``small``).
_MERGE_PDL = True


def _merge(plan: DecodePlan, out, sinks, vsc, has_scale: bool, fp4_mul: float) -> None:
    """Launch ``decode.merge_kernel`` over the plan's split workspace into ``out [B, H_q, Dv]``.

    Grid ``(B, H_q, Dv / BLOCK_DV)`` with the tiles of :func:`_merge_tiles` (a small batch
    spreads over ``Dv / 32`` programs per (request, query head)). On compute capability 9.x and
    10.x the merge is launched as a programmatic dependent (PDL) of the split kernel, the
    launch just before it on the stream: its launch overlaps the split kernel's tail and it
    waits (``griddepcontrol.wait``) for the split grid to complete before reading anything.
    Measured gain on the H200: 0.0-0.5 us (benches/attention, run 10).
    """
    from kvpool.triton_kernels.decode import merge_kernel

    bsz, hq, dv = out.shape
    sp, block_dv, warps = _merge_tiles(bsz * hq, plan.num_splits, dv)
    # compute capability 9.x / 10.x only: PDL launches failed under graph capture on SM120 in
    # a peer engine (sgl-project/sglang#18596), and nothing here was measured there
    pdl = _MERGE_PDL and not _interpreting() and _capability(out.device)[0] in (9, 10)
    merge_kernel[(bsz, hq, dv // block_dv)](
        plan.part_out,
        plan.part_lse,
        sinks if sinks is not None else out,
        vsc,
        out,
        out.stride(0),
        out.stride(1),
        hq,
        plan.num_splits,
        DV=dv,
        BLOCK_DV=block_dv,
        SP=sp,
        HAS_SCALE=has_scale,
        FP4_MUL=fp4_mul,
        HAS_SINKS=sinks is not None,
        PDL=pdl,
        num_warps=warps,
        **({"launch_pdl": True} if pdl else {}),
    )


def _merge_tiles(rows: int, splits: int, dv: int) -> tuple[int, int, int]:
    """``(SP, BLOCK_DV, num_warps)`` of the split merge for ``rows`` = B x H_q.

    SP: splits per step, a power of two in 16..256. BLOCK_DV: output columns per program,
    32 (``dv`` if narrower) below 4,096 rows, so that a small batch spreads over more programs;
    from 4,096 rows as many as keep a step at 8,192 values (all ``dv`` for up to 64 splits at
    ``dv`` 128), at least 32. Warps: one per 1,024 values of a step, 1..4 (a step of 8,192
    fp32 values is 64 registers per thread at 4 warps; the old one-step ``256 x 128`` tile
    spilled).
    """
    sp = min(max(16, _pow2(splits)), 256)
    narrow = min(dv, 32)
    block_dv = narrow if rows < 4096 else min(dv, max(narrow, 8192 // sp))
    return sp, block_dv, max(1, min(4, sp * block_dv // 1024))


def _launch_gluon(view, q, page_table, seq_lens, plan, out, scale, softcap, window, sinks):
    """Launch the fp8 or FP4 Gluon decode kernel (the caller merges the splits).

    fp8: ``decode_gluon.decode_kernel`` (options ``_GLUON_FP8_OPTIONS``); nvfp4 and
    fp4_mx_block16: ``decode_gluon_fp4.decode_kernel`` (``_GLUON_FP4_OPTIONS``). Both run the KV
    head fastest in the grid (batch on grid y) up to 65,535 requests, the grid's y limit;
    larger batches keep the batch on x.
    """
    bsz, hq, _ = q.shape
    s = plan.num_splits
    head = (q, view.k, view.v)
    tail = (
        page_table,
        seq_lens,
        sinks if sinks is not None else out,
        out,
        plan.part_out if s > 1 else out,
        plan.part_lse if s > 1 else out,
        q.stride(0),
        q.stride(1),
        view.k.stride(0),
        view.v.stride(0),
    )
    opts = dict(
        G=hq // view.num_kv_heads,
        FINAL=s == 1,
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        num_warps=1,
        **({} if plan.maxnreg is None else {"maxnreg": plan.maxnreg}),
    )
    rest = (
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        float(softcap or 1.0),
        int(window or 0),
        view.page_size.bit_length() - 1,
        s,
        hq // view.num_kv_heads,
    )
    if view.dtype in _FP4:
        from kvpool.triton_kernels.decode_gluon_fp4 import decode_kernel

        kbs, vbs = view.k_block_scale.view(torch.uint8), view.v_block_scale.view(torch.uint8)
        paged = view.page_size >= 16  # one page per 16-token tile (the ring needs it)
        # the ring copies scale rows in 4-byte pieces: Triton must see 16-byte aligned rows
        # (an odd KV head count, e.g. 1 under tensor parallelism, takes register prefetch)
        ring = paged and not plan.prefetch
        ring = ring and all(t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (kbs, vbs))
        hf, ablate, use_tma, _ = _GLUON_FP4_OPTIONS
        hf = hf and bsz <= 65535
        # plan.block_n: 16 or 32 tokens per ring stage (register prefetch: 16)
        if plan.block_n not in (16, 32):
            raise ValueError(
                f"`plan.block_n` = {plan.block_n}: the FP4 Gluon kernel takes 16 or 32"
            )
        extra = {"SUB": plan.block_n // 16 if ring else 1}
        if ring and use_tma and _has_tma(view.k.device):
            extra.update(TMA=True, KD=_tma_desc(view.k), VD=_tma_desc(view.v))
        grid = (view.num_kv_heads, bsz, s) if hf else (bsz, view.num_kv_heads, s)
        mx = view.dtype == "fp4_mx_block16"  # (exact bf16 values, no global scales)
        dec = (2, 2) if mx else _GLUON_FP4_DEC
        ksc, vsc = (kbs, vbs) if mx else (view.k_scale, view.v_scale)
        decode_kernel[grid](
            *head, kbs, vbs, ksc, vsc, *tail, kbs.stride(0), vbs.stride(0), *rest,
            DEC_K=dec[0], DEC_V=dec[1], PAGED=paged,
            STAGES=plan.num_stages if ring else 0, HEAD_FAST=hf,
            ABLATE=ablate, **extra, **opts,
        )  # fmt: skip
        return
    from kvpool.triton_kernels.decode_gluon import decode_kernel

    paged, rescale, hf = _GLUON_FP8_OPTIONS[view.dtype]
    hf = hf and bsz <= 65535
    grid = (view.num_kv_heads, bsz, s) if hf else (bsz, view.num_kv_heads, s)
    decode_kernel[grid](
        *head, view.k_scale, view.v_scale, *tail, *rest,
        PREFETCH=plan.prefetch, STAGES=0 if plan.prefetch else plan.num_stages,
        E5M2=view.dtype == "fp8_e5m2", PAGED=paged and view.page_size >= 16, RESCALE=rescale,
        HEAD_FAST=hf, **opts,
    )  # fmt: skip


def _has_tma(device: torch.device) -> bool:
    """Whether CUDA ``device`` has the Tensor Memory Accelerator (compute capability 9.0+)."""
    return _capability(device) >= (9, 0)


def _tma_desc(t: torch.Tensor):
    """TMA descriptor of an FP4 data buffer for the Gluon decode kernel's ring.

    ``t`` is ``[R, H, 64]`` uint8, described as ``[R, H * 64]`` with 16 x 64 boxes and the
    64-byte swizzle.
    """
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    shape = [t.shape[0], t.shape[1] * t.shape[2]]
    return TensorDescriptor(t, shape, [t.stride(0), 1], [16, 64], layout)


def _check_unit_inner_strides(**tensors: torch.Tensor) -> None:
    """ValueError naming the first tensor whose last dim is not contiguous.

    The decode and extend kernels take row strides but index within a row with unit stride
    (``out``, ``page_table``) or not at all (``seq_lens``, ``cu_seqlens_q``): another layout
    would be read or written in the wrong places, silently. The torch path takes any layout.
    """
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"`{name}` must be contiguous in its last dim (strides {tuple(t.stride())})"
            )


def _scale_args(view: LayerView):
    # block scales go in as bytes (nvfp4's e4m3 bits are reinterpreted in the kernel)
    kbs = view.k_block_scale.view(torch.uint8) if view.k_block_scale is not None else view.k
    vbs = view.v_block_scale.view(torch.uint8) if view.v_block_scale is not None else view.v
    ksc = view.k_scale if view.k_scale is not None else view.k
    vsc = view.v_scale if view.v_scale is not None else view.v
    return kbs, vbs, ksc, vsc


def _row_stride(bs: torch.Tensor, view: LayerView) -> int:
    return bs.stride(0) if view.k_block_scale is not None else 0


def _compute_dtype(dtype: str) -> torch.dtype:
    cdt = _KERNEL_FORMAT[dtype][1]
    # The Triton CPU interpreter computes bf16 dots on the raw bits (seen with triton 3.9:
    # errors of 1e10); interpreted runs check indexing and scales, so they use fp32 dots there.
    if cdt == torch.bfloat16 and _interpreting():
        return torch.float32
    return cdt


def _tl_dtype(dt: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dt]


# ----------------------------------------------------------------------------- extend


def extend(
    view: LayerView,
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: Backend = "auto",
    plan: ExtendPlan | None = None,
    out: torch.Tensor | None = None,
    debug: bool = False,
) -> torch.Tensor:
    """Extend attention: new tokens of a ragged batch attend causally to their whole sequence.

    Request ``b``'s new tokens are ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``; they are the last
    ``q_len_b`` of its ``seq_lens[b]`` tokens, whose K/V (prefix and new) are already in the
    cache, so the cached prefix is ``seq_lens[b] - q_len_b`` tokens (0 for a plain prefill).

    Parameters
    ----------
    view : LayerView
        The layer's buffers.
    q : torch.Tensor
        ``[T, H_q, D]`` fp32/bf16/fp16, ``T = cu_seqlens_q[-1]``.
    cu_seqlens_q : torch.Tensor
        ``[B + 1]`` int32, non-decreasing from 0 (omit when ``plan`` is given).
    page_table : torch.Tensor
        ``[B, max_pages]`` int32.
    seq_lens : torch.Tensor
        ``[B]`` int32, ``seq_lens[b] >= q_len_b``.
    sm_scale, window, sinks, softcap, backend, out
        As in :func:`decode` (``out`` is ``[T, H_q, Dv]``).
    debug : bool
        As in :func:`decode`; also checks ``cu_seqlens_q`` (non-decreasing from 0 to ``T``) and
        ``seq_lens[b] >= q_len_b``. CPU tensors are always checked.
    plan : ExtendPlan, optional
        From :func:`plan_extend`.

    Returns
    -------
    torch.Tensor
        ``[T, H_q, Dv]`` in ``q``'s dtype.

    Raises
    ------
    ValueError
        A tensor of the wrong shape, dtype or device (the message names it), a bad option;
        bad ``cu_seqlens_q``, ``seq_lens`` or page ids (see ``debug``).
    """
    _check_view(view)
    dev = view.k.device
    _check("q", q, ndim=3, dtype=_Q_DTYPES, device=dev)
    t, hq, d = q.shape
    if d != view.head_dim:
        raise ValueError(f"`q` head dim is {d}, the cache stores {view.head_dim}")
    if q.stride(2) != 1:
        raise ValueError("`q` must be contiguous in its last dim")
    g = _group(view, hq)
    if plan is not None:
        cu_seqlens_q = plan.cu_seqlens_q if cu_seqlens_q is None else cu_seqlens_q
        page_table = plan.page_table if page_table is None else page_table
        seq_lens = plan.seq_lens if seq_lens is None else seq_lens
    if cu_seqlens_q is None or page_table is None or seq_lens is None:
        raise ValueError(
            "`cu_seqlens_q`, `page_table` and `seq_lens` are required without a `plan`"
        )
    _check("page_table", page_table, ndim=2, dtype=torch.int32, device=dev)
    bsz = page_table.shape[0]
    _check("cu_seqlens_q", cu_seqlens_q, shape=[bsz + 1], dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[bsz], dtype=torch.int32, device=dev)
    scale = _sm_scale(sm_scale, d)
    window, softcap = _check_options(window, softcap, sinks, hq, dev)
    out = _out_buffer(out, t, hq, view, q)
    if not _use_triton(backend, q):
        out.copy_(
            reference_extend(
                view,
                q,
                cu_seqlens_q,
                page_table,
                seq_lens,
                sm_scale=scale,
                window=window,
                sinks=sinks,
                softcap=softcap,
            )
        )
        return out
    if debug or dev.type != "cuda":  # reads the values: free on CPU tensors, a sync on the GPU
        _check_batch(view, page_table, seq_lens, cu_seqlens_q, t, window)
    if t == 0 or bsz == 0:
        return out
    _check_unit_inner_strides(
        out=out, page_table=page_table, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q
    )

    from kvpool.triton_kernels.extend import extend_kernel

    if plan is not None:
        block_t, block_n, nw, ns = plan.block_t, plan.block_n, plan.num_warps, plan.num_stages
        _check_fp4_tile(view, block_n)  # the plan may come from a view of another dtype
        asm = plan.asm and _asm_ok(view)
        work = plan.work
        grid0 = work.shape[0]
        blocks_per_req = 1
    else:
        block_t, block_n, nw, ns = _extend_tiles(
            view.dtype, g, None, None, None, None, _head_factor(view)
        )
        asm = _asm_default(view, "extend")
        work = None
        blocks_per_req = _cdiv(t, block_t)
        grid0 = bsz * blocks_per_req
    if grid0 == 0:
        return out
    fmt, _, has_scale, fp4_mul = _KERNEL_FORMAT[view.dtype]
    cdt = _compute_dtype(view.dtype)
    kbs, vbs, ksc, vsc = _scale_args(view)
    dummy = out
    extend_kernel[(grid0, view.num_kv_heads)](
        q,
        view.k,
        view.v,
        kbs,
        vbs,
        ksc,
        vsc,
        page_table,
        seq_lens,
        cu_seqlens_q,
        work if work is not None else cu_seqlens_q,
        sinks if sinks is not None else dummy,
        out,
        q.stride(0),
        q.stride(1),
        view.k.stride(0),
        view.v.stride(0),
        _row_stride(kbs, view),
        _row_stride(vbs, view),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        float(softcap or 1.0),
        int(window or 0),
        blocks_per_req,
        view.page_size.bit_length() - 1,
        G=g,
        GP=_pow2(g),
        D=d,
        DV=view.v_head_dim,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        FMT=fmt,
        CDT=_tl_dtype(cdt),
        IS_F32=cdt == torch.float32,
        HAS_SCALE=has_scale,
        FP4_MUL=fp4_mul,
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        USE_WORK=work is not None,
        ASM=_asm_mode(asm),
        num_warps=nw,
        num_stages=ns,
    )
    return out


# ----------------------------------------------------------------------------- torch reference


def _gather_dequant(view: LayerView, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given slots, dequantized to fp32 ``[L, H, D]`` / ``[L, H, Dv]``."""
    h = view.num_kv_heads
    out = []
    for data, bs, sc in (
        (view.k, view.k_block_scale, view.k_scale),
        (view.v, view.v_block_scale, view.v_scale),
    ):
        x = data[slots]
        b = None
        if bs is not None:
            b = bs[slots].reshape(len(slots), h, -1)
        scale = sc.reshape(()) if sc is not None else 1.0
        out.append(formats.dequantize(x, b, view.dtype, scale=scale))
    return out[0], out[1]


def _attend(q, k, v, pos, *, sm_scale, window, sinks, softcap):
    """fp32 attention of ``q [n, H_q, D]`` at positions ``pos [n]`` over ``k/v [L, H, *]``."""
    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    k = k.repeat_interleave(g, dim=1)  # [L, H_q, D]
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * sm_scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    j = torch.arange(k.shape[0], device=q.device)
    keep = j[None, :] <= pos[:, None]
    if window is not None:
        keep &= j[None, :] > pos[:, None] - window
    s = s.masked_fill(~keep[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(hq, s.shape[1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, v)


def _slots(view: LayerView, page_table: torch.Tensor, b: int, lo: int, n: int) -> torch.Tensor:
    """Slots of request ``b``'s tokens ``lo .. n - 1`` (ids checked by :func:`_check_batch`)."""
    ps = view.page_size
    pos = torch.arange(lo, n, device=page_table.device)
    pages = page_table[b, pos // ps].long()
    return pages * ps + pos % ps


def reference_decode(
    view, q, page_table, seq_lens, *, sm_scale=None, window=None, sinks=None, softcap=None
) -> torch.Tensor:
    """Torch reference of :func:`decode`: dequantize, then attention in fp32.

    Each request's slots are dequantized with :mod:`kvpool.formats`; only slots below
    ``seq_len`` are read. Returns ``[B, H_q, Dv]`` fp32. Raises ValueError on bad options,
    ``seq_lens`` or page ids (:func:`_check_batch`).
    """
    scale = _sm_scale(sm_scale, q.shape[-1])
    window, softcap = _check_options(window, softcap, None, q.shape[1], q.device)
    # the reference reads on the host anyway: a page id outside the pool would index out of
    # range (an IndexError from deep in torch) or, when negative or 0, read wrong rows silently
    _check_batch(view, page_table, seq_lens, window=window)
    lens = seq_lens.cpu().tolist()
    res = torch.empty(q.shape[0], q.shape[1], view.v_head_dim, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        # (slots before the window are never read: their pages may be gone, as in the kernels)
        lo = 0 if window is None else max(n - window, 0)
        k, v = _gather_dequant(view, _slots(view, page_table, b, lo, n))
        pos = torch.tensor([n - 1 - lo], device=q.device)  # (positions from lo)
        res[b] = _attend(
            q[b : b + 1], k, v, pos, sm_scale=scale, window=window, sinks=sinks, softcap=softcap
        )[0]
    return res


def reference_extend(
    view,
    q,
    cu_seqlens_q,
    page_table,
    seq_lens,
    *,
    sm_scale=None,
    window=None,
    sinks=None,
    softcap=None,
) -> torch.Tensor:
    """Torch reference of :func:`extend`: dequantize, then causal attention in fp32.

    Returns ``[T, H_q, Dv]`` fp32. Raises ValueError on bad options, ``cu_seqlens_q``,
    ``seq_lens`` or page ids (:func:`_check_batch`).
    """
    scale = _sm_scale(sm_scale, q.shape[-1])
    window, softcap = _check_options(window, softcap, None, q.shape[1], q.device)
    _check_batch(view, page_table, seq_lens, cu_seqlens_q, q.shape[0], window)
    cu = cu_seqlens_q.cpu().tolist()
    lens = seq_lens.cpu().tolist()
    res = torch.zeros(q.shape[0], q.shape[1], view.v_head_dim, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        a, e = cu[b], cu[b + 1]
        if e == a:
            continue
        # (slots before the first query's window are never read, as in the kernels)
        p0 = n - (e - a)
        lo = 0 if window is None else max(p0 + 1 - window, 0)
        k, v = _gather_dequant(view, _slots(view, page_table, b, lo, n))
        pos = torch.arange(p0, n, device=q.device) - lo  # (positions from lo)
        res[a:e] = _attend(
            q[a:e], k, v, pos, sm_scale=scale, window=window, sinks=sinks, softcap=softcap
        )
    return res
