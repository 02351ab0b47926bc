"""ModelSpec facts read from config.json: KV-shared layers, MTP layers, consistency errors."""

from __future__ import annotations

import json
import re
from importlib import resources

import kvpool
import pytest
from kvpool import ModelConfigError, ModelSpec


def bundled(name: str) -> dict:
    f = resources.files("kvpool").joinpath("models", name.replace("/", "--") + ".json")
    return json.loads(f.read_text())


# A Gemma-3n-E2B-style text config: 30 layers, every 5th full (layer i full iff (i + 1) % 5 == 0,
# transformers' Gemma3nTextConfig default pattern), the last 10 layers share KV.
GEMMA3N = {
    "model_type": "gemma3n_text",
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_size": 2048,
    "sliding_window": 512,
    "layer_types": [
        "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(30)
    ],
    "num_kv_shared_layers": 10,
    "torch_dtype": "bfloat16",
}


def test_gemma3n_shared_layers_read_the_last_layer_of_their_type():
    spec = ModelSpec.from_dict(GEMMA3N)
    # layers 0..19 own KV; 20..29 share. Before layer 20 the last full layer is 19 and the last
    # sliding one 18; among 20..29 the full ones are 24 and 29.
    expected = {i: (19 if i in (24, 29) else 18) for i in range(20, 30)}
    assert spec.kv_shared_sources == expected
    assert spec.layer_kinds[:20] == tuple(
        "full" if (i + 1) % 5 == 0 else "sliding" for i in range(20)
    )
    assert spec.layer_kinds[20:] == ("shared",) * 10
    assert spec.sliding_window == 512
    assert spec.num_nextn_predict_layers == 0


def test_nested_gemma3n_config():
    spec = ModelSpec.from_dict({"model_type": "gemma3n", "text_config": GEMMA3N})
    assert spec.kv_shared_sources[29] == 19


def test_no_shared_layers_by_default():
    spec = ModelSpec.from_pretrained("meta-llama/Llama-3.1-8B")
    assert spec.kv_shared_sources == {}
    assert "shared" not in spec.layer_kinds
    assert (spec.sliding_head_dim, spec.sliding_v_head_dim) == (None, None)


@pytest.mark.parametrize("n", [30, 31, 1000])
def test_more_shared_layers_than_layers(n):
    with pytest.raises(ModelConfigError, match="`num_kv_shared_layers`"):
        ModelSpec.from_dict({**GEMMA3N, "num_kv_shared_layers": n})


def test_shared_type_with_no_earlier_layer_of_that_type():
    # layers 0..27 sliding, 28..29 full and shared: no full layer before 28 owns KV
    types = ["sliding_attention"] * 28 + ["full_attention"] * 2
    with pytest.raises(ModelConfigError, match="`num_kv_shared_layers` = 2: shared layer 28"):
        ModelSpec.from_dict({**GEMMA3N, "layer_types": types, "num_kv_shared_layers": 2})


def test_linear_layers_do_not_share_kv():
    cfg = {**bundled("Qwen/Qwen3-Next-80B-A3B-Thinking"), "num_kv_shared_layers": 1}
    # its last layer (47) is full attention: shares layer 43's KV
    assert ModelSpec.from_dict(cfg).kv_shared_sources == {47: 43}
    with pytest.raises(ModelConfigError, match="linear-attention layer 46"):
        ModelSpec.from_dict({**cfg, "num_kv_shared_layers": 2})


@pytest.mark.parametrize("bad", [-1, "10", 2.0, True])
def test_shared_count_must_be_an_int(bad):
    with pytest.raises(ModelConfigError, match="num_kv_shared_layers"):
        ModelSpec.from_dict({**GEMMA3N, "num_kv_shared_layers": bad})


@pytest.mark.parametrize(
    "name, n",
    [("deepseek-ai/DeepSeek-V3", 1), ("deepseek-ai/DeepSeek-R1", 1),
     ("moonshotai/Kimi-K2-Instruct", 0), ("Qwen/Qwen3.5-27B", 1), ("Qwen/Qwen3-8B", 0),
     ("openai/gpt-oss-20b", 0)],
)  # fmt: skip
def test_num_nextn_predict_layers(name, n):
    spec = ModelSpec.from_pretrained(name)
    assert spec.num_nextn_predict_layers == n
    assert spec.num_layers == spec.fields.int("num_hidden_layers")  # MTP layers not in the kinds


def test_bad_nextn_count():
    with pytest.raises(ModelConfigError, match="num_nextn_predict_layers"):
        ModelSpec.from_dict({**bundled("deepseek-ai/DeepSeek-V3"), "num_nextn_predict_layers": -1})


def test_geometry_unchanged_for_models_without_new_facts():
    plan = kvpool.size_for("meta-llama/Llama-3.1-8B", "bf16", num_tokens=16)
    # 32 layers x 8 KV heads x 128 x (K + V) x 2 B
    assert plan.bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072


# ------------------------------------------------------------------ inconsistent configs
NEXT = "Qwen/Qwen3-Next-80B-A3B-Thinking"


