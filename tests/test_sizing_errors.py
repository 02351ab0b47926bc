"""Bad input to sizing: each gives a clear exception (type and message naming the value)."""

import json
import math

import pytest

import kvpool

GIB = 1 << 30
LLAMA = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128, "hidden_size": 4096}
OK = dict(mem_frac=0.5, total_memory=2 * GIB, weights=0)


@pytest.mark.parametrize("dtype", ["fp6", "int8", "", "FP8", "auto8"])
def test_unknown_dtype(dtype):
    with pytest.raises(kvpool.KvDtypeError, match=f"unknown KV cache dtype `{dtype}`.*nvfp4"):
        kvpool.size_for(LLAMA, dtype, **OK)
    assert issubclass(kvpool.KvDtypeError, ValueError)


def test_unknown_model_points_to_the_list():
    # names the way to list the bundled configs, not all 18 of them on one line
    with pytest.raises(kvpool.ModelConfigError, match="unknown model `nope/nothing`.*`kvpool models`") as e:
        kvpool.size_for("nope/nothing", "bf16", **OK)
    assert "Qwen/Qwen3-8B" not in str(e.value)


def test_unknown_gpu():
    with pytest.raises(kvpool.SizingError, match="unknown GPU `V100`.*H200"):
        kvpool.size_for(LLAMA, "bf16", gpu="V100", weights=0)


@pytest.mark.parametrize("frac", [0, -0.1, 1.01, 2, math.nan, math.inf])
def test_mem_frac_outside_unit_interval(frac):
    with pytest.raises(kvpool.SizingError, match="mem_frac"):
        kvpool.size_for(LLAMA, "bf16", frac, total_memory=2 * GIB, weights=0)


def test_budget_too_small_says_what_is_missing():
    # one usable page + padding page at page_size 16: 32 rows x 131,072 bytes = 4 MiB
    needed = 32 * 131_072
    with pytest.raises(kvpool.BudgetTooSmallError) as e:
        kvpool.size_for(LLAMA, "bf16", 0.5, total_memory=2 * (needed - 100), weights=0,
                        page_size=16)
    msg = str(e.value)
    assert f"needs {needed} bytes, 100 more" in msg and "page_size" in msg and "mem_frac" in msg
    assert isinstance(e.value, ValueError)


def test_exactly_one_page_fits():
    needed = 32 * 131_072
    plan = kvpool.size_for(LLAMA, "bf16", 0.5, total_memory=2 * needed, weights=0, page_size=16)
    assert plan.num_tokens == 16 and plan.total_bytes == needed


def test_weights_larger_than_device():
    with pytest.raises(kvpool.SizingError, match="do not fit"):
        kvpool.size_for("meta-llama/Llama-3.1-70B", "bf16", gpu="L4")


def test_no_memory_figures_without_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(kvpool.SizingError, match="no memory figures given"):
        kvpool.size_for(LLAMA, "bf16")


def test_available_above_total():
    with pytest.raises(kvpool.SizingError, match="exceeds total memory"):
        kvpool.size_for(LLAMA, "bf16", total_memory=GIB, available_memory=2 * GIB)


@pytest.mark.parametrize("page_size", [0])
def test_page_size_zero(page_size):
    with pytest.raises(kvpool.LayoutError, match="page_size"):
        kvpool.size_for(LLAMA, "bf16", page_size=page_size, **OK)


@pytest.mark.parametrize("bad", [-1, 1.5, "16", True])
def test_page_size_not_an_int(bad):
    with pytest.raises(kvpool.LayoutError, match="`page_size`"):
        kvpool.size_for(LLAMA, "bf16", page_size=bad, **OK)


def test_tp_zero():
    with pytest.raises(kvpool.ModelConfigError, match="tp_size"):
        kvpool.size_for(LLAMA, "bf16", tp_size=0, **OK)


def test_unknown_recipe():
    with pytest.raises(kvpool.LayoutError, match="unknown nvfp4 recipe `fast`"):
        kvpool.size_for(LLAMA, "nvfp4", nvfp4_recipe="fast", **OK)


