"""Review: the new attention defaults (transposed-dot decode, word-level fp8 decode, 128-token
tiles, causal-skip extend loop) at the configurations their tests leave out: group 1 (GP = 1
in the swapped dots), 2, 5, 7, 8, page sizes 1 and 64, head_dim 64 and 128, seq_len 1, empty
prefixes and extend blocks that start past the first 128-token tile. Interpreted."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attention_helpers import TOL, Cache, rel_err, run_decode, run_extend  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
interpret = pytest.mark.interpret


@interpret
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("group", [1, 2, 5, 8])
@pytest.mark.parametrize("page", [1, 64])
def test_decode_default_plan_groups_pages(dtype, group, page):
    cache = Cache(dtype, [1, 130, 257], heads=2, d=64, page=page, heavy=True)
    out, ref = run_decode(cache, 2 * group, backend="triton")
    assert rel_err(out, ref) < TOL[dtype]


@interpret
@pytest.mark.parametrize("dtype", ["fp16", "fp8_e4m3"])
@pytest.mark.parametrize(
    "opts",
    [
        {"window": 100},
        {"softcap": 2.0},
        {"window": 1, "sinks": torch.tensor([1.0, -2.0, 3.0, 0.5, 0.0, 1.0, 2.0])},
    ],
)
def test_decode_default_plan_options_group7_d128(dtype, opts):
    cache = Cache(dtype, [1, 300], heads=1, d=128, page=16)
    out, ref = run_decode(cache, 7, backend="triton", **dict(opts))
    assert rel_err(out, ref) < TOL[dtype]


@interpret
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4", "fp4_mx_block16"])
@pytest.mark.parametrize("group", [1, 5, 8])
def test_extend_default_plan_causal_skip(dtype, group):
    # new blocks starting past the first 128-token tile (the unmasked loop runs), an empty
    # prefix longer than one tile, seq_len 1, a prefix ending mid-tile
    cache = Cache(dtype, [300, 140, 1, 129], heads=1, d=64, page=64, heavy=True)
    out, ref = run_extend(cache, group, [150, 140, 1, 2], backend="triton", use_plan=True)
    assert rel_err(out, ref) < TOL[dtype]


@interpret
@pytest.mark.parametrize("opts", [{"window": 130}, {"softcap": 3.0}])
def test_extend_default_plan_options_page1(opts):
    cache = Cache("fp8_e5m2", [300, 20], heads=2, d=64, page=1)
    out, ref = run_extend(cache, 6, [200, 20], backend="triton", use_plan=True, **opts)
    assert rel_err(out, ref) < TOL["fp8_e5m2"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("what", ["decode", "extend"])
def test_head_dim_256_default_plans_gpu(dtype, what):
    """Gemma-2-9B geometry (16 q / 8 KV heads, head_dim 256, a bundled model): the default
    tiles (extend: 128-token KV tiles, 3 stages for 16-bit caches) must fit in shared memory.
    Never run on the H200 so far: decides whether the new extend defaults launch at all."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cache = Cache(dtype, [300, 17], heads=8, d=256, page=16, device="cuda")
    if what == "decode":
        out, ref = run_decode(cache, 16, backend="triton", device="cuda")
    else:
        out, ref = run_extend(cache, 16, [200, 17], backend="triton", device="cuda", use_plan=True)
    assert rel_err(out, ref) < TOL[dtype]
