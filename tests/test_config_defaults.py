"""Fields absent from config.json take the transformers class default of the architecture.

For every bundled config and every field of its defaults-table entry: the config with the field
deleted must size exactly like the config with the field set to the table's default (the same
spec and weight estimate, or the same error), and like the full config when the bundled value is
the default. Hand-worked specs of minimal configs check the table's values themselves.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from importlib import resources

import kvpool
import pytest
from kvpool import ModelConfigError, ModelSpec
from kvpool.config import bundled_models
from kvpool.config_defaults import ALIASES, DEFAULTS, SLIDING_PERIOD, table_entry
from kvpool.weights import weight_bytes

_META = {"name", "config", "path", "defaults_from", "defaulted_fields"}


def bundled(name: str) -> dict:
    f = resources.files("kvpool").joinpath("models", name.replace("/", "--") + ".json")
    return json.loads(f.read_text())


def scopes(cfg: dict) -> list[dict]:
    out = [cfg]
    for k in ("text_config", "language_config", "llm_config", "thinker_config"):
        if isinstance(cfg.get(k), dict):
            out += scopes(cfg[k])
    return out


def outcome(cfg: dict):
    """What sizing sees of a config: the spec's facts and the weight estimate, or the error."""
    try:
        spec = ModelSpec.from_dict(cfg)
    except ModelConfigError as e:
        return ("error", str(e))
    facts = {k: v for k, v in dataclasses.asdict(spec).items() if k not in _META}
    return facts, weight_bytes(spec)


def entry_of(cfg: dict) -> str | None:
    types = [s["model_type"] for s in reversed(scopes(cfg)) if "model_type" in s]
    return table_entry(types[0]) if types else None


FIELD_CASES = [
    (m, field)
    for m in bundled_models()
    if entry_of(bundled(m)) is not None
    for field in DEFAULTS[entry_of(bundled(m))]
    if any(field in s for s in scopes(bundled(m)))
]


def test_every_bundled_family_has_an_entry():
    for m in bundled_models():
        assert entry_of(bundled(m)) is not None, m
    # and the cases below cover every entry a bundled model uses
    assert {entry_of(bundled(m)) for m in bundled_models()} == {
        "llama", "mixtral", "qwen2_5_vl_text", "qwen3", "qwen3_moe", "qwen3_next",
        "qwen3_5_text", "qwen3_5_moe_text", "gemma2", "gpt_oss", "deepseek_v3",
    }  # fmt: skip


@pytest.mark.parametrize("model, field", FIELD_CASES)
def test_deleted_field_sizes_as_its_default(model, field):
    full = bundled(model)
    default = DEFAULTS[entry_of(full)][field]
    deleted, set_to_default = copy.deepcopy(full), copy.deepcopy(full)
    for s in scopes(deleted):
        s.pop(field, None)
    bundled_value = None
    for s in scopes(set_to_default):
        if field in s:
            bundled_value = s[field]
            s[field] = default
    assert outcome(deleted) == outcome(set_to_default)
    if bundled_value == default:
        assert outcome(deleted) == outcome(full)


def test_defaulted_fields_are_recorded():
    cfg = bundled("Qwen/Qwen3-Next-80B-A3B-Thinking")
    del cfg["linear_conv_kernel_dim"], cfg["head_dim"]
    spec = ModelSpec.from_dict(cfg)
    assert spec.defaults_from == "qwen3_next"
    assert set(spec.defaulted_fields) == {"linear_conv_kernel_dim", "head_dim"}
    assert spec.linear_attention["conv_kernel"] == 4 and spec.head_dim == 256
    assert ModelSpec.from_pretrained("Qwen/Qwen3-8B").defaulted_fields == ()


# ------------------------------------------------------------------ hand-worked minimal configs
def test_qwen3_next_from_model_type_alone():
    """Qwen3NextConfig(): 48 layers, full iff (i + 1) % 4 == 0 (12 full), 2 KV heads x 256.

    KV per token, bf16: 12 layers x 2 heads x 256 x (K + V) x 2 B = 24,576 B.
    Linear state per layer at tp 1: conv (2 * 16 * 128 + 32 * 128) x (4 - 1) x 2 B = 49,152 B;
    ssm 32 x 128 x 128 x 4 B (fp32) = 2,097,152 B.
    """
    spec = ModelSpec.from_dict({"model_type": "qwen3_next"})
    assert spec.layer_kinds == tuple(
        "full" if (i + 1) % 4 == 0 else "linear" for i in range(48)
    )
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (16, 2, 256)
    assert spec.linear_state_bytes(1) == (49_152, 2_097_152)
    assert kvpool.size_for(spec, "bf16", num_tokens=16).bytes_per_token == 24_576


