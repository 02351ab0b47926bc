"""The pool-sizing failure cases of docs/architecture.md (KVB-01, 03, 05, 07) and the issue's
hand-worked values. Every expected number is worked out by hand in the comment beside it."""

import copy

import kvpool
import pytest

GIB = 1 << 30


def budget_of(b):
    """size_for arguments giving a pool budget of exactly `b` bytes (fake device, no weights)."""
    return dict(mem_frac=0.5, total_memory=2 * b, weights=0)


# --------------------------------------------------------------------------- KVB-01
QWEN3_4B = {"hidden_size": 2560, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "num_hidden_layers": 36}


def test_kvb01_explicit_head_dim_wins():
    plan = kvpool.size_for(QWEN3_4B, "bf16", **budget_of(8 * GIB))
    # 2 (K,V) x 36 layers x 8 heads x 128 x 2 bytes; the derived 2560/32 = 80 would give 92,160.
    assert plan.bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    # floor(8 GiB / 147,456) - 1 padding row = 58,254 - 1
    assert plan.num_tokens == 58_253


def test_kvb01_null_head_dim_falls_back_to_hidden_over_heads():
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": None, "num_hidden_layers": 32}
    plan = kvpool.size_for(cfg, "bf16", **budget_of(8 * GIB))
    assert plan.bytes_per_token == 2 * 32 * 8 * (4096 // 32) * 2 == 131_072


def test_kvb01_indivisible_hidden_without_head_dim_is_an_error():
    cfg = {"hidden_size": 4000, "num_attention_heads": 48, "num_key_value_heads": 8,
           "num_hidden_layers": 32}
    with pytest.raises(kvpool.ModelConfigError, match="4000.*not divisible.*48"):
        kvpool.size_for(cfg, "bf16", **budget_of(8 * GIB))


# --------------------------------------------------------------------------- KVB-03
GPT_OSS_LIKE = {"num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
                "head_dim": 64, "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}


def test_kvb03_sliding_layers_windowed_not_dropped():
    plan = kvpool.size_for(GPT_OSS_LIKE, "bf16", **budget_of(GIB))
    per_layer = 2 * 8 * 64 * 2
    assert per_layer == 2048
    # 18 x n x 2048 + 18 x min(n, 128) x 2048
    assert plan.request_bytes(100) == 18 * 100 * 2048 + 18 * 100 * 2048 == 7_372_800
    assert plan.request_bytes(8192) == 18 * 8192 * 2048 + 18 * 128 * 2048 == 306_708_480
    assert plan.request_bytes(8192) not in (603_979_776, 301_989_888)
    assert plan.request_bytes(100) != 3_686_400
    # full-length requests that fit a 1 GiB budget: 3 (window ignored: 1)
    assert plan.budget_bytes // plan.request_bytes(8192) == 3
    # the pool stores sliding layers in their own page space (issue 16): the primary space's
    # rows cost the 18 full layers only, and 3 requests of 8k really fit
    assert plan.bytes_per_token == 18 * per_layer
    assert plan.page_spaces["sliding_128"]["bytes_per_token"] == 18 * per_layer
    # the sliding space keeps one prefill chunk of headroom: min(8192, 8192 - 128) = 8,064 pages
    # x 36,864 B = 297 MB, which costs one request at this budget; 512-token chunks cost little
    assert plan.page_spaces["sliding_128"]["headroom_pages"] == 8_064
    assert plan.requests_fit(8192) == 2
    small_chunks = kvpool.size_for(GPT_OSS_LIKE, "bf16", chunked_prefill_size=512,
                                   **budget_of(GIB))
    assert small_chunks.page_spaces["sliding_128"]["headroom_pages"] == 512
    assert small_chunks.requests_fit(8192) == 3


@pytest.mark.parametrize("page_size", [16, 64])
def test_kvb03_paged_sliding_layers_hold_at_most_one_extra_page(page_size):
    plan = kvpool.size_for(GPT_OSS_LIKE, "bf16", page_size=page_size, **budget_of(GIB))
    n = 8192
    full = 18 * n * 2048  # 8192 is a page multiple
    windowed = 18 * ((128 + page_size - 1) // page_size * page_size + page_size) * 2048
    assert plan.request_bytes(n) == full + windowed
    # within one extra page per sliding layer of the exact count
    assert plan.request_bytes(n) - (full + 18 * 128 * 2048) <= 18 * 2 * page_size * 2048


def test_layer_types_wins_over_interval():
    cfg = dict(GPT_OSS_LIKE, full_attention_interval=4)
    assert kvpool.ModelSpec.from_dict(cfg).layer_kinds[:2] == ("sliding", "full")


# --------------------------------------------------------------------------- KVB-05
LLAMA3_70B = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "head_dim": 128, "hidden_size": 8192}


@pytest.mark.parametrize(
    "tp, expected",
    # 2 x 80 x heads_per_rank x 128 x 2, heads_per_rank = max(1, 8 // tp)
    [(1, 327_680), (2, 163_840), (4, 81_920), (8, 40_960), (16, 40_960), (32, 40_960)],
)
def test_kvb05_heads_per_rank(tp, expected):
    plan = kvpool.size_for(LLAMA3_70B, "bf16", tp_size=tp, **budget_of(40 * GIB))
    assert plan.bytes_per_token == expected
    assert plan.kv_heads_per_rank == max(1, 8 // tp)


@pytest.mark.parametrize("tp", [3, 12, 5])
def test_kvb05_tp_that_does_not_fit_the_heads_is_an_error(tp):
    with pytest.raises(kvpool.ModelConfigError, match=f"tp_size `{tp}`"):
        kvpool.size_for(LLAMA3_70B, "bf16", tp_size=tp, **budget_of(40 * GIB))


def test_kvb05_capacity_per_rank_at_tp4():
    plan = kvpool.size_for(LLAMA3_70B, "bf16", tp_size=4, **budget_of(40 * GIB))
    assert plan.num_tokens == 40 * GIB // 81_920 - 1 == 524_287


# --------------------------------------------------------------------------- KVB-07
LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "hidden_size": 4096}


@pytest.mark.parametrize(
    "dtype, bpt, fixed, tokens",
    [
        ("bf16", 131_072, 0, 81_919),
        # fp8 and nvfp4 keep one fp32 scale per layer for K and V: 32 x 2 x 4 = 256 fixed bytes
        ("fp8_e4m3", 65_536, 256, 163_838),
        ("fp8_e5m2", 65_536, 256, 163_838),
        # FP4: per layer per token K = 8 x 64 data + 8 x 8 scale bytes = 576, V the same
        ("nvfp4", 32 * 1_152, 256, 291_270),
        ("fp4_mx_block16", 32 * 1_152, 0, 291_270),
    ],
)
def test_kvb07_fp4_counts_scales(dtype, bpt, fixed, tokens):
    plan = kvpool.size_for(LLAMA3_8B, dtype, **budget_of(10 * GIB))
    assert plan.bytes_per_token == bpt
    assert plan.fixed_bytes == fixed
    assert plan.num_tokens == tokens
    rows = tokens + 1
    layer0 = [b for b in plan.buffers if b.layer == 0 and b.role != "scale"]
    assert sum(b.nbytes for b in plan.buffers) == bpt * rows + fixed == plan.total_bytes
    if dtype in ("nvfp4", "fp4_mx_block16"):
        # four per-token buffers per layer: K data, V data, K scales, V scales
        assert len(layer0) == 4
        assert sum(b.nbytes for b in layer0) == 1_152 * rows
        assert bpt != 32 * 2_048  # the full-width uint8 formula


@pytest.mark.parametrize("dtype", ["nvfp4", "fp4_mx_block16"])
def test_kvb07_fp4_head_dim_not_multiple_of_16_is_an_error(dtype):
    with pytest.raises(kvpool.LayoutError, match="head_dim` = 72"):
        kvpool.size_for(dict(LLAMA3_8B, head_dim=72), dtype, **budget_of(10 * GIB))


# --------------------------------------------------------------------------- issue 2 values
def test_qwen3_8b_bytes_per_token():
    # 36 layers, 8 KV heads, head_dim 128
    got = {d: kvpool.size_for("Qwen/Qwen3-8B", d, **budget_of(GIB)).bytes_per_token
           for d in ("bf16", "fp8_e4m3", "nvfp4")}
    assert got == {"bf16": 36 * 2 * 8 * 128 * 2, "fp8_e4m3": 36 * 2 * 8 * 128,
                   "nvfp4": 36 * 2 * 8 * (64 + 8)}
    assert got == {"bf16": 147_456, "fp8_e4m3": 73_728, "nvfp4": 41_472}
    assert got["bf16"] / got["nvfp4"] == pytest.approx(2 / 0.5625)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_deepseek_v3_mla_latent_is_not_split(tp):
    # 61 layers x (512 + 64) values x 2 bytes, one latent, on every rank
    bf16 = kvpool.size_for("deepseek-ai/DeepSeek-V3", "bf16", tp_size=tp, **budget_of(GIB))
    fp8 = kvpool.size_for("deepseek-ai/DeepSeek-V3", "fp8", tp_size=tp, **budget_of(GIB))
    assert bf16.bytes_per_token == 61 * 576 * 2 == 70_272
    assert fp8.bytes_per_token == 61 * 576 == 35_136
    assert [b.name for b in bf16.buffers[:1]] == ["layers.0.kv"]


def test_tp_must_split_query_heads():
    # DeepSeek-V3's 128 query heads do not split over 3 ranks (the latent would, but attention
    # is partitioned by query heads); nor do 32 over 64
    with pytest.raises(kvpool.ModelConfigError, match=r"tp_size `3`.*`num_attention_heads` = 128"):
        kvpool.size_for("deepseek-ai/DeepSeek-V3", "bf16", tp_size=3, **budget_of(GIB))
    with pytest.raises(kvpool.ModelConfigError, match=r"tp_size `64`.*= 32"):
        kvpool.size_for(FOUR_LAYERS, "bf16", tp_size=64, **budget_of(GIB))


def test_query_heads_must_group_over_kv_heads():
    cfg = {**FOUR_LAYERS, "num_key_value_heads": 6}
    with pytest.raises(kvpool.ModelConfigError, match=r"`num_attention_heads` = 32 .* = 6"):
        kvpool.size_for(cfg, "bf16", **budget_of(GIB))


@pytest.mark.parametrize("field", ["linear_num_key_heads", "linear_num_value_heads",
                                   "linear_key_head_dim", "linear_value_head_dim",
                                   "linear_conv_kernel_dim"])
def test_linear_attention_zero_dims_refused(field):
    cfg = copy.deepcopy(kvpool.ModelSpec.from_pretrained("Qwen/Qwen3-Next-80B-A3B-Thinking").config)
    cfg[field] = 0
    with pytest.raises(kvpool.ModelConfigError, match=f"`{field}` must be positive, got 0"):
        kvpool.size_for(cfg, "bf16", **budget_of(GIB))


FOUR_LAYERS = {"num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8,
               "head_dim": 128}


@pytest.mark.parametrize(
    "recipe, bpt",
    [
        ("linear", 4 * 2 * 8 * (64 + 8)),  # 4,608
        ("page_major", 4 * 2 * 8 * (64 + 8)),  # the same bytes, other layout
        ("mixed", 4 * 2 * 8 * (64 + 8 + 8) + 2 * 8 * 128),  # both scale layouts + fp8 workspace
        ("linear_workspace", 4 * 2 * 8 * (64 + 8) + 2 * 8 * 128),
    ],
)
def test_nvfp4_recipes(recipe, bpt):
    plan = kvpool.size_for(FOUR_LAYERS, "nvfp4", page_size=16, nvfp4_recipe=recipe,
                           **budget_of(GIB))
    assert plan.bytes_per_token == bpt
    assert {"linear": 4608, "page_major": 4608, "mixed": 7168, "linear_workspace": 6656}[recipe] == bpt
    names = {b.name: b for b in plan.buffers}
    assert ("layers.0.k_block_scale" in names) == (recipe != "page_major")
    assert ("layers.0.v_block_scale_page_major" in names) == (recipe in ("page_major", "mixed"))
    assert ("workspace.k" in names) == (recipe in ("mixed", "linear_workspace"))
    if recipe in ("page_major", "mixed"):
        rows = plan.num_tokens + 16
        assert names["layers.0.k_block_scale_page_major"].shape == (rows // 16, 8, 16, 8)
    if "workspace.v" in names:
        assert names["workspace.v"].shape == (plan.num_tokens + 16, 8, 128)
        assert names["workspace.v"].dtype == "float8_e4m3fn"


@pytest.mark.parametrize("page_size, head_dim", [(6, 128), (16, 80)])
def test_page_major_shape_constraints(page_size, head_dim):
    with pytest.raises(kvpool.LayoutError, match="page_size % 4 == 0 and head_dim % 64 == 0"):
        kvpool.size_for(dict(FOUR_LAYERS, head_dim=head_dim), "nvfp4", page_size=page_size,
                        nvfp4_recipe="page_major", **budget_of(GIB))


def test_page_size_rounds_capacity_down_to_whole_pages():
    plan = kvpool.size_for(LLAMA3_8B, "bf16", page_size=64, **budget_of(10 * GIB))
    # rows must be whole pages: floor(81,920 / 64) = 1,280 pages of rows, one is the padding page
    assert plan.num_tokens == (1280 - 1) * 64
    assert plan.num_pages == 1279


def test_per_layer_overrides_and_sliding_dtype():
    plan = kvpool.size_for(GPT_OSS_LIKE, "fp8_e4m3", sliding_dtype="bf16",
                           layer_dtypes={1: "nvfp4"}, **budget_of(GIB))
    assert plan.layer_dtypes[:4] == ["bf16", "nvfp4", "bf16", "fp8_e4m3"]
    per = {"bf16": 2048, "fp8_e4m3": 1024, "nvfp4": 2 * 8 * (32 + 4)}
    # sliding layers have their own page space now: the primary space holds the full layers
    assert plan.bytes_per_token == per["nvfp4"] + 17 * per["fp8_e4m3"]
    assert plan.page_spaces["sliding_128"]["bytes_per_token"] == 18 * per["bf16"]


def test_hybrid_linear_attention_layers_get_no_pages():
    spec = kvpool.ModelSpec.from_pretrained("Qwen/Qwen3-Next-80B-A3B-Thinking")
    assert spec.layer_kinds.count("full") == 12 and spec.layer_kinds[3] == "full"
    plan = kvpool.size_for(spec, "bf16", **budget_of(GIB))
    # 12 full layers x 2 x 2 KV heads x 256 x 2 bytes
    assert plan.bytes_per_token == 12 * 2 * 2 * 256 * 2
    # 36 gated-DeltaNet layers: conv (2*16*128 + 32*128) x 3 x 2 bytes, state 32x128x128 x 4 bytes
    assert plan.linear_state_bytes() == 36 * ((2 * 2048 + 4096) * 3 * 2 + 32 * 128 * 128 * 4)


def test_nested_text_config_is_searched_first():
    spec = kvpool.ModelSpec.from_pretrained("Qwen/Qwen3.5-27B")
    # text_config: 64 layers (16 full), 4 KV heads, head_dim 256; the vision tower's hidden_size
    # (1152) must not leak in
    assert spec.num_layers == 64 and spec.num_kv_heads == 4 and spec.head_dim == 256
    assert spec.layer_kinds.count("full") == 16
    assert spec.dtype == "bf16" and spec.dtype_source == "config"


def test_gemma2_alternates_sliding_and_global():
    spec = kvpool.ModelSpec.from_pretrained("google/gemma-2-9b-it")
    assert spec.layer_kinds[:4] == ("sliding", "full", "sliding", "full")
    assert spec.sliding_window == 4096 and spec.head_dim == 256


def test_qwen3_use_sliding_window_false_means_full():
    spec = kvpool.ModelSpec.from_pretrained("Qwen/Qwen3-8B")
    assert set(spec.layer_kinds) == {"full"} and spec.sliding_window is None


def test_auto_resolves_to_model_dtype():
    assert kvpool.size_for("Qwen/Qwen3-8B", "auto", **budget_of(GIB)).dtype == "bf16"
    plan = kvpool.size_for("Qwen/Qwen3-8B", "auto", model_dtype="fp32", **budget_of(GIB))
    assert plan.dtype == "fp32" and plan.bytes_per_token == 2 * 147_456
    spec = kvpool.ModelSpec.from_dict(dict(LLAMA3_8B))
    assert spec.dtype == "bf16" and spec.dtype_source == "default"


def test_budget_follows_sglang():
    # rest = available - total * (1 - mem_frac) = 60 - 80 * 0.15 = 48 GiB
    plan = kvpool.size_for(LLAMA3_8B, "bf16", 0.85, total_memory=80 * GIB,
                           available_memory=60 * GIB)
    assert plan.budget_bytes == 48 * GIB
    assert plan.num_tokens == 48 * GIB // 131_072 - 1


def test_sglang_line():
    plan = kvpool.size_for(LLAMA3_8B, "bf16", **budget_of(10 * GIB))
    # K = V = 81,920 rows x 65,536 bytes = 5 GiB
    assert plan.sglang_line() == (
        "KV Cache is allocated. dtype: bf16, #tokens: 81919, K size: 5.00 GB, V size: 5.00 GB")


def test_sglang_line_mla():
    """MLA keeps one latent per token and layer; SGLang's MLA pool logs it as `KV size` (this
    printed `K size: 4.29 GB, V size: 0.00 GB`). 65,536 rows x 61 layers x 576 x 2 B = 4.29 GiB."""
    plan = kvpool.size_for("deepseek-ai/DeepSeek-V3", "bf16", num_tokens=65_535)
    assert 65_536 * 61 * 576 * 2 / GIB == pytest.approx(4.2891, abs=1e-4)
    assert plan.sglang_line() == (
        "KV Cache is allocated. dtype: bf16, #tokens: 65535, KV size: 4.29 GB")


def test_weights_estimate_llama_8b():
    from kvpool.weights import estimate_weight_bytes, parameter_counts

    spec = kvpool.ModelSpec.from_pretrained("meta-llama/Llama-3.1-8B")
    assert sum(parameter_counts(spec).values()) == 8_030_261_248  # the published count
    assert estimate_weight_bytes(spec) == 2 * 8_030_261_248


def test_weights_from_checkpoint_index(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B | {"vocab_size": 10,
                                                                  "intermediate_size": 10}))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 12 * GIB}, "weight_map": {}}))
    plan = kvpool.size_for(tmp_path, "bf16", 0.9, total_memory=80 * GIB)
    assert plan.budget.weights == 12 * GIB and plan.budget.weights_source == "checkpoint"
    assert plan.budget_bytes == 80 * GIB - 12 * GIB - 8 * GIB


