"""Layer groups and page spaces (issue 16): bytes per group worked by hand for one model of each
family, one budget split between spaces, byte-exact meta pools, honest requests_fit.

Bytes per token of an attention layer = 2 (K and V) x KV heads per rank x head_dim x bytes per
value; an MLA layer stores one latent of kv_lora_rank + qk_rope_head_dim values.
"""

import kvpool
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool.config import ModelSpec, bundled_models
from test_sizing_property import check_requests_fit

torch = pytest.importorskip("torch")

H200 = dict(gpu="H200")
GIB = 1 << 30


def groups(plan):
    return {g.name: g for g in plan.groups}


# ----------------------------------------------------------------- hand-worked, per family
def test_qwen35_35b_a3b_tp8_fp8_state_is_inside_the_budget():
    plan = kvpool.size_for("Qwen/Qwen3.5-35B-A3B", "fp8_e4m3", 0.9, tp_size=8, **H200)
    g = groups(plan)
    assert list(g) == ["full", "linear_state"]
    # 10 full layers: 2 KV heads over 8 ranks -> 1 per rank; 2 x 1 x 256 x 1 B = 512 per layer
    assert g["full"].bytes_per_row == 10 * 512 == 5_120
    # 30 gated-DeltaNet layers per rank: conv (2*16*128 + 32*128)/8 = 1,024 channels x 3 x 2 B
    # = 6,144; SSM 32/8 = 4 heads x 128 x 128 x 4 B = 262,144; 30 x 268,288 = 8,048,640
    assert g["linear_state"].bytes_per_row == 30 * (1_024 * 3 * 2 + 4 * 128 * 128 * 4)
    assert g["linear_state"].bytes_per_row == plan.linear_state_bytes() == 8_048_640
    assert plan.request_bytes(8192) == 8192 * 5_120 + 8_048_640 == 49_991_680
    # every slot is a real allocation: slots x state bytes is inside total_bytes
    n = plan.requests_fit(8192)
    assert n == plan.num_state_slots == plan.page_spaces["linear_state"]["num_pages"]
    assert n * plan.request_bytes(8192) <= plan.budget_bytes
    assert plan.state_bytes == (n + 1) * 8_048_640
    # (main said 3,026, needing 24.4 GB of state on top of the budget)
    assert n == 2_538
    pool = kvpool.KVPool(plan, device="meta")
    conv, ssm = pool.state(0)
    assert tuple(conv.shape) == (n + 1, 1_024, 3) and conv.dtype == torch.bfloat16
    assert tuple(ssm.shape) == (n + 1, 4, 128, 128) and ssm.dtype == torch.float32
    with pytest.raises(KeyError, match="state"):
        pool.state(3)  # a full-attention layer


def test_qwen3_next_80b_groups():
    plan = kvpool.size_for("Qwen/Qwen3-Next-80B-A3B-Thinking", "bf16", 0.9, tp_size=4, **H200)
    g = groups(plan)
    # 12 full layers, 2 KV heads over 4 ranks -> 1: 2 x 1 x 256 x 2 B = 1,024 per layer
    assert g["full"].layers == tuple(range(3, 48, 4)) and g["full"].bytes_per_row == 12_288
    # 36 linear layers per rank: conv (2*2048 + 4096)/4 = 2,048 x 3 x 2 B = 12,288;
    # SSM 32/4 = 8 x 128 x 128 x 4 B = 524,288; 36 x 536,576 = 19,316,736
    assert g["linear_state"].bytes_per_row == 36 * (12_288 + 524_288) == 19_316_736
    assert plan.requests_fit(8192) == plan.num_state_slots
    assert plan.page_spaces["primary"]["requests"] >= plan.num_state_slots