def test_override_out_of_range_and_on_linear():
    with pytest.raises(kvpool.LayoutError, match="layer `40`.*32 layers"):
        kvpool.size_for(LLAMA, "bf16", layer_dtypes={40: "fp8"}, **OK)
    with pytest.raises(kvpool.LayoutError, match="linear-attention"):
        kvpool.size_for("Qwen/Qwen3-Next-80B-A3B-Thinking", "bf16", layer_dtypes={0: "fp8"}, **OK)


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"num_attention_heads": None}, "num_attention_heads"),
        ({"head_dim": None, "hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": -3}, "num_hidden_layers"),
        ({"num_key_value_heads": "8"}, "num_key_value_heads"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"layer_types": ["weird"] * 32}, "weird"),
        ({"sliding_window": "big", "layer_types": ["sliding_attention"] * 32}, "sliding_window"),
        ({"layer_types": ["sliding_attention"] * 32}, "sliding_window"),
        ({"kv_lora_rank": 512}, "qk_rope_head_dim"),
        ({"index_head_dim": 128}, "index_head_dim"),
        ({"torch_dtype": "int4"}, "torch_dtype"),
    ],
)
def test_malformed_config_names_the_field(patch, field):
    cfg = {k: v for k, v in {**LLAMA, **patch}.items() if v is not None}
    with pytest.raises(kvpool.ModelConfigError, match=field):
        kvpool.size_for(cfg, "bf16", **OK)


def test_truncated_json_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(LLAMA)[:-20])
    with pytest.raises(kvpool.ModelConfigError, match="malformed JSON"):
        kvpool.size_for(p, "bf16", **OK)
    p.write_text("[1, 2]")
    with pytest.raises(kvpool.ModelConfigError, match="not an object"):
        kvpool.size_for(p, "bf16", **OK)


def test_directory_without_config(tmp_path):
    with pytest.raises(kvpool.ModelConfigError, match="no config.json"):
        kvpool.size_for(tmp_path, "bf16", **OK)


def test_auto_with_a_non_float_model_dtype():
    with pytest.raises(kvpool.ModelConfigError, match="int8"):
        kvpool.size_for(LLAMA, "auto", model_dtype="int8", **OK)


def test_request_bytes_negative():
    plan = kvpool.size_for(LLAMA, "bf16", **OK)
    with pytest.raises(ValueError, match="-1"):
        plan.request_bytes(-1)
    with pytest.raises(ValueError, match="context_len"):
        plan.requests_fit(0)


def test_huge_numbers_do_not_panic():
    # a panic would surface as pyo3's PanicException (a BaseException), never a clean error
    cfg = dict(LLAMA, num_hidden_layers=10_000, num_key_value_heads=1 << 20,
               num_attention_heads=1 << 20, head_dim=1 << 16)
    with pytest.raises(kvpool.BudgetTooSmallError):
        kvpool.size_for(cfg, "fp32", **OK)
    cfg = dict(LLAMA, num_key_value_heads=1 << 40, num_attention_heads=1 << 40)
    with pytest.raises(kvpool.ModelConfigError, match="exceeds"):
        kvpool.size_for(cfg, "fp32", **OK)
    with pytest.raises(kvpool.ModelConfigError, match="head_dim"):
        kvpool.size_for(dict(LLAMA, head_dim=1 << 70), "fp32", **OK)
    with pytest.raises(kvpool.ModelConfigError, match="num_hidden_layers"):
        kvpool.size_for(dict(LLAMA, num_hidden_layers=10**9), "fp32", **OK)


def test_arithmetic_overflow_is_an_error_not_a_wrong_number():
    with pytest.raises(kvpool.LayoutError, match="page_size"):
        kvpool.size_for(LLAMA, "bf16", page_size=2**63, **OK)
    plan = kvpool.size_for(LLAMA, "bf16", **OK)
    with pytest.raises(kvpool.SizingError, match="exceeds"):
        plan.request_bytes(2**50)
    with pytest.raises(kvpool.SizingError, match="num_tokens"):
        kvpool.size_for(LLAMA, "bf16", num_tokens=2**64 - 1)
    with pytest.raises(kvpool.SizingError, match="num_tokens"):
        kvpool.size_for(LLAMA, "bf16", num_tokens=-1)


