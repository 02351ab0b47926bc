"""Decode and extend at every bundled model's per-rank geometry (head_dim 64, 128, 256; query
groups 1..16; gemma-2's soft-capping and window, gpt-oss' sinks and window), every dtype, against
the fp64 oracle of attention_helpers.py; the plan names the kernel; the bench's CPU smoke run.
"""

import dataclasses
import os
import sys

import pytest

torch = pytest.importorskip("torch")

from attention_helpers import TOL, Cache, rel_err, run_decode, run_extend  # noqa: E402
from kvpool import attention  # noqa: E402

DTYPES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16")
# (name, query heads, KV heads, head_dim, options) per rank, as in benches/attention/bench_models
GEOMETRIES = [
    ("llama-3.1-70b-tp8", 8, 1, 128, {}),
    ("qwen3.5-27b", 24, 4, 256, {}),
    ("qwen3.5-35b-a3b", 16, 2, 256, {}),
    ("gemma-2-9b", 16, 8, 256, {"softcap": 50.0, "window": 4096}),
    ("gpt-oss", 64, 8, 64, {"sinks": True}),
    ("gpt-oss-sliding", 64, 8, 64, {"sinks": True, "window": 128}),
    ("group-16", 64, 4, 128, {}),
]


def _opts(opts, hq, window=None):
    o = {k: v for k, v in opts.items() if k != "sinks"}
    if window is not None and "window" in o:
        o["window"] = window
    if opts.get("sinks"):
        o["sinks"] = torch.linspace(-2.0, 3.0, hq)
    return o


@pytest.mark.parametrize("name, hq, hk, d, opts", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
def test_plan_names_the_kernel(name, hq, hk, d, opts):
    """Every geometry gets a plan naming its kernel (on the CPU: the generic Triton kernel)."""
    c = Cache("fp8_e4m3", [40, 3], heads=hk, d=d, page=16)
    p = attention.plan_decode(c.view, hq, c.page_table, c.seq_lens)
    assert p.kernel == "triton_generic" and p.group_pad >= hq // hk
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    assert attention.plan_extend(c.view, hq, cu, c.page_table, c.seq_lens).kernel == (
        "triton_generic"
    )


def test_uncovered_geometry_is_named():
    """A head_dim no kernel tiles is refused naming it and what is supported."""
    c = Cache("bf16", [9], heads=2, d=32, page=16)
    view = c.view
    bad = dataclasses.replace(view, head_dim=48, k=view.k.new_empty(view.k.shape[0], 2, 48))
    with pytest.raises(ValueError, match="`view.head_dim` = 48: the kernels need a power of two"):
        attention.plan_decode(bad, 4, c.page_table, c.seq_lens)


@pytest.mark.interpret
@pytest.mark.parametrize("name, hq, hk, d, opts", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
def test_model_geometry_interpreted(name, hq, hk, d, opts, dtype):
    """The generic kernel at each geometry's group and options, heads scaled down (KV heads 1,
    head_dim 32 for 128/256, 64 kept), window 8, under the interpreter."""
    g = hq // hk
    dd = 64 if d == 64 else 32
    c = Cache(dtype, [1, 19, 40], heads=1, d=dd, page=16)
    out, ref = run_decode(c, g, backend="triton", **_opts(opts, g, window=8))
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("name, hq, hk, d, opts", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_geometry_gpu(name, hq, hk, d, opts, dtype):
    """Real per-rank shapes on the GPU: decode (default plan) and extend (a plan), requests
    ending mid-tile, the plan's kernel recorded in the failure message."""
    c = Cache(dtype, [1, 100, 4093, 700], heads=hk, d=d, page=16, device="cuda", heavy=True)
    o = _opts(opts, hq)
    plan = attention.plan_decode(c.view, hq, c.page_table, c.seq_lens)
    out, ref = run_decode(c, hq, backend="triton", device="cuda", **o)
    assert rel_err(out, ref) < TOL[dtype], plan.kernel
    out, ref = run_extend(
        c, hq, [1, 30, 64, 700], backend="triton", device="cuda", use_plan=True, **_opts(opts, hq)
    )
    assert rel_err(out, ref) < TOL[dtype]


def test_bench_models_quick(tmp_path):
    """benches/attention/bench_models.py --quick end to end on the CPU (torch path): a record
    per point, no errors, the markdown table."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benches", "attention"))
    import bench_models

    env = os.environ.pop("TRITON_INTERPRET", None)
    try:
        recs = bench_models.main(
            ["--quick", "--out", str(tmp_path), "--models", "gemma-2-9b,deepseek-v3-tp8",
             "--dtypes", "bf16,nvfp4"]
        )  # fmt: skip
    finally:
        if env is not None:
            os.environ["TRITON_INTERPRET"] = env
    assert not [r for r in recs if "error" in r]
    # gemma: 2 dtypes x 2 shapes; deepseek: 2 dtypes x 2 pages x 2 shapes
    assert len(recs) == 4 + 8
    assert {r["kernel"] for r in recs} == {"triton_generic", "mla_small"}  # (2 heads: small)
    assert all(r["tflops"] > 0 for r in recs if r["kernel"] == "mla_small")
    assert (tmp_path / "models.md").read_text().count("\n") == 2 + 12
