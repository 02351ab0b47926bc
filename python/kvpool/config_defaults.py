"""Hugging Face ``transformers`` class defaults of the architectures kvpool sizes (data only).

transformers 5 writes to ``config.json`` only the fields that differ from its configuration
class's defaults (``PreTrainedConfig.to_diff_dict``) and fills the others back in when it loads
the file, so an engine that loads a config through transformers sizes a model by fields the file
does not show. :class:`kvpool.ModelSpec` does the same with this table: a field absent from every
scope of the config (a field present as ``null`` is not absent) takes the default of the
language model's ``model_type``.

Values are the dataclass field defaults of ``transformers`` **5.23.0**,
``src/transformers/models/<dir>/configuration_<dir>.py`` (class named per entry). Only fields
kvpool reads for sizing are listed (geometry, layer pattern, linear-attention and MLA dims, MTP
layers, and what the weight estimate reads); a default of ``None`` (e.g. Llama's ``head_dim`` and
``num_key_value_heads``, derived from other fields) is left out, as kvpool derives those the same
way. The compute dtype has no class default (``dtype = None``): kvpool's own ``bf16`` default
stands, with ``dtype_source == "default"``.
"""

from __future__ import annotations

from typing import Any

#: ``model_type`` -> ``{field: default}``, transformers 5.23.0.
DEFAULTS: dict[str, dict[str, Any]] = {
    # LlamaConfig, models/llama/configuration_llama.py
    "llama": {
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "vocab_size": 32000, "intermediate_size": 11008, "tie_word_embeddings": False,
        "attention_bias": False,
    },
    # MistralConfig, models/mistral/configuration_mistral.py (every layer slides when
    # `sliding_window` is set: Mistral-7B-v0.1's 4096 is the class default)
    "mistral": {
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "sliding_window": 4096, "vocab_size": 32000,
        "intermediate_size": 14336, "tie_word_embeddings": False,
    },
    # MixtralConfig, models/mixtral/configuration_mixtral.py (sliding_window defaults to None)
    "mixtral": {
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 14336,
        "num_local_experts": 8, "tie_word_embeddings": False,
    },
    # Qwen2Config, models/qwen2/configuration_qwen2.py (the window applies only with
    # use_sliding_window, from layer max_window_layers on)
    "qwen2": {
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 32, "sliding_window": 4096, "use_sliding_window": False,
        "max_window_layers": 28, "vocab_size": 151936, "intermediate_size": 22016,
        "tie_word_embeddings": False,
    },
    # Qwen2VLTextConfig, models/qwen2_vl/configuration_qwen2_vl.py; tie_word_embeddings is
    # Qwen2VLConfig's (the composite class declares it)
    "qwen2_vl_text": {
        "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
        "num_key_value_heads": 8, "sliding_window": 4096, "use_sliding_window": False,
        "max_window_layers": 80, "vocab_size": 152064, "intermediate_size": 29568,
        "tie_word_embeddings": False,
    },
    # Qwen2_5_VLTextConfig, models/qwen2_5_vl/configuration_qwen2_5_vl.py; tie_word_embeddings
    # is Qwen2_5_VLConfig's
    "qwen2_5_vl_text": {
        "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
        "num_key_value_heads": 8, "sliding_window": 4096, "use_sliding_window": False,
        "max_window_layers": 80, "vocab_size": 152064, "intermediate_size": 29568,
        "tie_word_embeddings": False,
    },
    # Qwen3Config, models/qwen3/configuration_qwen3.py
    "qwen3": {
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096,
        "use_sliding_window": False, "max_window_layers": 28, "vocab_size": 151936,
        "intermediate_size": 22016, "tie_word_embeddings": False, "attention_bias": False,
    },
    # Qwen3MoeConfig, models/qwen3_moe/configuration_qwen3_moe.py (no head_dim field: derived)
    "qwen3_moe": {
        "num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 32,
        "num_key_value_heads": 4, "sliding_window": 4096, "use_sliding_window": False,
        "vocab_size": 151936, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "decoder_sparse_step": 1, "tie_word_embeddings": False,
        "attention_bias": False,
    },
    # Qwen3NextConfig, models/qwen3_next/configuration_qwen3_next.py; full_attention_interval is
    # the keyword default of its __post_init__ (layer i is full iff (i + 1) % 4 == 0)
    "qwen3_next": {
        "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 151936,
        "intermediate_size": 5632, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts": 512, "decoder_sparse_step": 1,
        "tie_word_embeddings": False, "attention_bias": False,
    },
    # Qwen3_5TextConfig, models/qwen3_5/configuration_qwen3_5.py (full_attention_interval as for
    # Qwen3-Next; tie_word_embeddings is Qwen3_5Config's)
    "qwen3_5_text": {
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 248320,
        "intermediate_size": 12288, "tie_word_embeddings": False, "attention_bias": False,
    },
    # Qwen3_5MoeTextConfig, models/qwen3_5_moe/configuration_qwen3_5_moe.py (as Qwen3.5)
    "qwen3_5_moe_text": {
        "num_hidden_layers": 40, "hidden_size": 2048, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 248320,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
        "tie_word_embeddings": False, "attention_bias": False,
    },
    # Gemma2Config, models/gemma2/configuration_gemma2.py
    "gemma2": {
        "num_hidden_layers": 26, "hidden_size": 2304, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096, "vocab_size": 256000,
        "intermediate_size": 9216, "tie_word_embeddings": True, "attention_bias": False,
    },
    # Gemma3TextConfig, models/gemma3/configuration_gemma3.py; sliding_window_pattern is the
    # keyword default of its __post_init__ (layer i is full iff (i + 1) % 6 == 0)
    "gemma3_text": {
        "num_hidden_layers": 26, "hidden_size": 2304, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
        "sliding_window_pattern": 6, "vocab_size": 262208, "intermediate_size": 9216,
        "tie_word_embeddings": True, "attention_bias": False,
    },
    # Gemma3nTextConfig, models/gemma3n/configuration_gemma3n.py (intermediate_size is one value
    # per layer after __post_init__; 16384 for every layer by default)
    "gemma3n_text": {
        "num_hidden_layers": 35, "hidden_size": 2048, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "sliding_window": 512,
        "num_kv_shared_layers": 15, "vocab_size": 262400, "intermediate_size": 16384,
        "tie_word_embeddings": True, "attention_bias": False,
    },
    # GptOssConfig, models/gpt_oss/configuration_gpt_oss.py
    "gpt_oss": {
        "num_hidden_layers": 36, "hidden_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "vocab_size": 201088,
        "intermediate_size": 2880, "num_local_experts": 128, "tie_word_embeddings": False,
        "attention_bias": True,
    },
    # DeepseekV3Config, models/deepseek_v3/configuration_deepseek_v3.py; its field
    # `num_mtp_layers` = 1 is what `num_nextn_predict_layers` reads (attribute_map)
    "deepseek_v3": {
        "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
        "num_key_value_heads": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "num_nextn_predict_layers": 1, "vocab_size": 129280, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "first_k_dense_replace": 3, "tie_word_embeddings": False, "attention_bias": False,
    },
    # Cohere2Config, models/cohere2/configuration_cohere2.py; sliding_window_pattern is the
    # keyword default of its __post_init__ (layer i is full iff (i + 1) % 4 == 0)
    "cohere2": {
        "num_hidden_layers": 40, "hidden_size": 8192, "num_attention_heads": 64,
        "sliding_window": 4096, "sliding_window_pattern": 4, "vocab_size": 256000,
        "intermediate_size": 22528, "tie_word_embeddings": True, "attention_bias": False,
    },
}  # fmt: skip