@pytest.mark.parametrize(
    "kw",
    [dict(mem_frac=True), dict(total_memory=True), dict(total_memory=8.0),
     dict(total_memory="8"), dict(page_size=True), dict(num_tokens=True),
     dict(layer_dtypes={1.7: "fp8"}), dict(layer_dtypes={-1: "fp8"}), dict(tp_size=2**64)],
)
def test_wrong_types_are_refused_naming_the_argument(kw):
    args = {**OK, **kw}
    name = next(iter(kw)).replace("layer_dtypes", "layer_dtypes key")
    with pytest.raises(ValueError, match=f"`{name}`"):
        kvpool.size_for(LLAMA, "bf16", **args)


def test_explicit_weights_are_split_over_tp_ranks():
    # 140 GiB of weights over 8 ranks: 17.5 GiB per rank on an 80 GiB device
    plan = kvpool.size_for(LLAMA, "bf16", 0.9, total_memory=80 * GIB, weights=140 * GIB, tp_size=8)
    assert plan.budget.weights == 140 * GIB // 8
    assert plan.budget_bytes == 80 * GIB - 140 * GIB // 8 - 8 * GIB


def test_available_memory_and_weights_together_are_refused():
    with pytest.raises(kvpool.SizingError, match="not both"):
        kvpool.size_for(LLAMA, "bf16", total_memory=8 * GIB, available_memory=6 * GIB, weights=GIB)


def test_compare_accepts_one_dtype_name():
    plans = kvpool.compare(LLAMA, "bf16", **OK)
    assert [p.dtype for p in plans] == ["bf16"]


def test_empty_model_name():
    with pytest.raises(kvpool.ModelConfigError, match="empty"):
        kvpool.size_for("", "bf16", **OK)


def test_plan_is_read_only():
    plan = kvpool.size_for(LLAMA, "bf16", **OK)
    with pytest.raises(AttributeError):
        plan.num_tokens = 5


@pytest.mark.parametrize(
    "patch, field",
    [({"num_key_value_heads": 64}, "num_key_value_heads"),
     ({"layer_types": ["nonlinear"] * 32}, "nonlinear"),
     ({"sliding_window": 16, "sliding_window_pattern": 0}, "sliding_window_pattern"),
     ({"sliding_window": -5, "layer_types": ["sliding_attention"] * 32}, "sliding_window"),
     ({"index_n_heads": 64}, "index_n_heads")],
)
def test_more_malformed_configs(patch, field):
    with pytest.raises(kvpool.ModelConfigError, match=field):
        kvpool.size_for({**LLAMA, **patch}, "bf16", **OK)


def test_mla_config_needs_no_hidden_size():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 16, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
    assert kvpool.size_for(cfg, "bf16", **OK).bytes_per_token == 2 * 576 * 2


def _next_config():
    import json
    from importlib import resources

    f = resources.files("kvpool").joinpath("models", "Qwen--Qwen3-Next-80B-A3B-Thinking.json")
    return json.loads(f.read_text())


@pytest.mark.parametrize("patch, text", [
    # was: OverflowError "can't convert negative int to unsigned" (conv state of -1 inputs)
    ({"linear_conv_kernel_dim": 0}, "`linear_conv_kernel_dim` must be positive, got 0"),
    # was: silently sized as fp32 state
    ({"mamba_ssm_dtype": "int4"}, "unknown `mamba_ssm_dtype` 'int4'"),
])
def test_malformed_linear_attention_fields(patch, text):
    with pytest.raises(kvpool.ModelConfigError, match=text):
        kvpool.size_for({**_next_config(), **patch}, "bf16", tp_size=8, **OK)


def test_linear_state_by_hand():
    """Qwen3-Next at tp 8: conv (2*2*128 + 4*128) * (4-1) * 2 B = 6,144; ssm 4*128*128*4 B =
    262,144; 36 linear layers -> 9,658,368 B per request; 12 full layers x 1 KV head x 256 x 2
    (K, V) x 2 B = 12,288 B per token in bf16."""
    plan = kvpool.size_for(_next_config(), "bf16", tp_size=8, **OK)
    assert plan.linear_state_bytes() == 36 * (6_144 + 262_144) == 9_658_368
    assert plan.bytes_per_token == 12_288
    cfg = {**_next_config(), "mamba_ssm_dtype": "bfloat16"}
    assert kvpool.size_for(cfg, "bf16", tp_size=8, **OK).linear_state_bytes() == 36 * (
        6_144 + 131_072)


