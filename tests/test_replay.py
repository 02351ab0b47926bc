"""Recorded launches (kvpool._launch, attention/replay.py, write.py): replays equal fresh calls.

A planned ``decode`` and a ``write`` record their launches on the layer view; later calls of
the same kind replay them with their own tensors. Under the CPU interpreter the replay goes
through the normal Triton launch with the arguments substituted; on CUDA through the compiled
kernel's launcher (no JIT dispatch): the GPU tests compare that with the normal launch bit for
bit. Every replay must equal a call that checks and launches from scratch.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvpool  # noqa: E402
from kvpool import _launch, attention  # noqa: E402
from kvpool.attention import replay  # noqa: E402
from kvpool.config import ModelSpec  # noqa: E402
from kvpool.write import write_kv  # noqa: E402

PS = 16
TINY = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=100)  # fmt: skip
HQ = 4
LENS = [5, 20, 33]


def _pool(dtype, device="cpu", cfg=TINY, tokens=512):
    spec = ModelSpec.from_dict(cfg, name="tiny", dtype="bf16")
    plan = kvpool.size_for(spec, dtype, num_tokens=tokens, page_size=PS)
    pool = kvpool.KVPool(plan, device=device)
    n = spec.num_layers
    pool.set_kv_scales([0.05] * n, [0.04] * n)
    return pool


def _batch(lens, device="cpu"):
    pages, nxt = [], 1
    for n in lens:
        k = -(-n // PS)
        pages.append(np.arange(nxt, nxt + k, dtype=np.int32))
        nxt += k
    table = kvpool.page_table(pages, max(len(p) for p in pages))
    seq = np.asarray(lens, np.int32)
    slots = np.concatenate(
        [p[np.arange(n) // PS] * PS + np.arange(n) % PS for p, n in zip(pages, lens, strict=True)]
    )
    return tuple(torch.from_numpy(a).to(device) for a in (table, seq, slots.astype(np.int32)))


def _rand(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16).to(device)


def _fill(view, slots, seed, backend):
    n, h = slots.shape[0], view.num_kv_heads
    k = _rand((n, h, view.head_dim), seed, slots.device)
    v = _rand((n, h, view.v_head_dim), seed + 1, slots.device)
    write_kv(view, slots, k, v, backend=backend)


def _writes(view):
    """The write records on ``view`` ((fields, launch, fp4) tuples, see write.py)."""
    return [r for r in view.__dict__.get("_launch_records", {}).values() if isinstance(r, tuple)]


interpret = pytest.mark.interpret


@interpret
def test_launch_substitutes_the_per_call_tensors():
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(x, y, out, n, A: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(out + i, A * tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)

    x, y = torch.arange(20.0), torch.full((20,), 0.5)
    out = torch.zeros(20)
    rec = _launch.Launch(axpy, (2,), (x, y, out, 20), {"A": 3.0, "BLOCK": 16}, (x, out), x.device)
    assert rec.pos[0] is None and rec.pos[2] is None  # (no reference kept to per-call tensors)
    rec(x, out)
    assert torch.equal(out, 3 * x + 0.5)
    x2, out2 = torch.linspace(-1, 1, 20), torch.zeros(20)
    rec(x2, out2)
    assert torch.equal(out2, 3 * x2 + 0.5)
    assert not rec.fast  # (CPU: the normal launch)


def test_direct_launch_only_for_a_known_launcher(monkeypatch):
    """The C launch under Triton's launcher is called directly only for the Triton versions
    read (``DIRECT_TRITON``), a ``CudaLauncher`` whose kernel needs no scratch buffer."""
    calls = []

    class CudaLauncher:  # (the class name is what is checked)
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def launch(self, *args):
            calls.append(args)

    class Other(CudaLauncher):
        pass

    monkeypatch.setattr(_launch, "_DIRECT_OK", [True])
    good = CudaLauncher()
    assert _launch._direct_launch(good) == good.launch
    assert _launch._direct_launch(Other()) is None
    scratch = CudaLauncher()
    scratch.profile_scratch_size = 64
    assert _launch._direct_launch(scratch) is None
    monkeypatch.setattr(_launch, "_DIRECT_OK", [False])  # (another Triton)
    assert _launch._direct_launch(good) is None
    # a record with the direct launch passes the wrapper's arguments, scratch None
    rec = object.__new__(_launch.Launch)
    for name in _launch.Launch.__slots__:
        setattr(rec, name, None)
    rec.full, rec.subs, rec.grid = [7, None, 9], ((1, 0),), (3, 1, 1)
    rec.direct, rec.function, rec.meta, rec.coop, rec.pdl = good.launch, 11, (4, 1, 0), False, True
    rec.launch_ptrs(5, [0xABC])
    assert calls == [(3, 1, 1, 5, 11, False, True, None, None, (4, 1, 0), None, None, None,
                      7, 0xABC, 9)]  # fmt: skip


@interpret
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("splits", [1, 2])
def test_planned_decode_replays_bit_for_bit(dtype, splits):
    pool = _pool(dtype)
    view = pool.layer(0)
    pt, sl, slots = _batch(LENS)
    _fill(view, slots, 0, "triton")
    plan = attention.plan_decode(view, HQ, pt, sl, num_splits=splits, block_n=32)
    outs = []
    for seed in (1, 2, 3):
        q = _rand((len(LENS), HQ, view.head_dim), seed)
        got = attention.decode(view, q, plan=plan, backend="triton")
        # from scratch: a page table given explicitly is never recorded
        fresh = attention.decode(view, q, pt, sl, plan=plan, backend="triton")
        assert torch.equal(got, fresh)
        outs.append(got)
    assert len(replay.recorded(view)) == 1
    assert not torch.equal(outs[0], outs[1])
    # a new plan over new tensors of the same batch replays the same record
    plan2 = attention.plan_decode(view, HQ, pt.clone(), sl.clone(), num_splits=splits, block_n=32)
    q = _rand((len(LENS), HQ, view.head_dim), 3)
    assert torch.equal(attention.decode(view, q, plan=plan2, backend="triton"), outs[2])
    assert len(replay.recorded(view)) == 1
    # another kind of call (q in fp16, a given out) gets its own record
    out = torch.empty(len(LENS), HQ, view.v_head_dim, dtype=torch.float16)
    attention.decode(view, q.to(torch.float16), plan=plan, backend="triton", out=out)
    assert len(replay.recorded(view)) == 2
    fresh = attention.decode(view, q.to(torch.float16), pt, sl, plan=plan, backend="triton")
    assert torch.equal(out, fresh)


@interpret
def test_a_replay_still_refuses_what_a_fresh_call_refuses():
    pool = _pool("bf16")
    view = pool.layer(0)
    pt, sl, slots = _batch(LENS)
    _fill(view, slots, 0, "triton")
    plan = attention.plan_decode(view, HQ, pt, sl, num_splits=2, block_n=32)
    q = _rand((len(LENS), HQ, view.head_dim), 1)
    attention.decode(view, q, plan=plan, backend="triton")  # recorded
    # a view whose buffers were replaced is checked again (its record no longer applies)
    bad = copy.copy(view)  # (shares the records)
    bad.k = view.k[:, :1]
    with pytest.raises(ValueError, match="view.k"):
        attention.decode(bad, q, plan=plan, backend="triton")
    # CPU tensors: batch values are checked on every call, replays included
    sl_bad = sl.clone()
    sl_bad[1] = 0
    plan_bad = attention.plan_decode(view, HQ, pt, sl, num_splits=2, block_n=32)
    plan_bad.seq_lens = sl_bad
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        attention.decode(view, q, plan=plan_bad, backend="triton")
    # a mutated plan is keyed anew (and refused by the checks)
    plan.part_out = None
    with pytest.raises(ValueError, match="split workspace"):
        attention.decode(view, q, plan=plan, backend="triton")
    # q of another shape: refused as ever
    with pytest.raises(ValueError, match="head dim"):
        attention.decode(view, q[..., :16], plan=plan_bad, backend="triton")


@interpret
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4", "fp4_mx_block16"])
def test_write_replays_bit_for_bit(dtype):
    pool, ref = _pool(dtype), _pool(dtype)
    _, _, slots = _batch(LENS)
    view, rview = pool.layer(1), ref.layer(1)
    for seed, part in ((0, slice(0, 30)), (5, slice(30, None)), (9, slice(30, None))):
        s = slots[part]
        _fill(view, s, seed, "triton")
        _fill(rview, s, seed, "torch")  # the torch path (kvpool.formats), never recorded
    assert len(_writes(view)) == 2  # two kinds: 30 tokens, then 28
    rows = slots.long()  # (the rest of the pools' buffers is uninitialised memory)
    for name in ("k", "v", "k_block_scale", "v_block_scale"):
        a, b = getattr(view, name), getattr(rview, name)
        if a is not None:
            assert torch.equal(a[rows].view(torch.uint8), b[rows].view(torch.uint8)), name


@interpret
def test_write_replay_after_the_view_changed_checks_again():
    pool = _pool("bf16")
    view = pool.layer(0)
    _, _, slots = _batch(LENS)
    _fill(view, slots, 0, "triton")
    bad = copy.copy(view)  # (shares the records)
    bad.num_kv_heads = 1
    k = _rand((slots.shape[0], 2, 32), 0)  # (what the recorded write took)
    with pytest.raises(ValueError, match="`k` has shape"):
        write_kv(bad, slots, k, k, backend="triton")


# ----------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu
BIG = dict(TINY, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8_e4m3", "nvfp4", "fp4_mx_block16"])
@pytest.mark.parametrize("lens", [[700], [37] * 64 + [1000]])
def test_fast_launch_equals_the_normal_launch_gpu(dtype, lens):
    """Three pools with the same contents: one step of write + decode on each, through the C
    launch under Triton's launcher (where the version is known), through the compiled kernels'
    launchers and through Triton's normal launch; equal bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    results = []
    # the C launch under Triton's launcher, the launcher's Python wrapper, the normal launch
    for fast, direct in ((True, True), (True, False), (False, True)):
        _launch.FAST, _launch.DIRECT = fast, direct
        try:
            pool = _pool(dtype, "cuda", BIG, tokens=sum(lens) + 64 * PS)
            for b in pool.plan.buffers:  # (torch.empty: pages no request writes hold garbage)
                if b.role != "scale":
                    pool.buffers[b.name].view(torch.uint8).zero_()
            pt, sl, slots = _batch(lens, "cuda")
            for i in pool.layers:
                _fill(pool.layer(i), slots, 10 * i, "auto")
            last = slots[torch.cumsum(sl.long(), 0) - 1]
            plan = attention.plan_decode(pool.layer(0), 32, pt, sl)
            outs = []
            for i in pool.layers:
                view = pool.layer(i)
                for seed in (1, 2):  # the second call of a kind replays the record
                    n = len(lens)
                    k, v = _rand((n, 8, 128), seed, "cuda"), _rand((n, 8, 128), seed + 7, "cuda")
                    pool.write(i, last, k, v)
                    outs.append(pool.decode(i, _rand((n, 32, 128), seed + 3, "cuda"), plan=plan))
                launches = [r[1] for r in _writes(view)]
                launches += [x for r in replay.recorded(view) for x in r.launches]
                assert launches and all(x.fast == fast for x in launches)
                if _launch._direct_version():  # (Triton 3.6: kvpool's kernels use no scratch)
                    assert all(x.direct is not None for x in launches)
            torch.cuda.synchronize()
            bufs = [t.clone() for i in pool.layers for t in (pool.layer(i).k, pool.layer(i).v)]
            results.append((outs, bufs))
        finally:
            _launch.FAST = _launch.DIRECT = True
    (o1, b1), *rest = results
    for o2, b2 in rest:
        assert all(torch.equal(a, b) for a, b in zip(o1, o2, strict=True))
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(b1, b2, strict=True))  # fmt: skip
