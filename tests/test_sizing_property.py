"""Property: for any geometry, dtype and page size, the plan's capacity is the largest page
multiple whose whole layout fits: total(n) <= budget < total(n + page_size)."""

from hypothesis import given, settings
from hypothesis import strategies as st

import kvpool

DTYPES = list(kvpool.KV_DTYPES)


@st.composite
def geometries(draw):
    n_layers = draw(st.integers(1, 12))
    kinds = draw(st.lists(st.sampled_from(["full_attention", "sliding_attention",
                                           "linear_attention"]),
                          min_size=n_layers, max_size=n_layers))
    if "linear_attention" in kinds and all(k == "linear_attention" for k in kinds):
        kinds[0] = "full_attention"
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    cfg = {
        "num_hidden_layers": n_layers,
        # at least 8 query heads (powers of two): every tp below splits them, as engines require
        "num_attention_heads": max(8, kv * draw(st.sampled_from([1, 2, 4]))),
        "num_key_value_heads": kv,
        "head_dim": 16 * draw(st.integers(1, 16)),
        "layer_types": kinds,
        "sliding_window": draw(st.integers(1, 4096)),
        "linear_num_key_heads": 8, "linear_num_value_heads": 8, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    }
    if draw(st.booleans()):
        cfg["kv_lora_rank"] = 16 * draw(st.integers(1, 40))
        cfg["qk_rope_head_dim"] = 16 * draw(st.integers(0, 4))
    return cfg


@settings(max_examples=150, deadline=None)
@given(
    cfg=geometries(),
    dtype=st.sampled_from(DTYPES),
    page_size=st.sampled_from([1, 2, 16, 64, 128]),
    tp=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1 << 20, 1 << 40),
    recipe=st.sampled_from(["linear", "linear_workspace"]),
)
def test_capacity_is_the_largest_page_multiple_that_fits(cfg, dtype, page_size, tp, budget, recipe):
    kw = dict(page_size=page_size, tp_size=tp, nvfp4_recipe=recipe)
    try:
        plan = kvpool.size_for(cfg, dtype, 0.5, total_memory=2 * budget, weights=0, **kw)
    except kvpool.BudgetTooSmallError:
        one_page = kvpool.size_for(cfg, dtype, num_tokens=page_size, **kw)
        assert one_page.total_bytes > budget
        return
    n = plan.num_tokens
    assert n % page_size == 0 and n >= page_size
    assert plan.total_bytes == sum(b.nbytes for b in plan.buffers)
    assert plan.total_bytes <= budget == plan.budget_bytes
    bigger = kvpool.size_for(cfg, dtype, num_tokens=n + page_size, **kw)
    assert bigger.total_bytes > budget
    # bytes grow monotonically (strictly) with tokens
    smaller = kvpool.size_for(cfg, dtype, num_tokens=max(page_size, n - page_size), **kw)
    assert smaller.total_bytes <= plan.total_bytes < bigger.total_bytes
    assert plan.total_bytes == (n + page_size) * plan.bytes_per_token + plan.fixed_bytes