def test_empty_model_name_from_pretrained():
    with pytest.raises(kvpool.ModelConfigError, match="empty string"):
        kvpool.ModelSpec.from_pretrained("  ")


@pytest.mark.parametrize("size", ["true", "-5", "0", "Infinity", "NaN", "1.5", "1e30", '"16"'])
def test_checkpoint_index_total_size_must_be_bytes(size, tmp_path):
    """Found by the user review of 2026-11-29: `true` sized the pool with 1 byte of weights,
    -5 gave 'available exceeds total', Infinity a bare OverflowError naming no file."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"metadata": {"total_size": %s}}' % size)
    with pytest.raises(kvpool.ModelConfigError, match="metadata.total_size"):
        kvpool.size_for(tmp_path, "bf16", mem_frac=0.5, total_memory=2 * GIB)


def test_checkpoint_index_total_size_is_used(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    index = tmp_path / "model.safetensors.index.json"
    for size in ("1073741824", "1073741824.0"):
        index.write_text('{"metadata": {"total_size": %s}}' % size)
        plan = kvpool.size_for(tmp_path, "bf16", mem_frac=0.5, total_memory=4 * GIB)
        # available 4 - 1 GiB of weights; budget = 3 GiB - 4 GiB * (1 - 0.5) = 1 GiB
        assert plan.budget.weights == GIB and plan.budget.weights_source == "checkpoint"
        assert plan.budget.budget == GIB


def test_numpy_scalars_are_numbers_like_any_other():
    import numpy as np

    ref = kvpool.size_for(LLAMA, "bf16", **OK, page_size=4, tp_size=2)
    got = kvpool.size_for(LLAMA, "bf16", np.float32(0.5), total_memory=np.int64(2 * GIB),
                          weights=0, page_size=np.int64(4), tp_size=np.int32(2))
    assert (got.num_tokens, got.bytes_per_token) == (ref.num_tokens, ref.bytes_per_token)
    assert kvpool.size_for(LLAMA, "bf16", num_tokens=np.int64(64)).num_tokens == 64
    with pytest.raises(kvpool.LayoutError, match=r"`page_size` must be an integer, got np.True_"):
        kvpool.size_for(LLAMA, "bf16", **OK, page_size=np.bool_(True))


@pytest.mark.parametrize("frac", ["0.5", None, True, 1j])
def test_mem_frac_that_is_not_a_real_number(frac):
    with pytest.raises(kvpool.SizingError, match=r"`mem_frac` must be a real number in \(0, 1\]"):
        kvpool.size_for(LLAMA, "bf16", frac, total_memory=2 * GIB, weights=0)


@pytest.mark.parametrize(
    "kw, exc, name",
    [
        ({"dtype": None}, kvpool.KvDtypeError, "dtype"),
        ({"dtype": 8}, kvpool.KvDtypeError, "dtype"),
        ({"nvfp4_recipe": None}, kvpool.LayoutError, "nvfp4_recipe"),
        ({"sliding_dtype": 1}, kvpool.KvDtypeError, "sliding_dtype"),
        ({"layer_dtypes": {0: None}}, kvpool.KvDtypeError, r"layer_dtypes\[0\]"),
        ({"model_dtype": 16}, kvpool.ModelConfigError, "model_dtype"),
    ],
)
def test_names_that_are_not_strings(kw, exc, name):
    with pytest.raises(exc, match=rf"`{name}` must be a string, got"):
        kvpool.size_for(LLAMA, **{"dtype": "bf16", **kw}, **OK)


@pytest.mark.parametrize("model", [None, 3, ["x"]])
def test_model_of_the_wrong_type(model):
    with pytest.raises(kvpool.ModelConfigError, match=r"`model` must be a ModelSpec, .* got"):
        kvpool.size_for(model, "bf16", **OK)


def test_config_nested_too_deeply(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(kvpool.ModelConfigError, match="nests its JSON too deeply"):
        kvpool.size_for(p, "bf16", **OK)