@pytest.mark.parametrize(
    "model, billions",
    # published totals: DeepSeek-V3 671B (without the 14B MTP module), gemma-2-9b 9.24B,
    # gpt-oss-120b 116.8B, Mixtral-8x7B 46.7B, Qwen3-8B 8.2B, Llama-3.1-70B 70.6B
    [("deepseek-ai/DeepSeek-V3", 671.0), ("google/gemma-2-9b-it", 9.24),
     ("openai/gpt-oss-120b", 116.8), ("mistralai/Mixtral-8x7B-v0.1", 46.7),
     ("Qwen/Qwen3-8B", 8.19), ("meta-llama/Llama-3.1-70B", 70.55)],
)
def test_parameter_estimates_match_published_counts(model, billions):
    from kvpool.weights import parameter_counts

    n = sum(parameter_counts(kvpool.ModelSpec.from_pretrained(model)).values())
    assert n / 1e9 == pytest.approx(billions, rel=0.01)


def test_fp8_checkpoint_weights_are_one_byte():
    from kvpool.weights import estimate_weight_bytes

    bf16 = estimate_weight_bytes(kvpool.ModelSpec.from_pretrained("Qwen/Qwen3-30B-A3B"))
    fp8 = estimate_weight_bytes(kvpool.ModelSpec.from_pretrained("Qwen/Qwen3-30B-A3B-FP8"))
    assert 0.5 < fp8 / bf16 < 0.53  # embeddings and norms stay bf16


