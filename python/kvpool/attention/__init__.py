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

Layout of the package (each file one job):

- ``plans``: :class:`DecodePlan`, :class:`ExtendPlan`, :func:`plan_decode`, :func:`plan_extend`;
  ``splits``: :func:`default_splits` (the wave model of split-KV decode).
- ``launch_decode`` / ``launch_extend``: the entry points :func:`decode` / :func:`extend`.
- ``mla``: the same two over an MLA latent cache (:func:`mla_decode`, :func:`mla_extend`).
- ``reference``: the torch reference paths; ``variants``: which kernel variant runs a layer
  (the Gluon kernels' fit, capability checks, measured tables); ``gluon_knobs``:
  :class:`GluonKnobs`, a Gluon decode variant (ring depth, tiles a stage, KV heads a program;
  ``plan_decode(..., gluon_knobs=)``) and the launch of ``decode_gluon_multi``; ``checks``:
  argument checks;
  ``_common``: dtype tables and kernel arguments.

Module switches (``_MERGE_PDL``, the ``_GLUON_*`` tables, ``_num_sms``) live in the module that
reads them (``launch_decode``, ``variants``, ``splits``): benchmarks and tests set them there.
"""

from __future__ import annotations

# (re-exported here: every name tests, benchmarks and the pool use stays importable from
# kvpool.attention)
from kvpool.attention._common import (  # noqa: F401
    _FP4,
    _KERNEL_FORMAT,
    _Q_DTYPES,
    _STORAGE,
    Backend,
    _cdiv,
    _compute_dtype,
    _interpreting,
    _pow2,
    _row_stride,
    _scale_args,
    _tl_dtype,
)
from kvpool.attention.checks import (  # noqa: F401
    _WINDOW_MAX,
    _check,
    _check_batch,
    _check_cu_seqlens,
    _check_knob,
    _check_options,
    _check_unit_inner_strides,
    _check_view,
    _group,
    _out_buffer,
    _positive_real,
    _sm_scale,
    _use_triton,
)
from kvpool.attention.gluon_knobs import GluonKnobs
from kvpool.attention.launch_decode import (  # noqa: F401
    _MERGE_PDL,
    _has_tma,
    _launch_gluon,
    _merge,
    _merge_tiles,
    _tma_desc,
    decode,
)
from kvpool.attention.launch_extend import extend
from kvpool.attention.mla import (
    MLA_ROPE_DIM,
    MLADecodePlan,
    mla_decode,
    plan_mla_decode,
)
from kvpool.attention.mla_extend import MLAExtendPlan, mla_extend, plan_mla_extend
from kvpool.attention.plans import (  # noqa: F401
    DecodePlan,
    ExtendPlan,
    _extend_tiles,
    _gluon_plan,
    _split_workspace,
    clear_plan_memo,
    plan_decode,
    plan_extend,
)
from kvpool.attention.reference import (  # noqa: F401
    _attend,
    _attend_latent,
    _gather_dequant,
    _latent,
    _slots,
    reference_decode,
    reference_extend,
    reference_mla_decode,
    reference_mla_extend,
)
from kvpool.attention.splits import MAX_SPLITS, _num_sms, default_splits  # noqa: F401
from kvpool.attention.variants import (  # noqa: F401
    _ASM_DEFAULT,
    _GLUON_CONFIG,
    _GLUON_FP4_DEC,
    _GLUON_FP4_OPTIONS,
    _GLUON_FP8_OPTIONS,
    _GLUON_OVERHEAD,
    _SWAP_DEFAULT,
    GLUON_TRITON,
    GROUP_PAD_MAX,
    _asm_default,
    _asm_mode,
    _asm_ok,
    _capability,
    _capability_of,
    _check_fp4_tile,
    _cuda_index,
    _gluon_cuda_unfit,
    _gluon_device_unfit,
    _gluon_unfit,
    _head_factor,
    _min_block_n,
)

__all__ = [
    "MLA_ROPE_DIM",
    "DecodePlan",
    "ExtendPlan",
    "GluonKnobs",
    "MLADecodePlan",
    "MLAExtendPlan",
    "clear_plan_memo",
    "decode",
    "extend",
    "mla_decode",
    "mla_extend",
    "plan_decode",
    "plan_extend",
    "plan_mla_decode",
    "plan_mla_extend",
    "reference_decode",
    "reference_extend",
    "reference_mla_decode",
    "reference_mla_extend",
]