@pytest.mark.parametrize("model, patch, text", [
    # layer_types of the wrong length, or naming no known kind
    ("openai/gpt-oss-20b", {"layer_types": ["sliding_attention"] * 23},
     "`layer_types` must list one entry per layer (24), got 23"),
    ("openai/gpt-oss-20b", {"layer_types": "sliding_attention"},
     "`layer_types` must list one entry per layer (24), got str"),
    ("openai/gpt-oss-20b", {"layer_types": [None] * 24}, "`layer_types[0]` must be a string"),
    # sliding layers without a positive window
    ("openai/gpt-oss-20b", {"sliding_window": 0}, "no positive `sliding_window`"),
    ("openai/gpt-oss-20b", {"sliding_window": None}, "no positive `sliding_window`"),
    ("openai/gpt-oss-20b", {"sliding_window": -128}, "`sliding_window` must be a non-negative"),
    ("openai/gpt-oss-20b", {"sliding_window": 128.0}, "`sliding_window` must be a non-negative"),
    ("google/gemma-2-9b-it", {"sliding_window": 0}, "no positive `sliding_window`"),
    ("Qwen/Qwen3-8B", {"use_sliding_window": "yes", "sliding_window": 4096},
     "`use_sliding_window` must be true, false or null, got 'yes'"),
    # linear-attention fields
    (NEXT, {"linear_num_value_heads": 24}, "`linear_num_value_heads` = 24 is not a multiple of "
     "`linear_num_key_heads` = 16"),
    (NEXT, {"linear_key_head_dim": 0}, "`linear_key_head_dim` must be positive, got 0"),
    (NEXT, {"linear_num_key_heads": -1}, "`linear_num_key_heads` must be a non-negative"),
    (NEXT, {"full_attention_interval": 0}, "`full_attention_interval` must be positive"),
    # MLA
    ("deepseek-ai/DeepSeek-V3", {"kv_lora_rank": 0}, "`kv_lora_rank` must be positive, got 0"),
    # shared KV
    ("google/gemma-2-9b-it", {"num_kv_shared_layers": 42}, "`num_kv_shared_layers` = 42 leaves"),
])  # fmt: skip
def test_inconsistent_config_names_the_field(model, patch, text):
    cfg = {**bundled(model), **patch}
    with pytest.raises(ModelConfigError, match=re.escape(text)):
        ModelSpec.from_dict(cfg)


def test_consistent_shared_config_on_a_bundled_model():
    # gemma-2-9b: 42 layers alternating; the last 2 (40 sliding, 41 full) read 38 and 39
    spec = ModelSpec.from_dict({**bundled("google/gemma-2-9b-it"), "num_kv_shared_layers": 2})
    assert spec.kv_shared_sources == {40: 38, 41: 39}
    assert spec.layer_kinds[-3:] == ("full", "shared", "shared")


def test_config_swa_head_dims():
    cfg = {**bundled("openai/gpt-oss-20b"), "swa_head_dim": 32}
    spec = ModelSpec.from_dict(cfg)
    # V of the sliding layers follows swa_head_dim unless swa_v_head_dim says otherwise
    assert (spec.head_dim, spec.sliding_head_dim, spec.sliding_v_head_dim) == (64, 32, 32)
    spec = ModelSpec.from_dict({**cfg, "swa_v_head_dim": 64})
    assert (spec.sliding_head_dim, spec.sliding_v_head_dim) == (32, None)
    # no sliding layers: nothing differs
    llama = {**bundled("meta-llama/Llama-3.1-8B"), "swa_head_dim": 32}
    assert ModelSpec.from_dict(llama).sliding_head_dim is None
    with pytest.raises(ModelConfigError, match="`swa_head_dim` must be positive, got 0"):
        ModelSpec.from_dict({**cfg, "swa_head_dim": 0})


@pytest.mark.parametrize("patch, name", [
    ({"swa_num_key_value_heads": 4}, "swa_num_key_value_heads"),
    ({"swa_num_attention_heads": 32}, "swa_num_attention_heads"),
    ({"global_head_dim": 512}, "global_head_dim"),
    ({"num_global_key_value_heads": 2}, "num_global_key_value_heads"),
])  # fmt: skip
def test_per_kind_head_counts_are_refused(patch, name):
    with pytest.raises(ModelConfigError, match=f"`{name}` = "):
        ModelSpec.from_dict({**bundled("openai/gpt-oss-20b"), **patch})
    # the same counts as the full layers are no difference
    same = {"swa_num_key_value_heads": 8, "swa_num_attention_heads": 64}
    assert ModelSpec.from_dict({**bundled("openai/gpt-oss-20b"), **same}).num_kv_heads == 8


def test_huge_linear_attention_dims_are_refused_naming_the_field():
    # 2^40-wide heads would overflow the state bytes later (a bare OverflowError in size_for)
    cfg = json.loads(json.dumps(kvpool.ModelSpec.from_pretrained("Qwen/Qwen3.5-27B").config))
    scope = cfg.get("text_config", cfg)
    scope["linear_key_head_dim"] = 2**40
    with pytest.raises(kvpool.ModelConfigError, match="linear_key_head_dim"):
        kvpool.ModelSpec.from_dict(cfg)