# Qwen2.5-7B (Qwen/Qwen2.5-7B-Instruct config.json): the language model of Qwen2.5-VL-7B
QWEN25_7B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
             "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
             "max_window_layers": 28, "use_sliding_window": False, "torch_dtype": "bfloat16"}


def test_weights_estimate_counts_qwen2_qkv_biases(tmp_path):
    """Qwen2-family attention has biases on q_proj, k_proj and v_proj (none on o_proj) without
    an `attention_bias` key; the estimate left them out (Qwen2.5-7B: 28 x 4,608 = 129,024)."""
    import json

    from kvpool.weights import estimate_weight_bytes, parameter_counts

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    spec = kvpool.ModelSpec.from_pretrained(tmp_path)
    # per layer: q bias 28 x 128 = 3,584, k and v biases 4 x 128 = 512 each
    assert 28 * (28 * 128 + 2 * 4 * 128) == 129_024
    counts = parameter_counts(spec)
    # by hand: untied embeddings 2 x 152,064 x 3,584; per layer q and o 3,584^2 each, k and v
    # 3,584 x 512 each, the 4,608 biases, gate/up/down 3 x 3,584 x 18,944, two RMSNorms; the
    # final norm. Published: 7,615,616,512 (the safetensors parameter count of
    # Qwen/Qwen2.5-7B-Instruct on the Hugging Face hub; the Qwen2.5 report's "7.61B")
    layer = 2 * 3584**2 + 2 * 3584 * 512 + 4608 + 3 * 3584 * 18944 + 2 * 3584
    assert 2 * 152_064 * 3584 + 28 * layer + 3584 == 7_615_616_512
    assert sum(counts.values()) == 7_615_616_512
    assert counts["bias"] == 129_024
    assert estimate_weight_bytes(spec) == 2 * 7_615_616_512
    # Qwen2.5-0.5B-Instruct (tied embeddings, 14 q / 2 KV heads of 64, 24 layers); published
    # 494,032,768 (its safetensors parameter count on the hub)
    small = dict(QWEN25_7B, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                 num_hidden_layers=24, num_key_value_heads=2, vocab_size=151_936,
                 tie_word_embeddings=True)
    layer = 2 * 896**2 + 2 * 896 * 128 + (896 + 2 * 128) + 3 * 896 * 4864 + 2 * 896
    assert 151_936 * 896 + 24 * layer + 896 == 494_032_768
    assert sum(parameter_counts(kvpool.ModelSpec.from_dict(small)).values()) == 494_032_768
    # an FP8 checkpoint keeps the biases in the model dtype (2 bytes), like norms
    fp8 = kvpool.ModelSpec.from_dict(QWEN25_7B | {"quantization_config": {"quant_method": "fp8"}})
    c = parameter_counts(fp8)
    plain = 2 * (2 * 152_064 * 3584 + 28 * 2 * 3584 + 3584 + 129_024)
    assert estimate_weight_bytes(fp8) == int(plain + c["linear"] * (1 + 4 / (128 * 128)))