def test_gemma3_composite_without_text_fields():
    """Gemma3TextConfig(): 26 layers, full iff (i + 1) % 6 == 0 (layers 5, 11, 17, 23), window
    4096, 4 KV heads x 256. bf16 per token: 26 x 4 x 256 x 2 x 2 B = 106,496 B."""
    spec = ModelSpec.from_dict({"model_type": "gemma3", "text_config": {}})
    full = [i for i, k in enumerate(spec.layer_kinds) if k == "full"]
    assert full == [5, 11, 17, 23] and spec.num_layers == 26
    assert (spec.sliding_window, spec.num_kv_heads, spec.head_dim) == (4096, 4, 256)
    # 26 layers x K and V x 4 heads x 256 x 2 bytes = 106,496 bytes a token: 4 full layers in the
    # primary page space (16,384), 22 sliding ones in their own (90,112)
    spaces = kvpool.size_for(spec, "bf16", num_tokens=16).page_spaces
    assert spaces["primary"]["bytes_per_token"] == 16_384
    assert sum(s["bytes_per_token"] for s in spaces.values()) == 106_496


def test_gemma3n_shares_kv_by_default():
    """Gemma3nTextConfig(): 35 layers, full iff (i + 1) % 5 == 0, the last 15 share KV: layers
    20..34 read layer 19 (full) or 18 (sliding)."""
    text = {"model_type": "gemma3n_text"}
    spec = ModelSpec.from_dict({"model_type": "gemma3n", "text_config": text})
    assert spec.num_layers == 35 and spec.sliding_window == 512
    assert spec.kv_shared_sources == {i: 19 if (i + 1) % 5 == 0 else 18 for i in range(20, 35)}


def test_deepseek_v3_from_model_type_alone():
    """DeepseekV3Config(): 61 MLA layers of kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values;
    bf16 per token 61 x 576 x 2 B = 70,272 B; one MTP layer."""
    spec = ModelSpec.from_dict({"model_type": "deepseek_v3"})
    assert (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.v_head_dim) == (512, 64, 128)
    assert spec.head_dim == 128 + 64 and spec.num_nextn_predict_layers == 1
    assert kvpool.size_for(spec, "bf16", num_tokens=16).bytes_per_token == 70_272
    # Kimi-K2's own model_type reads the same class
    assert ModelSpec.from_dict({"model_type": "kimi_k2"}).kv_lora_rank == 512


@pytest.mark.parametrize("model", ["openai/gpt-oss-20b", "google/gemma-2-9b-it"])
def test_fixed_pattern_without_layer_types(model):
    cfg = bundled(model)
    cfg.pop("layer_types", None)
    kinds = ModelSpec.from_dict(cfg).layer_kinds
    assert kinds == ModelSpec.from_pretrained(model).layer_kinds
    assert kinds == tuple("sliding" if i % 2 == 0 else "full" for i in range(len(kinds)))


def test_gpt_oss_from_model_type_alone():
    """GptOssConfig(): 36 layers alternating (18 sliding over 128 tokens), 8 KV heads x 64."""
    spec = ModelSpec.from_dict({"model_type": "gpt_oss"})
    assert spec.layer_kinds.count("sliding") == 18 and spec.layer_kinds[0] == "sliding"
    assert (spec.sliding_window, spec.num_kv_heads, spec.head_dim) == (128, 8, 64)


def test_null_is_not_absent():
    # Qwen3: use_sliding_window True with the window absent takes 4096, from layer 28 on
    cfg = {k: v for k, v in bundled("Qwen/Qwen3-8B").items() if k != "sliding_window"}
    spec = ModelSpec.from_dict({**cfg, "use_sliding_window": True, "max_window_layers": 28})
    assert spec.sliding_window == 4096
    assert spec.layer_kinds == ("full",) * 28 + ("sliding",) * 8
    # the same config with `"sliding_window": null` has no window at all
    spec = ModelSpec.from_dict({**cfg, "use_sliding_window": True, "sliding_window": None})
    assert spec.layer_kinds == ("full",) * 36 and spec.sliding_window is None


