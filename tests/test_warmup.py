"""Warm-up before a timed run (issue 22): kvpool.warmup and examples/serve.py's ``warmup()``.

- ``decode_variant`` keys what a planned decode compiles; ``decode_shapes`` finds one shape per
  variant (checked against every shape of a range).
- ``Engine.warmup()`` / ``GraphEngine.warmup()`` leave the engine and the pool's pages as they
  were (only the padding page is written) and the engine then serves the same tokens as a cold
  one (CPU).
- GPU: after the warm-up, a serving run with prefix hits, multi-request prefills and decode
  steps of changing batches compiles no kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvpool  # noqa: E402
from kvpool import attention  # noqa: E402
from kvpool.config import ModelSpec  # noqa: E402
from kvpool.llama import Llama  # noqa: E402
from kvpool.warmup import decode_shapes, decode_variant, geometric  # noqa: E402
from llama_fixtures import EXAMPLES, TINY, tiny_llama, tiny_weights  # noqa: E402

serve = pytest.importorskip("serve", reason=f"examples/serve.py not importable from {EXAMPLES}")

SMOL = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            vocab_size=100)  # fmt: skip


def _view(dtype="bf16"):
    spec = ModelSpec.from_dict(SMOL, name="smol", dtype="bf16")
    plan = kvpool.size_for(spec, dtype, num_tokens=8192, page_size=16)
    return kvpool.KVPool(plan, "cpu").layer(0)


def _plan(view, b, w, **kw):
    pt, sl = torch.zeros(b, w, dtype=torch.int32), torch.ones(b, dtype=torch.int32)
    return attention.plan_decode(view, 9, pt, sl, **kw)


def test_geometric_grid():
    assert geometric(1) == [1]
    assert geometric(5) == [1, 2, 3, 4, 5]
    g = geometric(4400)
    assert g[:11] == list(range(1, 12)) and g[-1] == 4400 and len(g) < 60
    assert all(b / a < 1.2 for a, b in zip(g[11:], g[12:-1], strict=False))


def test_decode_variant_keys_what_compiles():
    view = _view()
    two, three = _plan(view, 4, 8, num_splits=2), _plan(view, 4, 8, num_splits=3)
    # (the split count is an unspecialized int; splitting or not is a constexpr)
    assert decode_variant(two, 4, 9, 64) == decode_variant(three, 4, 9, 64)
    one = _plan(view, 4, 8, num_splits=1)
    assert decode_variant(one, 4, 9, 64) != decode_variant(two, 4, 9, 64)
    # the merge's tiles change with its rows (B x H_q from 4,096 on) and its split step
    assert decode_variant(two, 4, 9, 64) != decode_variant(two, 500, 9, 64)
    many = _plan(view, 4, 8, num_splits=40)  # (a merge step of 64 splits instead of 16)
    assert decode_variant(two, 4, 9, 64) != decode_variant(many, 4, 9, 64)
    wide = _plan(view, 4, 8, num_splits=2, block_n=128)
    assert decode_variant(two, 4, 9, 64) != decode_variant(wide, 4, 9, 64)


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
def test_decode_shapes_cover_every_shape_of_the_range(dtype):
    view = _view(dtype)
    shapes = decode_shapes(view, 9, range(1, 9), 40)
    keys = [decode_variant(_plan(view, b, w), b, 9, 64) for b, w in shapes]
    assert len(set(keys)) == len(keys) >= 2  # (one split at 1 page, several at 40 pages)
    every = {decode_variant(_plan(view, b, w), b, 9, 64) for b in range(1, 9) for w in range(1, 41)}
    assert every == set(keys)
    with pytest.raises(ValueError, match="max_pages"):
        decode_shapes(view, 9, [1], 0)
    with pytest.raises(ValueError, match="batches"):
        decode_shapes(view, 9, [0, 2], 4)


def _workload(eng, seed=0, n=8, new=10):
    """``n`` requests, two in three after a shared 12-token prefix, arriving 3 a step."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 97, 12).tolist()
    return [eng.submit((shared if i % 3 else []) + rng.integers(3, 97, int(rng.integers(2, 14)))
                       .tolist(), int(rng.integers(3, new)), arrival=i // 3)
            for i in range(n)]  # fmt: skip


def _pages_bytes(pool, ps):
    """Every buffer's bytes outside the padding page (rows >= page_size of per-slot buffers)."""
    out = {}
    for name, t in pool.buffers.items():
        if t.dim() >= 2 and t.shape[0] > ps:
            out[name] = t[ps:].contiguous().view(torch.uint8).clone()
    return out


@pytest.mark.parametrize("engine", ["Engine", "GraphEngine"])
def test_warmup_leaves_the_engine_as_it_was(engine):
    kw = {"use_graphs": False, "max_seq_len": 64} if engine == "GraphEngine" else {}
    cls = getattr(serve, engine)
    model = tiny_llama(seed=2)

    def make():
        return cls(model, serve.make_pool(model, "auto", 256, 4), max_running=4,
                   max_prefill_tokens=40, **kw)  # fmt: skip

    cold = make()
    cold_reqs = _workload(cold, n=5, new=5)
    cold.run()
    want = [(r.status, r.output) for r in cold_reqs]
    eng = make()
    reqs = _workload(eng, n=5, new=5)
    before = _pages_bytes(eng.pool, 4)
    info = eng.warmup()
    assert info["prefill_tokens"] == 40 and info["prefill_requests"] >= 2
    assert info["decode_shapes"]  # (Engine: the variants; GraphEngine: its buckets)
    after = _pages_bytes(eng.pool, 4)
    assert all(torch.equal(before[k], after[k]) for k in before)  # page 0 only was written
    assert eng.allocator.num_used == 0 and eng.cache.total_size == 0
    assert eng.stats.steps == 0 and eng.stats.generated == 0 and eng.stats.prefill_tokens == 0
    assert [r.status for r in reqs] == ["waiting"] * 5 and len(eng.waiting) == 5
    eng.run()
    assert [(r.status, r.output) for r in reqs] == want


def test_warmup_refuses_a_prefill_of_one_token():
    model = tiny_llama(seed=2)
    eng = serve.Engine(model, serve.make_pool(model, "auto", 256, 4), max_running=2)
    with pytest.raises(ValueError, match="prefill_tokens"):
        eng.warmup(prefill_tokens=1)


# ----------------------------------------------------------------------------- GPU


def _compiled_total() -> dict[str, int]:
    """Compiled variants per kvpool Triton/Gluon kernel (Triton 3.3+ ``device_caches``)."""
    import importlib

    out = {}
    kernels = (("decode", ("decode_kernel", "merge_kernel")), ("extend", ("extend_kernel",)),
               ("quant_write", ("quant_write_kernel",)), ("decode_gluon", ("decode_kernel",)),
               ("decode_gluon_fp4", ("decode_kernel",)))  # fmt: skip
    for mod_name, names in kernels:
        try:
            mod = importlib.import_module(f"kvpool.triton_kernels.{mod_name}")
        except ImportError:  # (no Gluon in this Triton)
            continue
        for n in names:
            caches = getattr(getattr(mod, n), "device_caches", None)
            if not isinstance(caches, dict):
                pytest.skip("this Triton exposes no compile cache (device_caches)")
            out[f"{mod_name}.{n}"] = sum(len(c[0]) for c in caches.values())
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["Engine", "GraphEngine"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_a_warmed_engine_compiles_nothing_while_serving(engine, kv_dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec = ModelSpec.from_dict(TINY, name="tiny", dtype="bf16")
    model = Llama(TINY, tiny_weights(seed=2), spec, "cuda")
    pool = serve.make_pool(model, kv_dtype, 2048, 4, scales=([1.0] * spec.num_layers,) * 2)
    kw = {"max_seq_len": 128} if engine == "GraphEngine" else {}
    eng = getattr(serve, engine)(model, pool, max_running=6, max_prefill_tokens=96, **kw)
    reqs = _workload(eng, seed=1) + _workload(eng, seed=2)
    if engine == "Engine":
        eng.warmup()  # (GraphEngine: its constructor warmed up on CUDA)
    torch.cuda.synchronize()
    before = _compiled_total()
    eng.run()
    torch.cuda.synchronize()
    assert all(r.status == "finished" for r in reqs)
    assert eng.stats.cached_tokens > 0  # (prefix hits did happen)
    grew = {k: (before[k], v) for k, v in _compiled_total().items() if v != before[k]}
    assert not grew, f"compiled while serving: {grew}"