def test_gpt_oss_20b_sliding_pages_are_a_space_of_their_own():
    plan = kvpool.size_for("openai/gpt-oss-20b", "bf16", 0.9, **H200)
    g = groups(plan)
    # 12 full + 12 sliding layers, 8 KV heads x 64 x 2 B x 2 = 2,048 per layer each
    assert g["full"].bytes_per_row == g["sliding_128"].bytes_per_row == 12 * 2_048 == 24_576
    assert g["sliding_128"].page_space == "sliding_128"
    assert plan.request_bytes(8192) == (8192 + 128) * 24_576 == 204_472_320
    sp = plan.page_spaces["sliding_128"]
    # headroom: one 8,192-token chunk, at most 8,192 - 128 pages beyond the window
    assert sp["headroom_pages"] == 8_064
    n = plan.requests_fit(8192)
    assert sp["num_pages"] == n * 128 + 8_064
    # main: 302 (= num_tokens // 8192 with sliding layers stored like full ones); now within
    # one request of budget / request_bytes
    assert n == 595 and plan.budget_bytes // plan.request_bytes(8192) == 596
    pool = kvpool.KVPool(plan, device="meta")
    assert pool.layer(0).k.shape[0] == sp["rows"] == sp["num_pages"] + 1
    assert pool.layer(1).k.shape[0] == plan.num_tokens + 1


