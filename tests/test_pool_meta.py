import pytest

import kvpool
from kvpool.config import bundled_models

torch = pytest.importorskip("torch")

DTYPES = ["auto", *kvpool.KV_DTYPES]


@pytest.mark.parametrize("model", bundled_models())
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_meta_pool_allocates_exactly_the_plan(model, page_size):
    for dtype in DTYPES:
        plan = kvpool.size_for(model, dtype, 0.9, gpu="H200", weights=0, page_size=page_size)
        pool = kvpool.KVPool(plan, device="meta")
        assert pool.nbytes == plan.total_bytes
        assert sum(b.nbytes for b in plan.buffers) == plan.total_bytes
        assert (plan.k_bytes + plan.v_bytes + plan.scale_bytes + plan.workspace_bytes
                + plan.state_bytes == plan.total_bytes)
        assert plan.total_bytes <= plan.budget_bytes
        assert plan.num_tokens % page_size == 0


@pytest.mark.parametrize("bad", [1e39, 1e-46, float("nan"), -1.0, 0.0, "2", True])
def test_set_kv_scales_checks_everything_before_writing(bad):
    plan = kvpool.size_for({"num_hidden_layers": 4, "num_attention_heads": 8,
                            "num_key_value_heads": 2, "head_dim": 64}, "fp8_e4m3", num_tokens=16)
    pool = kvpool.KVPool(plan, device="cpu")
    with pytest.raises(ValueError, match=r"k_scales\[3\]"):
        pool.set_kv_scales([2.0, 2.0, 2.0, bad], [1.0] * 4)
    assert [pool.layer(i).k_scale.item() for i in range(4)] == [1.0] * 4
    assert pool.scales_source is None
    pool.set_kv_scales([2.0, 3.0, 4.0, 5.0], [1.0] * 4, source="test")
    assert [pool.layer(i).k_scale.item() for i in range(4)] == [2.0, 3.0, 4.0, 5.0]


def test_layer_index_checks():
    plan = kvpool.size_for("Qwen/Qwen3-Next-80B-A3B-Thinking", "bf16", num_tokens=16)
    pool = kvpool.KVPool(plan, device="meta")
    assert pool.layers == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]
    for bad in (0, 48, -1, True, "3", 3.0):  # (3.0 used to find layer 3 by hash)
        with pytest.raises(KeyError, match="layer"):
            pool.layer(bad)
    import numpy as np

    assert pool.layer(np.int64(3)) is pool.layer(3)
    with pytest.raises(KeyError, match="layer"):  # (a bool tensor indexes as 1)
        pool.layer(torch.tensor(True))
    # one rule (kvpool._args.as_index) for every room's integer arguments
    from kvpool import attention

    for bad in (True, np.bool_(True), torch.tensor(True)):
        with pytest.raises(ValueError, match="must be an int"):
            attention._check_knob("num_splits", bad, 1)
        with pytest.raises(ValueError, match="`window` = .*: must be an int >= 1"):
            attention._check_options(bad, None, None, 4, "cpu")
