"""Tables and helpers every part of the attention package shares.

KV dtype -> kernel format and storage dtype, the query dtypes, how a layer's scale buffers
become kernel arguments, the dots' compute dtype, and small integer helpers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from kvpool.pool import LayerView

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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