def test_weights_estimate_attention_bias_flag():
    """Other families follow `attention_bias` (Llama, Qwen3, gpt-oss: q, k, v and o_proj alike);
    absent or false adds nothing, so their counts do not change."""
    import json
    from importlib import resources

    from kvpool.weights import parameter_counts

    path = resources.files("kvpool") / "models" / "meta-llama--Llama-3.1-8B.json"
    llama = json.loads(path.read_text())
    assert llama["attention_bias"] is False

    def total(**kw):
        cfg = {k: v for k, v in llama.items() if k != "attention_bias"} | kw
        return sum(parameter_counts(kvpool.ModelSpec.from_dict(cfg)).values())

    assert total() == total(attention_bias=False) == 8_030_261_248
    # 32 layers x (q 4,096 + k 1,024 + v 1,024 + o 4,096)
    assert total(attention_bias=True) == 8_030_261_248 + 32 * (4096 + 1024 + 1024 + 4096)
    # gpt-oss-20b declares it: 24 layers x (q 64 x 64 + k, v 8 x 64 each + o 2,880)
    gpt = parameter_counts(kvpool.ModelSpec.from_pretrained("openai/gpt-oss-20b"))
    assert gpt.get("bias") == 24 * (64 * 64 + 2 * 8 * 64 + 2880) == 192_000
    with pytest.raises(kvpool.ModelConfigError, match="`attention_bias` = 'yes': must be true"):
        total(attention_bias="yes")


