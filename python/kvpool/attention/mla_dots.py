"""The ``dots`` knob of the MLA decode kernel (:func:`kvpool.attention.mla.plan_mla_decode`).

- ``"f16"`` (the default): every cache dtype is dequantized in registers to fp16/bf16 (fp32
  for fp32 caches) and the dots run on 16-bit tensor cores.
- ``"fp8"`` (fp8_e4m3 / fp8_e5m2 caches): the dots run on fp8 tensor cores straight on the
  cache's bytes, so no element of the cache is converted. Per program, each head's query row
  ``q [Dl + Dr]`` is scaled by ``amax(|q|) / 448`` (1 for an all-zero row) and rounded to e4m3
  once; that scale, the cache's per-tensor ``k_scale`` and ``sm_scale`` multiply the fp32
  scores. The softmax weights ``P`` (in [0, 1] after the running max) are rounded to e4m3 as
  ``P * 448`` before ``P V`` and the 448 divided out at the end; the row sums ``l`` stay fp32.
  e4m3 is used for q and P with both caches (an e4m3 x e5m2 product is one native Hopper
  instruction; e5m2's 2 mantissa bits would double the rounding error of q and P).

Accuracy of ``"fp8"`` (on top of the cache's own quantization, which both variants share):
rounding to e4m3 (3 mantissa bits, to nearest) moves each q and P element by at most 2^-4 of
itself, uniformly distributed, so by about 3.6% rms. A score ``q . k`` over ``Dl + Dr`` terms
then moves by about ``0.036 * sqrt(sum_i (q_i k_i)^2)``, i.e. by ~3.6% / sqrt(Dl + Dr) of
``|q| |k|`` (independent errors add in quadrature), and the output, a P-weighted mean of V
rows, by ~3.6% of ``|V|`` divided by the square root of the number of tokens that carry the
weight. The tests' tolerances (``tests/test_mla.py``) are derived from this. The GPU's fp8
tensor cores also add with fewer than fp32's mantissa bits inside one instruction (Triton's
default on sm_90, ``max_num_imprecise_acc`` unlimited); the GPU tests bound the total.

Tensor-core shapes: fp8 instructions take k = 32, so ``"fp8"`` needs ``kv_lora_rank``,
``qk_rope_head_dim`` and ``block_n`` >= 32 (DeepSeek/Kimi: 512, 64). The CPU interpreter
computes fp8 dots (and fp32 -> fp8 casts that round up into the next power of two) wrongly
(Triton 3.9), so there the kernel emulates them: the same e4m3 roundings on fp32 bits, dots
in fp32 (``F8DOT = 2``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.attention._common import _interpreting

if TYPE_CHECKING:
    from kvpool.pool import LayerView

#: The values of ``dots``.
DOTS = ("f16", "fp8")
_FP8_CACHES = ("fp8_e4m3", "fp8_e5m2")


def _check_dots(view: LayerView, dots, rank: int, block_n: int) -> str:
    """``dots`` checked for the layer and tile (None: ``"f16"``), else ValueError naming it."""
    if dots is None:
        return "f16"
    if not isinstance(dots, str) or dots not in DOTS:
        raise ValueError(f"`dots` = {dots!r}: must be one of {', '.join(map(repr, DOTS))}")
    if dots == "fp8":
        if view.dtype not in _FP8_CACHES:
            raise ValueError(
                f"`dots` = 'fp8' runs on fp8 caches ({', '.join(_FP8_CACHES)}); this layer "
                f"is {view.dtype} (use dots='f16')"
            )
        rope = view.head_dim - rank
        if min(rank, rope, block_n) < 32:
            raise ValueError(
                f"`dots` = 'fp8' needs kv_lora_rank, qk_rope_head_dim and block_n >= 32 (fp8 "
                f"tensor-core instructions take k = 32); got {rank}, {rope}, {block_n}"
            )
    return dots


def _dots_consts(dots: str) -> dict:
    """Kernel constants that ``dots`` sets over ``mla._kernel_consts`` (none for ``"f16"``)."""
    if dots == "f16":
        return {}
    import triton.language as tl

    # q is loaded as fp32 (CDT) to be scaled and rounded to e4m3; the word decode is unused
    return dict(F8DOT=2 if _interpreting() else 1, CDT=tl.float32, IS_F32=False, ASM=0)
