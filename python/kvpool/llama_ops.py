"""The per-layer pieces of :mod:`kvpool.llama` around attention, as few kernels as torch allows.

Eager, they keep Hugging Face's roundings where it costs nothing (the RMSNorm and RoPE are bit
for bit HF's ``LlamaRMSNorm`` and ``apply_rotary_pos_emb``); the residual adds run inside the
matmuls (``addmm_``: one rounding instead of two). :meth:`kvpool.llama.Llama.compile` runs
:func:`pre_layer` and :func:`post_layer` (functional) through ``torch.compile``.
Per layer on CUDA, eager: norm 2 kernels, QKV matmul 1, RoPE of q and k 4, o_proj (+ residual)
1, norm 2, gate/up matmul 1, SiLU and product 2, down matmul (+ residual) 1 (was ~45 with the
RoPE factors made in every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Rope:
    """RoPE factors of one step's positions, made once (:meth:`Llama.rope`) for every layer.

    Attributes
    ----------
    cos : torch.Tensor
        ``[T, 1, head_dim]`` compute dtype: ``cos(position * inv_freq)``, both halves.
    sin : torch.Tensor
        ``[T, 1, head_dim]`` compute dtype: ``sin(position * inv_freq)``, the first half negated
        (``rotate_half(x) * sin`` is then exactly ``swap_halves(x) * sin_signed``: negation is
        exact in every float format).
    """

    cos: torch.Tensor
    sin: torch.Tensor


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, cast to ``x``'s dtype, then scale.

    ``F.rms_norm`` without a weight does the first two steps (one fused kernel on CUDA, bit for
    bit the float32 formula on CPU); the weight is applied after the cast, as HF does.
    ``F.rms_norm(x, shape, w)`` would scale in float32 before the cast: in bf16/fp16 a quarter
    of the elements then differ by one unit in the last place from HF (tests/test_llama_fused).
    """
    return F.rms_norm(x, (x.shape[-1],), None, eps).mul_(w)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` (any strides) rotated by :class:`Rope` factors ``[T, 1, D]``.

    HF's ``x * cos + rotate_half(x) * sin`` with the same roundings, in four kernels (the
    halves' swap, two products, the sum) instead of six.
    """
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [b, a]: a new tensor
    return (x * cos).add_(swapped.mul_(sin))


def pre_layer(
    h: torch.Tensor, w_norm: torch.Tensor, w_qkv: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, hq: int, hkv: int, d: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Norm, fused QKV projection, RoPE of q and k in one go.

    q and k are views of one ``[T, hq + hkv, D]`` tensor, v of the projection: the attention
    kernels and ``pool.write`` take strided rows.
    """
    qkv = rms_norm(h, w_norm, eps) @ w_qkv.t()
    t, nqk = qkv.shape[0], (hq + hkv) * d
    qk = apply_rope(qkv[:, :nqk].view(t, hq + hkv, d), cos, sin)
    return qk[:, :hq], qk[:, hq:], qkv[:, nqk:].view(t, hkv, d)


def post_layer(
    h: torch.Tensor, attn: torch.Tensor, w_o: torch.Tensor, w_norm: torch.Tensor,
    w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, inplace: bool,
) -> torch.Tensor:  # fmt: skip
    """o_proj + residual, norm, SwiGLU MLP + residual.

    ``inplace`` (eager): both residual adds are the matmuls' own accumulation into ``h``
    (``addmm_``: one kernel each, the sum rounded once instead of the product and the sum each);
    compiled: functional, the compiler fuses the adds into the next kernels.
    """
    o = attn.reshape(h.shape[0], -1).to(h.dtype)
    h = h.addmm_(o, w_o.t()) if inplace else h + o @ w_o.t()
    gate, up = (rms_norm(h, w_norm, eps) @ w_gate_up.t()).chunk(2, dim=-1)
    act = F.silu(gate).mul_(up)
    return h.addmm_(act, w_down.t()) if inplace else h + act @ w_down.t()


#: torch.compile modes that capture CUDA graphs themselves (not inside DecodeGraph's capture).
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def mark_tokens(*ts: torch.Tensor) -> None:
    """Dim 0 (tokens) of the compiled pieces' inputs is dynamic: one compile for all counts."""
    for t in ts:
        torch._dynamo.maybe_mark_dynamic(t, 0)
