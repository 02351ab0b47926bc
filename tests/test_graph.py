"""DecodeGraph (kvpool.graph): bucketing, padding and errors on CPU; capture and replay on CUDA.

CPU tests run the step eagerly on the bucket's static buffers (the same filling and padding
as a replay); the GPU tests capture a 30-layer decode step (write + decode per layer) and
compare its replay with eager calls, and check that a planned step never syncs.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvpool  # noqa: E402
from kvpool.graph import DecodeGraph  # noqa: E402

HQ, H, D, PS = 32, 8, 128, 16


def _pool(device="cpu", tokens=1024, dtype="bf16"):
    plan = kvpool.size_for(
        "meta-llama/Llama-3.1-8B", dtype, 0.9, num_tokens=tokens, page_size=PS, weights=0,
        gpu="H200",
    )  # fmt: skip
    pool = kvpool.KVPool(plan, device=device)
    n = plan.spec.num_layers
    pool.set_kv_scales([1.0] * n, [1.0] * n)
    g = torch.Generator(device).manual_seed(0)
    for i in pool.layers:  # (tokens a request reads but the step does not write: finite values)
        for t in (pool.layer(i).k, pool.layer(i).v):
            t.copy_(torch.randn(t.shape, generator=g, device=device).clamp(-4, 4).to(t.dtype))
    return pool


def _batch(n, max_pages, seed=0):
    """``n`` requests of 1..max_pages*PS tokens on distinct pages 1.., numpy int32."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(1, max_pages * PS + 1, n).astype(np.int32)
    pages, nxt = [], 1
    for s in seq:
        k = -(-int(s) // PS)
        pages.append(np.arange(nxt, nxt + k, dtype=np.int32))
        nxt += k
    table = kvpool.page_table(pages, max_pages)
    return table, seq, kvpool.decode_slots(table, seq, PS)


def _step_fn(pool, layers):
    """A decode step: per layer write the new K/V, then decode into the layer's output."""

    def step(s):
        outs = []
        for i in layers:
            pool.write(i, s.slots, s.inputs["k"], s.inputs["v"])
            outs.append(pool.decode(i, s.inputs["q"], plan=s.plan))
        return tuple(outs)  # [batch, HQ, D] per layer

    return step


INPUTS = {"q": ((HQ, D), torch.bfloat16), "k": ((H, D), torch.bfloat16),
          "v": ((H, D), torch.bfloat16)}  # fmt: skip


def _qkv(n, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(n, HQ, D, generator=g).to(torch.bfloat16).to(device),
        "k": torch.randn(n, H, D, generator=g).to(torch.bfloat16).to(device),
        "v": torch.randn(n, H, D, generator=g).to(torch.bfloat16).to(device),
    }


def test_bucket_is_the_smallest_that_holds_the_batch():
    g = DecodeGraph(_pool(), HQ, 4, buckets=(8, 1, 4, 4), use_graphs=False)
    assert g.buckets == (1, 4, 8)
    assert [g.bucket(n) for n in (1, 2, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]


def test_padded_rows_point_at_page_0_and_outputs_match_eager():
    pool = _pool()
    g = DecodeGraph(pool, HQ, 4, buckets=(8,), inputs=INPUTS, use_graphs=False)
    table, seq, slots = _batch(5, 4)
    x = _qkv(5)
    step = _step_fn(pool, [0, 1])
    out = g.run(step, table, seq, slots, **x)
    s = g.static[8]
    assert len(out) == 2 and out[0].shape == (5, HQ, D)
    # rows 0..4 the batch, rows 5..7 padding: page 0, seq_len 1, slot 0, zero inputs
    assert s.page_table[:5].tolist() == table.tolist()
    assert s.page_table[5:].eq(0).all() and s.seq_lens[5:].eq(1).all() and s.slots[5:].eq(0).all()
    assert s.inputs["q"][5:].eq(0).all()
    # the same batch, eager and unpadded, after the same writes (idempotent: same values)
    for i in (0, 1):
        want = pool.decode(i, x["q"], torch.from_numpy(table), torch.from_numpy(seq))
        assert torch.equal(out[i], want)


def test_a_smaller_batch_later_leaves_no_stale_rows():
    pool = _pool()
    g = DecodeGraph(pool, HQ, 4, buckets=(8,), inputs=INPUTS, use_graphs=False)
    step = _step_fn(pool, [0])
    g.run(step, *_batch(7, 4), **_qkv(7))
    table, seq, slots = _batch(2, 4, seed=3)
    g.run(step, table, seq, slots, **_qkv(2, seed=4))
    s = g.static[8]
    assert s.page_table[2:].eq(0).all() and s.seq_lens[2:].eq(1).all()
    assert s.seq_lens[:2].tolist() == seq.tolist()


def test_larger_batch_than_every_bucket_runs_eagerly_and_warns_once():
    pool = _pool()
    g = DecodeGraph(pool, HQ, 4, buckets=(1, 2), inputs=INPUTS, use_graphs=False)
    step = _step_fn(pool, [0])
    table, seq, slots = _batch(3, 4)
    x = _qkv(3)
    with pytest.warns(UserWarning, match=r"batch of 3 requests is larger than .*\(2\).*eagerly"):
        out = g.run(step, table, seq, slots, **x)
    want = pool.decode(0, x["q"], torch.from_numpy(table), torch.from_numpy(seq))
    assert torch.equal(out[0], want)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        g.run(step, table, seq, slots, **x)


def test_page_table_of_another_width_raises():
    pool = _pool()
    g = DecodeGraph(pool, HQ, 4, buckets=(8,), inputs=INPUTS, use_graphs=False)
    table, seq, slots = _batch(3, 3)
    with pytest.raises(ValueError, match=r"`page_table` has shape \(3, 3\).*\[B, 4\]"):
        g.run(_step_fn(pool, [0]), table, seq, slots, **_qkv(3))


def test_bad_arguments_raise():
    pool = _pool()
    table, seq, slots = _batch(3, 4)
    g = DecodeGraph(pool, HQ, 4, buckets=(8,), inputs=INPUTS, use_graphs=False)
    step = _step_fn(pool, [0])
    with pytest.raises(ValueError, match=r"`seq_lens` has shape \(2,\), expected \(3,\)"):
        g.run(step, table, seq[:2], slots, **_qkv(3))
    with pytest.raises(ValueError, match=r"inputs \['q'\] do not match"):
        g.run(step, table, seq, slots, q=_qkv(3)["q"])
    with pytest.raises(ValueError, match=r"`slots` is int64, expected int32"):
        g.run(step, table, seq, slots.astype(np.int64), **_qkv(3))
    with pytest.raises(ValueError, match=r"`buckets` = \[0\]"):
        DecodeGraph(pool, HQ, 4, buckets=(0,))
    with pytest.raises(ValueError, match=r"`max_pages` = 0"):
        DecodeGraph(pool, HQ, 0)
    with pytest.raises(ValueError, match=r"`use_graphs=True` needs a CUDA pool"):
        DecodeGraph(pool, HQ, 4, use_graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_captured_30_layer_step_replays_as_eager(dtype):
    """A 30-layer decode step (write + decode per layer) replayed from a CUDA graph equals eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool = _pool("cuda", tokens=64 * 8 * PS + PS, dtype=dtype)
    layers = pool.layers[:30]
    step = _step_fn(pool, layers)
    g = DecodeGraph(pool, HQ, 8, buckets=(16, 64), inputs=INPUTS)
    g.capture(step)
    for n, seed in ((11, 0), (64, 1), (3, 2)):
        table, seq, slots = _batch(n, 8, seed)
        x = _qkv(n, seed, "cuda")
        got = [t.clone() for t in g.run(step, table, seq, slots, **x)]
        pt, sl = torch.from_numpy(table).cuda(), torch.from_numpy(seq).cuda()
        loc = torch.from_numpy(slots).cuda()
        for j, i in enumerate(layers):
            pool.write(i, loc, x["k"], x["v"])
            want = pool.decode(i, x["q"], pt, sl)
            # (the eager plan is sized for n requests, the graph's for its bucket: split counts,
            # and so the order of the fp32 sums, may differ)
            torch.testing.assert_close(got[j].float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
# (torch warns that the sync debug mode is a prototype each time it is switched on)
@pytest.mark.filterwarnings("ignore:Synchronization debug mode:UserWarning")
def test_planned_decode_step_never_syncs():
    """write + decode with a plan over numpy metadata: no host<->device sync (issue 22)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool = _pool("cuda", tokens=64 * 8 * PS + PS)
    table, seq, slots = _batch(64, 8)
    x = _qkv(64, 0, "cuda")
    view = pool.layer(0)
    kvpool.attention.plan_decode(view, HQ, table, seq)  # warm-up (compiles nothing, allocates)
    step = _step_fn(pool, pool.layers[:4])
    from kvpool.graph import DecodeStatic

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # the second step runs on compiled kernels
            plan = kvpool.attention.plan_decode(view, HQ, table, seq, max_seq_len=8 * PS)
            loc = kvpool._host.as_device_tensor("slots", slots, view.k.device)
            s = DecodeStatic(64, plan.page_table, plan.seq_lens, loc, plan, x)
            step(s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
