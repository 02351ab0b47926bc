"""Review reproducers: FP4 write kernel vs formats.quantize at extreme (but accepted) nvfp4
global scales. The pool accepts any fp32 scale that is finite and > 0, subnormal or huge."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvpool.write import write_kv  # noqa: E402
from test_write import (  # noqa: E402
    KERNEL_MODES,
    assert_buffers_equal,
    device_for,
    expected_after,
    make_pool,
    set_scales,
    snapshot,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _rows():
    nan, inf = float("nan"), float("inf")
    return torch.tensor(
        [
            [nan] + [1e35] * 15 + [2e36] + [-3e35] * 15,  # NaN with finite neighbours
            [-nan] + [1e35] * 15 + [-nan] + [0.0] * 15,  # -NaN
            [inf] + [1e35] * 15 + [-inf] + [1e30] * 15,  # +-inf, scale not saturated
            [0.0] * 16 + [1e-44] * 16,  # zero block and a tiny one
            [3e-30] * 16 + [1.0] * 16,
            [5.0e37, 1.0e37, -2.5e37, 4.0e37] * 8,
            # subnormal inputs: for g < 2^-117 the divisor s * g is subnormal, 1 / it overflows
            [1.6e-40, 4e-41, -8e-41, 1.2e-40] * 4 + [1e-41, -3e-42, 2e-42, 5e-42] * 4,
        ]
    )[:, None, :]


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize(
    "g",
    [
        2.0e35,  # FLT_MAX / 6 / g < 448: a NaN / inf amax no longer saturates the scale
        3.0e38,  # 1 / g is subnormal
        1.0e-40,  # subnormal g: 1 / g overflows to inf
        2.0**-126,
        2.0**-120,
    ],
)
def test_nvfp4_extreme_global_scale(mode, g):
    dev = device_for(mode)
    x = _rows()
    x = torch.cat([x, -x.flip(0)], dim=1)  # [T, 2, 32]
    t = x.shape[0]
    loc = torch.arange(t) + 8
    pool = make_pool("nvfp4", dev, heads=2, head_dim=32, page_size=8, num_tokens=t + 8)
    set_scales(pool, g, g)
    for bt in (1, 8):
        before = snapshot(pool)
        xv = x.flip(0).contiguous()
        write_kv(pool.layer(0), loc.to(dev), x.to(dev), xv.to(dev), backend="triton", block_t=bt)
        assert_buffers_equal(pool, expected_after(pool, before, 0, loc, x, xv))
