"""Weight bytes of a model: from the checkpoint's index when there is one, else estimated.

The estimate counts parameters from ``config.json`` (embeddings, attention in its MHA/GQA, MLA or
gated-DeltaNet form with the projection biases a config has, dense or MoE MLPs, norms; the vision
tower of a vision-language config) and prices them by the checkpoint's format: the
model dtype, or for FP8 checkpoints (``quantization_config.quant_method == "fp8"``) one byte per
quantized linear weight plus one fp32 scale per 128x128 block, for MXFP4 (gpt-oss) 4.25 bits per
expert weight. Embeddings, norms, biases, routers and the vision tower stay in the model dtype.
For Llama-3.1-8B it gives 8,030,261,248 parameters, the published count; for the text part of
Qwen2.5-VL-7B 7,615,616,512, the published Qwen2.5-7B count; for the whole of Qwen2.5-VL-7B
8,292,249,856 (published 8,292,166,656; the 83,200 more are the vision norms' biases, an upper
bound, see :func:`vision_parameters`); for Qwen2-VL-7B (whose ViT width is ``embed_dim``)
8,291,375,616, the published count.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from kvpool._core import ModelConfigError
from kvpool.config import DTYPE_BYTES

if TYPE_CHECKING:
    from kvpool.config import ModelSpec



def checkpoint_bytes(spec: ModelSpec) -> int | None:
    """``metadata.total_size`` of ``model.safetensors.index.json`` (or the single file's size)."""
    if spec.path is None:
        return None
    index = spec.path / "model.safetensors.index.json"
    if index.is_file():
        try:
            size = json.loads(index.read_text())["metadata"]["total_size"]
        except (KeyError, ValueError, TypeError) as e:
            raise ModelConfigError(f"`{index}` has no usable metadata.total_size: {e}") from None
        # a bool, a negative, non-integral or non-finite number would size the pool from a
        # nonsense weight figure (true counted as 1 byte of weights)
        if (
            isinstance(size, bool)
            or not isinstance(size, (int, float))
            or not 0 < size < 1 << 60
            or size != int(size)
        ):
            raise ModelConfigError(
                f"`{index}`: metadata.total_size = {size!r} is not a whole number of bytes "
                "in 1..2^60"
            )
        return int(size)
    single = spec.path / "model.safetensors"
    return single.stat().st_size if single.is_file() else None


def attention_biases(spec: ModelSpec) -> tuple[bool, bool]:
    """Whether a (non-MLA, non-linear) attention layer has biases: ``(q/k/v, o_proj)``.

    The Qwen2 family (``model_type`` ``qwen2``, ``qwen2_moe``, ``qwen2_vl``, ``qwen2_5_vl`` and
    their ``*_text`` parts) always has q/k/v biases and none on ``o_proj``: their modeling code
    hard-wires it and their configs carry no ``attention_bias`` key. Other families follow
    ``attention_bias`` (Llama, Qwen3, Gemma 2, gpt-oss: q, k, v and o_proj alike; absent = none).

    Raises
    ------
    ModelConfigError
        ``attention_bias`` is not a bool.
    """
    f = spec.fields
    if str(f.get("model_type", "")).startswith("qwen2"):
        return True, False
    flag = f.get("attention_bias", False)
    if not isinstance(flag, bool):
        raise ModelConfigError(f"`attention_bias` = {flag!r}: must be true or false")
    return flag, flag


def parameter_counts(spec: ModelSpec) -> dict[str, int]:
    """Parameters by group.

    ``embed`` (embeddings and LM head), ``norms`` (norms and routers, kept in the model dtype),
    ``bias`` (attention projection biases, see :func:`attention_biases`; model dtype),
    ``linear`` (attention and dense/shared MLP weights), ``experts`` (routed MoE expert weights),
    ``vision`` (the vision tower of a ``vision_config``, see :func:`vision_parameters`).
    """
    f = spec.fields
    hidden = f.int("hidden_size")
    vocab = f.int("vocab_size")
    heads = spec.num_attention_heads
    # transformers defaults tie_word_embeddings to True (gemma-2 configs rely on it)
    tied = bool(f.get("tie_word_embeddings", True))
    counts = {
        "embed": vocab * hidden * (1 if tied else 2),
        "norms": hidden,
        "bias": 0,
        "linear": 0,
        "experts": 0,
        "vision": vision_parameters(f.get("vision_config")),
    }
    n_experts = f.int("num_experts", default=0) or f.int("n_routed_experts", default=0)
    n_experts = n_experts or f.int("num_local_experts", default=0)
    first_dense = f.int("first_k_dense_replace", default=0)
    shared = f.int("n_shared_experts", default=0)
    qkv_bias, o_bias = attention_biases(spec)
    for i, kind in enumerate(spec.layer_kinds):
        counts["norms"] += 2 * hidden
        if kind == "linear":
            la = spec.linear_attention
            kd = la["num_key_heads"] * la["key_head_dim"]
            vd = la["num_value_heads"] * la["value_head_dim"]
            counts["linear"] += hidden * (2 * kd + 2 * vd) + hidden * 2 * la["num_value_heads"]
            counts["linear"] += vd * hidden + (2 * kd + vd) * la["conv_kernel"]
        elif spec.is_mla:
            q_rank = f.int("q_lora_rank", default=0)
            nope, rope = f.int("qk_nope_head_dim"), spec.qk_rope_head_dim or 0
            qdim = heads * (nope + rope)
            q = hidden * q_rank + q_rank * qdim if q_rank else hidden * qdim
            kv_a = hidden * (spec.kv_lora_rank + rope)
            kv_b = spec.kv_lora_rank * heads * (nope + spec.v_head_dim)
            counts["linear"] += q + kv_a + kv_b + heads * spec.v_head_dim * hidden
        else:
            q = hidden * heads * spec.head_dim
            kv = hidden * spec.num_kv_heads * (spec.head_dim + spec.v_head_dim)
            counts["linear"] += q + kv + heads * spec.v_head_dim * hidden
            if qkv_bias:
                counts["bias"] += heads * spec.head_dim
                counts["bias"] += spec.num_kv_heads * (spec.head_dim + spec.v_head_dim)
            if o_bias:
                counts["bias"] += hidden
        if n_experts and i >= first_dense:
            inter = f.int("moe_intermediate_size", default=0) or f.int("intermediate_size")
            counts["experts"] += n_experts * 3 * hidden * inter
            counts["linear"] += shared * 3 * hidden * inter
            shared_inter = f.int("shared_expert_intermediate_size", default=0)
            counts["linear"] += 3 * hidden * shared_inter
            counts["norms"] += hidden * n_experts  # router
        else:
            counts["linear"] += 3 * hidden * f.int("intermediate_size")
    return counts


def vision_parameters(v) -> int:
    """Parameters of a ViT vision tower described by a ``vision_config`` dict (0 if there is none).

    Qwen2-VL-family layout: a patch embedding (``in_chans x temporal_patch_size x patch_size^2 x
    width``), ``depth`` blocks of fused-qkv attention (``4 width^2`` + biases), an MLP gated when
    ``hidden_act`` is ``silu`` (gate/up/down, ``3 width x intermediate``) else two layers, two
    norms (counted with biases: exact for LayerNorm, an upper bound where the model uses RMSNorm),
    learned position embeddings (``num_position_embeddings x width``) and the patch merger
    (``spatial_merge_size^2`` patches into one: norm, ``m x m`` and ``m x out`` with
    ``m = spatial_merge_size^2 x width``). Without it the pool of a vision-language model is sized
    with the tower's weights missing (Qwen2.5-VL-7B: 0.68 B parameters, 1.35 GB in bf16).

    The ViT width: Qwen2.5-VL names it ``hidden_size`` (merger output ``out_hidden_size``, else
    the width). Qwen2-VL names it ``embed_dim`` with ``mlp_ratio`` (MLP width ``embed_dim x
    mlp_ratio`` unless ``intermediate_size`` is given; ratio 4 when absent) and uses
    ``hidden_size`` for the merger output, the language model's width (``out_hidden_size`` wins
    if given): with ``embed_dim`` present it is the width. Reading Qwen2-VL-7B's ``hidden_size``
    (3584) as the width counted its 0.68 B tower as 5.2 B.

    Raises
    ------
    ModelConfigError
        ``vision_config`` is not a dict, a field is not a non-negative int, or ``mlp_ratio``
        is not a non-negative whole number (an int or an integral float such as ``4.0``).
    """
    if v is None:
        return 0
    if not isinstance(v, dict):
        raise ModelConfigError(f"`vision_config` must be a dict, got {type(v).__name__}")

    def num(key: str, default: int | None = None) -> int:
        x = v.get(key, default)
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ModelConfigError(f"`vision_config.{key}` = {x!r}: must be a non-negative int")
        return x

    if "depth" not in v or ("hidden_size" not in v and "embed_dim" not in v):
        return 0  # not a ViT description this estimate knows
    depth = num("depth")
    if "embed_dim" in v:  # Qwen2-VL: hidden_size is the merger's output (the LM width)
        h = num("embed_dim")
        ratio = v.get("mlp_ratio", 4)
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not 0 <= ratio < 1 << 20
            or ratio != int(ratio)
        ):
            raise ModelConfigError(
                f"`vision_config.mlp_ratio` = {ratio!r}: must be a non-negative whole number "
                "(the MLP width is embed_dim x mlp_ratio)"
            )
        inter = num("intermediate_size", h * int(ratio))
        out = num("out_hidden_size", num("hidden_size", h))
    else:  # Qwen2.5-VL: hidden_size is the ViT width
        h = num("hidden_size")
        inter = num("intermediate_size", 4 * h)
        out = num("out_hidden_size", h)
    gated = v.get("hidden_act") == "silu"
    mlp = (3 * h * inter + 2 * inter + h) if gated else (2 * h * inter + inter + h)
    block = 4 * h * h + 4 * h + mlp + 4 * h  # qkv + proj with biases, MLP, two norms
    chans = num("in_chans", num("in_channels", 3))
    patch = chans * num("temporal_patch_size", 1) * num("patch_size") ** 2 * h
    m = num("spatial_merge_size", 1) ** 2 * h
    merger = 2 * h + m * m + m + m * out + out
    return depth * block + patch + merger + num("num_position_embeddings", 0) * h


def estimate_weight_bytes(spec: ModelSpec) -> int:
    """Estimated bytes of the model's weights on one device (no TP split), see module doc."""
    c = parameter_counts(spec)
    wb = DTYPE_BYTES[spec.dtype]
    q = spec.fields.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower() if isinstance(q, dict) else ""
    plain = (c["embed"] + c["norms"] + c["bias"] + c["vision"]) * wb
    if method == "fp8":
        # 1 byte per weight + one fp32 scale per 128x128 block.
        per = 1 + 4 / (128 * 128)
        return int(plain + (c["linear"] + c["experts"]) * per)
    if method == "mxfp4":
        return int(plain + c["linear"] * wb + c["experts"] * (0.5 + 1 / 32))
    return plain + (c["linear"] + c["experts"]) * wb


def weight_bytes(spec: ModelSpec) -> tuple[int, str]:
    """Weight bytes and where they came from (``"checkpoint"`` or ``"estimate"``)."""
    exact = checkpoint_bytes(spec)
    if exact is not None:
        return exact, "checkpoint"
    return estimate_weight_bytes(spec), "estimate"