def test_weights_estimate_counts_the_vision_tower():
    """Qwen2.5-VL-7B: the vision tower (0.68 B parameters) was missing from the estimate, so the
    pool of a vision-language model was sized 1.35 GB too large with estimated weights."""
    from kvpool.weights import estimate_weight_bytes, parameter_counts, vision_parameters

    spec = kvpool.ModelSpec.from_pretrained("Qwen/Qwen2.5-VL-7B-Instruct")
    # the tower's layers (Qwen2.5-VL modeling code), worked out by hand:
    patch = 3 * 2 * 14 * 14 * 1280  # Conv3d, no bias
    qkv, proj = 1280 * 3840 + 3840, 1280 * 1280 + 1280
    mlp = 2 * (1280 * 3420 + 3420) + 3420 * 1280 + 1280  # gate, up, down (silu: gated)
    block = 2 * 1280 + qkv + proj + mlp  # two RMSNorms (weight only)
    merger = 1280 + 5120 * 5120 + 5120 + 5120 * 3584 + 3584
    exact = patch + 32 * block + merger
    assert exact == 676_550_144
    # the estimate counts a bias for every norm (an upper bound): 32 x 2 x 1280 + 1280 more
    assert vision_parameters(spec.fields.get("vision_config")) == exact + 32 * 2 * 1280 + 1280
    counts = parameter_counts(spec)
    # published total 8,292,166,656 (transformers' parameter count of the checkpoint: the
    # 676,550,144 above plus Qwen2.5-7B's 7,615,616,512, q/k/v biases included); the estimate
    # is above it by the vision norms' biases only
    assert sum(counts.values()) == 8_292_166_656 + 32 * 2 * 1280 + 1280
    text = {k: v for k, v in counts.items() if k != "vision"}
    assert estimate_weight_bytes(spec) == 2 * (sum(text.values()) + counts["vision"])
    # a text-only model has none; a malformed vision_config is named
    assert parameter_counts(kvpool.ModelSpec.from_pretrained("Qwen/Qwen3-8B"))["vision"] == 0
    with pytest.raises(kvpool.ModelConfigError, match="vision_config.depth"):
        vision_parameters({"depth": -1, "hidden_size": 8, "patch_size": 2})
    with pytest.raises(kvpool.ModelConfigError, match="`vision_config` must be a dict"):
        vision_parameters([1])