#: ``model_type`` of a composite (multimodal) config, or of a checkpoint's own remote-code class
#: -> the table entry of its language model. Kimi-K2 ships its own ``DeepseekV3Config``
#: (``auto_map``) under ``model_type`` ``kimi_k2``; transformers' class stands in for it.
ALIASES: dict[str, str] = {
    "qwen2_vl": "qwen2_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "gemma3": "gemma3_text",
    "gemma3n": "gemma3n_text",
    "kimi_k2": "deepseek_v3",
}

#: Architectures whose ``__post_init__`` builds ``layer_types`` with a fixed period when the
#: config has none: layer ``i`` is full attention iff ``(i + 1) % period == 0``, sliding
#: otherwise (no config field sets the period; transformers 5.23.0).
SLIDING_PERIOD: dict[str, int] = {
    "gemma2": 2,  # Gemma2Config: even layers slide
    "gpt_oss": 2,  # GptOssConfig: even layers slide
    "gemma3n_text": 5,  # Gemma3nTextConfig: every 5th layer full
}


def table_entry(model_type: object) -> str | None:
    """The :data:`DEFAULTS` key for a config's ``model_type`` (aliases resolved), or ``None``."""
    if not isinstance(model_type, str):
        return None
    key = ALIASES.get(model_type, model_type)
    return key if key in DEFAULTS else None