def test_gemma2_9b_paged_window():
    plan = kvpool.size_for("google/gemma-2-9b-it", "bf16", 0.9, page_size=16, **H200)
    g = groups(plan)
    # 21 + 21 layers, 8 KV heads x 256 x 2 B x 2 = 8,192 per layer
    assert g["full"].bytes_per_row == g["sliding_4096"].bytes_per_row == 21 * 8_192 == 172_032
    # a request of 8,192 tokens: 512 pages full; window 4,096 -> 256 pages + 1 boundary page;
    # headroom min(512 chunk pages, 512 - 257) = 255
    sp = plan.page_spaces["sliding_4096"]
    assert sp["headroom_pages"] == 255
    n = plan.requests_fit(8192)
    assert sp["num_pages"] == 257 * n + 255
    assert plan.request_bytes(8192) == (512 + 257) * 16 * 172_032
    # 32k requests hold 2,048 full pages and still 257 sliding ones: the sliding space binds
    assert plan.requests_fit(32768) == min(plan.num_pages // 2048, (sp["num_pages"] - 255) // 257)


def test_deepseek_v3_mtp_draft_shares_primary_pages():
    plan = kvpool.size_for("deepseek-ai/DeepSeek-V3", "bf16", 0.9, tp_size=8, draft="mtp",
                           **H200)
    g = groups(plan)
    # 61 MLA layers of (512 + 64) x 2 B = 1,152; the MTP layer is one more MLA layer
    assert g["mla"].bytes_per_row == 61 * 1_152 == 70_272
    assert g["draft"].layers == (0,) and g["draft"].bytes_per_row == 1_152
    assert g["draft"].page_space == "primary" and list(plan.page_spaces) == ["primary"]
    assert plan.bytes_per_token == 71_424
    no_draft = kvpool.size_for("deepseek-ai/DeepSeek-V3", "bf16", 0.9, tp_size=8, **H200)
    assert plan.budget_bytes == no_draft.budget_bytes
    assert plan.num_tokens == (plan.budget_bytes // 71_424) - 1
    pool = kvpool.KVPool(plan, device="meta")
    d = pool.draft_layer(0)
    assert tuple(d.k.shape) == (plan.num_tokens + 1, 1, 576) and d.v is None
    assert "draft.layers.0.kv" in pool.buffers and pool.nbytes == plan.total_bytes
    assert plan.to_dict()["draft"] == "deepseek-ai/DeepSeek-V3 (MTP)"
    with pytest.raises(KeyError, match="draft layer"):
        pool.draft_layer(1)
    with pytest.raises(kvpool.ModelConfigError, match="num_nextn_predict_layers"):
        kvpool.size_for("Qwen/Qwen3-8B", "bf16", 0.9, draft="mtp", **H200)


def test_eagle_draft_model_has_its_own_geometry():
    eagle = {"num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128}
    plan = kvpool.size_for("meta-llama/Llama-3.1-8B-Instruct", "fp8_e4m3", 0.9, draft=eagle,
                           **H200)
    # target 32 layers x 2 x 8 x 128 x 1 B = 65,536; draft 1 x 2,048 (the target's KV dtype)
    assert groups(plan)["draft"].bytes_per_row == 2_048
    assert plan.bytes_per_token == 65_536 + 2_048
    pool = kvpool.KVPool(plan, device="meta")
    assert pool.draft_layer(0).dtype == "fp8_e4m3" and pool.draft_layer(0).k_scale is not None


GEMMA3N_LIKE = {"model_type": "gemma3n_text", "num_hidden_layers": 10, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 256, "sliding_window": 512,
                "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
                "num_kv_shared_layers": 4}


def test_gemma3n_shared_layers_own_no_bytes():
    plan = kvpool.size_for(GEMMA3N_LIKE, "bf16", 0.5, total_memory=4 * GIB, weights=0)
    g = groups(plan)
    # layers 6..9 read the KV of the last earlier layer of their type: 5 (sliding), 4 (full)
    assert plan.shared_sources[6:] == [5, 5, 5, 4]
    assert g["shared"].layers == (6, 7, 8, 9) and g["shared"].bytes == 0
    assert g["shared"].page_space is None
    # 2 x 2 KV heads x 256 x 2 B = 2,048 per owning layer: 1 full, 5 sliding
    assert g["full"].bytes_per_row == 2_048 and g["sliding_512"].bytes_per_row == 5 * 2_048
    assert plan.request_bytes(8192) == 8192 * 2_048 + 512 * 10_240
    pool = kvpool.KVPool(plan, device="meta")
    assert pool.layer(9) is pool.layer(4) and pool.layer(6) is pool.layer(5)
    assert pool.layers == [0, 1, 2, 3, 4, 5]
    assert pool.nbytes == plan.total_bytes == sum(x.bytes for x in plan.groups)
    with pytest.raises(kvpool.LayoutError, match="shared"):
        kvpool.size_for(GEMMA3N_LIKE, "bf16", num_tokens=64, layer_dtypes={7: "fp8"})


# ----------------------------------------------------------------- back-compat
#: num_tokens of main (before layer groups) on an H200 at --mem-fraction-static 0.9, weights
#: from the configs: models with full attention only must not change.
MAIN_NUM_TOKENS = {
    "Qwen/Qwen2.5-VL-7B-Instruct|bf16|1": 2_076_848,
    "Qwen/Qwen2.5-VL-7B-Instruct|bf16|64": 2_076_736,
    "Qwen/Qwen2.5-VL-7B-Instruct|fp8_e4m3|1": 4_153_697,
    "Qwen/Qwen2.5-VL-7B-Instruct|fp8_e4m3|64": 4_153_600,
    "Qwen/Qwen2.5-VL-7B-Instruct|nvfp4|1": 7_384_351,
    "Qwen/Qwen2.5-VL-7B-Instruct|nvfp4|64": 7_384_256,
    "Qwen/Qwen3-30B-A3B|bf16|1": 759_023,
    "Qwen/Qwen3-30B-A3B|bf16|64": 758_912,
    "Qwen/Qwen3-30B-A3B|fp8_e4m3|1": 1_518_047,
    "Qwen/Qwen3-30B-A3B|fp8_e4m3|64": 1_517_952,
    "Qwen/Qwen3-30B-A3B|nvfp4|1": 2_698_751,
    "Qwen/Qwen3-30B-A3B|nvfp4|64": 2_698_688,
    "Qwen/Qwen3-30B-A3B-FP8|bf16|1": 1_063_076,
    "Qwen/Qwen3-30B-A3B-FP8|bf16|64": 1_062_976,
    "Qwen/Qwen3-30B-A3B-FP8|fp8_e4m3|1": 2_126_154,
    "Qwen/Qwen3-30B-A3B-FP8|fp8_e4m3|64": 2_126_080,
    "Qwen/Qwen3-30B-A3B-FP8|nvfp4|1": 3_779_831,
    "Qwen/Qwen3-30B-A3B-FP8|nvfp4|64": 3_779_712,
    "Qwen/Qwen3-8B|bf16|1": 809_039,
    "Qwen/Qwen3-8B|bf16|64": 808_960,
    "Qwen/Qwen3-8B|fp8_e4m3|1": 1_618_080,
    "Qwen/Qwen3-8B|fp8_e4m3|64": 1_617_984,
    "Qwen/Qwen3-8B|nvfp4|1": 2_876_587,
    "Qwen/Qwen3-8B|nvfp4|64": 2_876_480,
    "meta-llama/Llama-3.1-8B|bf16|1": 912_618,
    "meta-llama/Llama-3.1-8B|bf16|64": 912_512,
    "meta-llama/Llama-3.1-8B|fp8_e4m3|1": 1_825_237,
    "meta-llama/Llama-3.1-8B|fp8_e4m3|64": 1_825_152,
    "meta-llama/Llama-3.1-8B|nvfp4|1": 3_244_867,
    "meta-llama/Llama-3.1-8B|nvfp4|64": 3_244_800,
    "meta-llama/Llama-3.1-8B-Instruct|bf16|1": 912_618,
    "meta-llama/Llama-3.1-8B-Instruct|bf16|64": 912_512,
    "meta-llama/Llama-3.1-8B-Instruct|fp8_e4m3|1": 1_825_237,
    "meta-llama/Llama-3.1-8B-Instruct|fp8_e4m3|64": 1_825_152,
    "meta-llama/Llama-3.1-8B-Instruct|nvfp4|1": 3_244_867,
    "meta-llama/Llama-3.1-8B-Instruct|nvfp4|64": 3_244_800,
    "mistralai/Mixtral-8x7B-v0.1|bf16|1": 322_522,
    "mistralai/Mixtral-8x7B-v0.1|bf16|64": 322_432,
    "mistralai/Mixtral-8x7B-v0.1|fp8_e4m3|1": 645_045,
    "mistralai/Mixtral-8x7B-v0.1|fp8_e4m3|64": 644_928,
    "mistralai/Mixtral-8x7B-v0.1|nvfp4|1": 1_146_747,
    "mistralai/Mixtral-8x7B-v0.1|nvfp4|64": 1_146_624,
}


def test_full_attention_models_keep_their_numbers():
    for key, tokens in MAIN_NUM_TOKENS.items():
        model, dtype, ps = key.split("|")
        plan = kvpool.size_for(model, dtype, 0.9, page_size=int(ps), **H200)
        assert plan.num_tokens == tokens, key
        assert [g.name for g in plan.groups] in (["full"], ["mla"])
        assert plan.requests_fit(8192) == plan.num_pages // (8192 // int(ps))


# ----------------------------------------------------------------- one layout
def _valid_plans():
    for model in bundled_models():
        for tp in (1, 2, 8):
            for ps in (1, 16, 64):
                for dtype in ("auto", *kvpool.KV_DTYPES):
                    try:
                        yield model, tp, ps, dtype, kvpool.size_for(
                            model, dtype, 0.9, weights=0, page_size=ps, tp_size=tp, **H200
                        )
                    except (kvpool.LayoutError, kvpool.ModelConfigError):
                        continue  # (FP4 head dims, tp that does not split the heads)


def test_meta_pool_is_the_plan_for_every_bundled_model_dtype_page_size_and_tp():
    seen = 0
    for model, tp, ps, dtype, plan in _valid_plans():
        key = (model, tp, ps, dtype)
        pool = kvpool.KVPool(plan, device="meta")
        assert pool.nbytes == plan.total_bytes == sum(b.nbytes for b in plan.buffers), key
        assert sum(g.bytes for g in plan.groups) == plan.total_bytes, key
        assert sum(s["bytes"] for s in plan.page_spaces.values()) + plan.fixed_bytes == (
            plan.total_bytes
        ), key
        assert plan.total_bytes <= plan.budget_bytes, key
        for name, s in plan.page_spaces.items():
            assert (s["num_pages"] + 1) * s["page_size"] - 1 <= 2**31 - 1, (key, name)
        for n in (8192, 32768):
            assert plan.requests_fit(n) * plan.request_bytes(n) <= plan.budget_bytes, (key, n)
        seen += 1
    assert seen > 500


@pytest.mark.parametrize("model", bundled_models())
@settings(max_examples=8, deadline=None)
@given(budget=st.integers(1 << 29, 1 << 34), ps=st.sampled_from([16, 64]),
       n=st.sampled_from([1, 100, 4096, 8192, 32768]),
       context_len=st.sampled_from([2048, 8192, 32768]))
def test_requests_fit_hold_in_every_bundled_model(model, budget, ps, n, context_len):
    spec = ModelSpec.from_pretrained(model)
    kv = spec.num_kv_heads
    tp = 8 if spec.num_attention_heads % 8 == 0 and (kv % 8 == 0 or 8 % kv == 0) else 1
    try:
        plan = kvpool.size_for(spec, "fp8_e4m3", 0.5, total_memory=2 * budget, weights=0,
                               page_size=ps, tp_size=tp, context_len=context_len)
    except kvpool.BudgetTooSmallError:
        return
    check_requests_fit(plan, n)


# ----------------------------------------------------------------- int32, errors
def test_int32_cap_is_stated():
    tiny = {"num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 1,
            "head_dim": 16}
    # 1 layer x 1 KV head x 16 values in fp4 + 2 block-scale bytes = 2 x (8 + 1) = 18 B/token:
    # 64 GiB would be 3.8e9 tokens, beyond int32 slot ids
    plan = kvpool.size_for(tiny, "fp4_mx_block16", 0.5, total_memory=128 * GIB, weights=0,
                           page_size=16)
    assert (plan.num_pages + 1) * 16 - 1 == 2**31 - 1
    d = plan.to_dict()
    assert d["capped_by_int32"] and d["page_spaces"]["primary"]["capped_by_int32"]
    assert plan.total_bytes < plan.budget_bytes


@pytest.mark.parametrize(("kw", "field"), [
    (dict(layer_kinds=["full", "shared"]), "kv_shared_sources"),
    (dict(layer_kinds=["full", "shared"], kv_shared_sources={1: 1}), "num_kv_shared_layers"),
    (dict(layer_kinds=["full", "shared"], kv_shared_sources={1: 5}), "num_kv_shared_layers"),
    (dict(layer_kinds=["full", "full"], kv_shared_sources={1: 0}), "kv_shared_sources"),
    (dict(layer_kinds=["full", "linear"]), "linear_state"),
    (dict(layer_kinds=["full", "sliding"]), "sliding_window"),
    (dict(layer_kinds=["full", "sliding"], layer_windows=[None]), "sliding_window"),
    (dict(layer_kinds=["full", "bogus"]), "bogus"),
])
def test_inconsistent_geometry_names_the_field(kw, field):
    base = dict(num_attention_heads=8, num_kv_heads=2, head_dim=64, v_head_dim=64)
    with pytest.raises(kvpool.ModelConfigError, match=field):
        kvpool._core.ModelGeometry(**base, **kw)


@pytest.mark.parametrize(("cfg", "field"), [
    (dict(GEMMA3N_LIKE, num_kv_shared_layers=10), "num_kv_shared_layers"),
    (dict(GEMMA3N_LIKE, layer_types=["sliding_attention"] * 9), "layer_types"),
    (dict(GEMMA3N_LIKE, sliding_window=None), "sliding_window"),
])
def test_inconsistent_configs_name_the_field(cfg, field):
    with pytest.raises(kvpool.ModelConfigError, match=field):
        kvpool.size_for(cfg, "bf16", num_tokens=64)


def test_budget_too_small_for_one_request_names_context_len():
    with pytest.raises(kvpool.BudgetTooSmallError, match="context_len"):
        kvpool.size_for("openai/gpt-oss-20b", "bf16", 0.5, total_memory=200 << 20, weights=0)
    # a shorter target context fits
    plan = kvpool.size_for("openai/gpt-oss-20b", "bf16", 0.5, total_memory=200 << 20,
                           weights=0, context_len=512, chunked_prefill_size=512)
    assert plan.requests_fit(512) >= 1


def test_state_slot_shortage_raises_out_of_pages_and_changes_nothing():
    plan = kvpool.size_for("Qwen/Qwen3-Next-80B-A3B-Thinking", "bf16", num_tokens=8192)
    slots = plan.allocators()["linear_state"]
    assert isinstance(slots, kvpool.StateSlotAllocator)
    assert slots.num_slots == plan.num_state_slots == 1
    got = slots.alloc(1)
    assert got.tolist() == [1]  # (slot 0 is padding)
    with pytest.raises(kvpool.OutOfPagesError):
        slots.alloc(1)
    assert slots.num_free == 0 and slots.num_used == 1


def test_draft_rollback_pages_in_sliding_spaces():
    plan = kvpool.size_for("openai/gpt-oss-20b", "bf16", 0.9, page_size=16, num_draft_tokens=4,
                           **H200)
    # window 128 / 16 = 8 pages + 1 boundary + ceil(4 / 16) = 1 rollback page = 10 per request
    n = plan.requests_fit(8192)
    sp = plan.page_spaces["sliding_128"]
    assert sp["num_pages"] == 10 * n + min(512, 512 - 10)
    assert plan.request_bytes(8192) == (512 + 10) * 16 * 24_576
