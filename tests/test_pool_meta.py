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
        assert plan.k_bytes + plan.v_bytes + plan.scale_bytes + plan.workspace_bytes == plan.total_bytes
        assert plan.total_bytes <= plan.budget_bytes
        assert plan.num_tokens % page_size == 0