def test_mistral_default_window_slides_every_layer():
    spec = ModelSpec.from_dict({"model_type": "mistral"})
    assert spec.layer_kinds == ("sliding",) * 32 and spec.sliding_window == 4096
    # Mixtral's default window is None: all full
    assert ModelSpec.from_dict({"model_type": "mixtral"}).layer_kinds == ("full",) * 32


def test_flat_vl_config_reads_the_text_class():
    spec = ModelSpec.from_dict({"model_type": "qwen2_5_vl"})
    assert (spec.num_layers, spec.num_attention_heads, spec.num_kv_heads) == (80, 64, 8)
    assert spec.head_dim == 8192 // 64 and spec.defaults_from == "qwen2_5_vl_text"


# ------------------------------------------------------------------ no default: still an error
def test_unknown_model_type_gets_no_defaults():
    with pytest.raises(ModelConfigError, match="^model config lacks `num_hidden_layers`$"):
        ModelSpec.from_dict({"model_type": "my_arch"})
    # an unknown inner model_type is not read with the outer composite's class
    with pytest.raises(ModelConfigError, match="lacks `num_hidden_layers`"):
        ModelSpec.from_dict({"model_type": "gemma3", "text_config": {"model_type": "x_text"}})


def test_field_without_a_default_names_the_field_and_type():
    with pytest.raises(ModelConfigError, match="lacks `qk_rope_head_dim`, which has no "
                       "transformers default for `model_type` `llama`"):  # fmt: skip
        ModelSpec.from_dict({"model_type": "llama", "kv_lora_rank": 512})


def test_defaults_can_be_turned_off():
    with pytest.raises(ModelConfigError, match="lacks `num_hidden_layers`"):
        ModelSpec.from_dict({"model_type": "llama"}, defaults=False)
    assert ModelSpec.from_dict({"model_type": "llama"}).num_layers == 32


# ------------------------------------------------------------------ the table itself
def test_table_is_well_formed():
    for key, row in DEFAULTS.items():
        for field, v in row.items():
            assert v is not None, (key, field)
            assert not isinstance(v, (list, dict)), (key, field)
    assert all(v in DEFAULTS for v in ALIASES.values())
    assert all(k in DEFAULTS for k in SLIDING_PERIOD)


# Fields the table takes from a configuration class's __post_init__ keyword defaults (or, for
# DeepSeek-V3, from the field `num_mtp_layers` behind an attribute_map) rather than a dataclass
# field of the same name.
_KWARG_DEFAULTS = {
    ("qwen3_next", "full_attention_interval"), ("qwen3_5_text", "full_attention_interval"),
    ("qwen3_5_moe_text", "full_attention_interval"), ("gemma3_text", "sliding_window_pattern"),
    ("cohere2", "sliding_window_pattern"), ("deepseek_v3", "num_nextn_predict_layers"),
    ("qwen2_vl_text", "tie_word_embeddings"), ("qwen2_5_vl_text", "tie_word_embeddings"),
}  # fmt: skip


def test_table_matches_transformers_when_installed():
    """Checked against the transformers release the table cites, where it is installed."""
    transformers = pytest.importorskip("transformers")
    if transformers.__version__ != "5.23.0":
        pytest.skip(f"table cites transformers 5.23.0, {transformers.__version__} installed")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for key, row in DEFAULTS.items():
        cls = CONFIG_MAPPING[key]
        declared = {f.name: f.default for f in dataclasses.fields(cls)}
        built = cls().to_dict()
        for field, v in row.items():
            if (key, field) in _KWARG_DEFAULTS:
                if field in built:
                    assert built[field] == v, (key, field)
                continue
            assert declared[field] == v, (key, field)
        layer_types = cls().layer_types if hasattr(cls(), "layer_types") else None
        if key in SLIDING_PERIOD or "sliding_window_pattern" in row:
            period = SLIDING_PERIOD.get(key) or row["sliding_window_pattern"]
            n = row["num_hidden_layers"]
            assert layer_types == [
                "full_attention" if (i + 1) % period == 0 else "sliding_attention"
                for i in range(n)
            ], key
