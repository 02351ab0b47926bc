"""Properties of plans over random geometries, dtypes, page sizes and budgets.

- Every plan's buffers add up to its total, within the budget; a model with one page space (full
  attention only) gets the largest page multiple whose whole layout fits:
  total(n) <= budget < total(n + page_size).
- Models with several page spaces (sliding windows, linear-attention state): the first space
  gets what is left after the split (less than one of its pages is left over), and
  ``requests_fit(n)`` requests of ``n`` tokens can be allocated from a ``PageAllocator`` per
  space (sliding spaces' prefill-chunk headroom kept aside) while one more cannot.
"""

import kvpool
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
        # (several spaces: one request of context_len in each, the first space's page included)
        assert one_page.total_bytes > budget or len(one_page.page_spaces) > 1
        return
    assert plan.total_bytes == sum(b.nbytes for b in plan.buffers)
    assert plan.total_bytes <= budget == plan.budget_bytes
    if len(plan.page_spaces) > 1:
        first = next(iter(plan.page_spaces.values()))
        if not first["capped_by_int32"]:
            assert budget - plan.total_bytes < first["page_size"] * first["bytes_per_token"]
        return
    n = plan.num_tokens
    if next(iter(plan.page_spaces.values()))["capped_by_int32"]:
        # the int32 slot ids, not the budget, set the size: the largest slot fits int32
        assert (plan.num_pages + 1) * page_size - 1 <= 2**31 - 1
        assert (plan.num_pages + 2) * page_size - 1 > 2**31 - 1
        return
    assert n % page_size == 0 and n >= page_size
    assert plan.total_bytes == sum(b.nbytes for b in plan.buffers)
    assert plan.total_bytes <= budget == plan.budget_bytes
    bigger = kvpool.size_for(cfg, dtype, num_tokens=n + page_size, **kw)
    assert bigger.total_bytes > budget
    # bytes grow monotonically (strictly) with tokens
    smaller = kvpool.size_for(cfg, dtype, num_tokens=max(page_size, n - page_size), **kw)
    assert smaller.total_bytes <= plan.total_bytes < bigger.total_bytes
    assert plan.total_bytes == (n + page_size) * plan.bytes_per_token + plan.fixed_bytes


def pages_per_request(space: dict, window: int, n: int, draft: int) -> int:
    """Reference: pages (slots) one request of n tokens holds in a space (issue 16's rule)."""
    ps = space["page_size"]
    full = -(-n // ps)
    if space["kind"] == "state":
        return 1
    if space["kind"] == "primary":
        return full
    return min(full, -(-min(n, window) // ps) + (1 if ps > 1 else 0) + -(-draft // ps))


def check_requests_fit(plan, n: int) -> None:
    """requests_fit(n) requests of n tokens allocate from the plan's allocators; one more fails."""
    draft = plan.num_draft_tokens
    rf = plan.requests_fit(n)
    assert rf * plan.request_bytes(n) <= plan.budget_bytes
    spaces = plan.page_spaces
    windows = {g.page_space: int(g.name.split("_")[1]) for g in plan.groups if g.kind == "sliding"}
    allocs = plan.allocators()
    assert set(allocs) == set(spaces)
    per = {}
    for name, sp in spaces.items():
        per[name] = pages_per_request(sp, windows.get(name, 0), n, draft)
        a = allocs[name]
        if sp["kind"] == "state":  # one slot a request
            assert isinstance(a, kvpool.StateSlotAllocator) and a.num_slots == sp["num_pages"]
        else:
            assert a.num_pages == sp["num_pages"] and a.page_size == sp["page_size"]
        if sp["headroom_pages"]:
            a.alloc(sp["headroom_pages"])  # kept for the prefill chunk in flight
        if rf:
            a.alloc(rf * per[name])
    # the binding space has no room for one more request
    binding = [s for s in spaces if allocs[s].num_free < per[s]]
    assert binding, (rf, {s: (allocs[s].num_free, per[s]) for s in spaces})
    free = allocs[binding[0]].num_free
    with pytest.raises(kvpool.OutOfPagesError):
        allocs[binding[0]].alloc(per[binding[0]])
    assert allocs[binding[0]].num_free == free  # (nothing half-allocated)


@settings(max_examples=120, deadline=None)
@given(
    cfg=geometries(),
    dtype=st.sampled_from(DTYPES),
    page_size=st.sampled_from([1, 16, 64]),
    # (small budgets: the allocators hold every page of every space)
    budget=st.integers(1 << 22, 1 << 27),
    context_len=st.sampled_from([1, 100, 4096, 8192, 32768]),
    draft=st.sampled_from([0, 3]),
    n=st.sampled_from([1, 17, 128, 1000, 8192, 40000]),
)
def test_requests_fit_are_allocatable_and_one_more_is_not(
    cfg, dtype, page_size, budget, context_len, draft, n
):
    kw = dict(page_size=page_size, context_len=context_len, num_draft_tokens=draft)
    try:
        plan = kvpool.size_for(cfg, dtype, 0.5, total_memory=2 * budget, weights=0, **kw)
    except (kvpool.BudgetTooSmallError, kvpool.LayoutError):
        return
    check_requests_fit(plan, n)
    slots = plan.page_spaces.get("linear_state", {}).get("num_pages", 0)
    assert plan.num_state_slots == slots
