"""Tensor-parallel pools on torch.distributed, on the gloo backend (CPU), as CI runs them.

Multi-rank tests start 2-4 processes from a forkserver that imports torch once (a spawned child
would import it again: ~4 s of CPU each on this machine), rendezvous through a FileStore in
tmp_path, and write each rank's results to a pickle the test reads. Every launch has a deadline:
a hang fails the test and the processes are killed, it never stalls the suite.
"""

from __future__ import annotations

import hashlib
import inspect
import multiprocessing as mp
import os
import pickle
import time
import traceback
from datetime import timedelta

import kvpool
import numpy as np
import pytest
from kvpool.distributed import GroupPlan, kv_heads_of_rank, shard_kv_heads, tp_plan
from kvpool.distributed.broadcast import fitted_size, pack_header, parse_header, views

LLAMA = "meta-llama/Llama-3.1-8B"
DSV3 = "deepseek-ai/DeepSeek-V3"
GIB = 1 << 30
MIB = 1 << 20
GROUP_TIMEOUT = 5  # seconds: every collective of these tests fails within this, never hangs
# 2 KV heads: tp_size 4 replicates each head on two ranks
TINY_GQA = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "hidden_size": 512, "head_dim": 64, "torch_dtype": "bfloat16"}  # fmt: skip


# ---------------------------------------------------------------------------- launcher
def _entry(rank: int, n: int, store: str, out: str, fn: str, args: tuple) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=n,
            timeout=timedelta(seconds=GROUP_TIMEOUT),
        )  # fmt: skip
        res = globals()[fn](rank, n, *args)
    except BaseException:
        res = {"crash": traceback.format_exc()}
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(res, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _launch(fn: str, n: int, tmp_path, *args, deadline: float = 40.0):
    """Run ``fn(rank, n, *args)`` on ``n`` gloo ranks; ``(results, exit codes, seconds)``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "kvpool.distributed.broadcast"])
    out = tmp_path / fn
    out.mkdir()
    store = str(out / "store")
    t0 = time.monotonic()
    procs = [ctx.Process(target=_entry, args=(r, n, store, str(out), fn, args)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(deadline - (time.monotonic() - t0), 0.1))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    secs = time.monotonic() - t0
    assert not hung, f"ranks {hung} hung past {deadline} s"
    res = []
    for r in range(n):
        f = out / f"{r}.pkl"
        res.append(pickle.loads(f.read_bytes()) if f.exists() else None)
    for r, x in enumerate(res):
        assert not (isinstance(x, dict) and "crash" in x), f"rank {r} crashed:\n{x['crash']}"
    return res, [p.exitcode for p in procs], secs


def _catch(f, *a, **kw):
    """``(exception class name, message, seconds)`` of ``f(*a, **kw)``, or its result."""
    t = time.monotonic()
    try:
        return ("ok", f(*a, **kw), time.monotonic() - t)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t)


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for k, a in arrays.items():
        a = np.asarray(a)
        h.update(f"{k}{a.shape}{a.dtype}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _step(i: int):
    """Arrays of step ``i`` (same on every rank): sizes that grow past, then shrink under, 256."""
    b, p = [(4, 8), (8, 8), (64, 64), (2, 2), (2, 2), (2, 2), (2, 2), (2, 2), (2, 2), (0, 0),
            (3, 5)][i]  # fmt: skip
    rng = np.random.default_rng(i)
    seq = rng.integers(1, 8, b).astype(np.int32)
    return dict(
        page_table=rng.integers(0, 1 << 20, (b, p)).astype(np.int32),
        seq_lens=seq,
        slots=rng.integers(0, 1 << 24, int(seq.sum())).astype(np.int32),
        cu_seqlens=np.concatenate([[0], np.cumsum(seq)]).astype(np.int32),
        max_seq_len=np.array([seq.max() if b else 0], dtype=np.int32),
        work=rng.integers(0, 9, (b, 2)).astype(np.int32),
    )


NUM_STEPS = 11


# ---------------------------------------------------------------------------- workers
def _w_plans(rank: int, n: int) -> dict:
    """Every scenario of one 2-rank group, in the same order on both ranks."""
    from kvpool.distributed import StepBroadcaster, agree_plan

    r: dict = {}
    # min-memory rule: rank 1 reports less memory before (total) and after (available) weights
    total = [80 * GIB, 79 * GIB][rank]
    avail = [60 * GIB, 50 * GIB][rank]
    g = agree_plan(LLAMA, "fp8", 0.9, total_memory=total, available_memory=avail, page_size=16,
                   timeout=GROUP_TIMEOUT)  # fmt: skip
    r["min"] = (g.fields, g.fingerprint, g.memory_rank, g.total_memory, g.available_memory,
                g.plan.num_pages, g.tp_size, g.plan.kv_heads_per_rank,
                list(g.kv_heads))  # fmt: skip
    g = agree_plan(LLAMA, "bf16", 0.9, gpu="H100")
    r["gpu"] = (g.plan.num_pages, g.fingerprint, g.memory_rank)
    if "group" in inspect.signature(kvpool.size_for).parameters:  # once sizing has the hook
        import torch.distributed as dist

        p = kvpool.size_for(LLAMA, "bf16", 0.9, gpu="H100", group=dist.group.WORLD)
        r["hook"] = (p.num_pages, p.tp_size)
    # mismatches: every rank raises, naming the field and the rank
    r["tp"] = _catch(agree_plan, LLAMA, "fp8", 0.9, gpu="H200", tp_size=2 if rank == 0 else 1)
    r["model"] = _catch(agree_plan, LLAMA if rank == 0 else "Qwen/Qwen3-8B", "fp8", 0.9,
                        gpu="H200")  # fmt: skip
    r["dtype"] = _catch(agree_plan, LLAMA, "fp8" if rank == 0 else "bf16", 0.9, gpu="H200")
    r["unknown"] = _catch(agree_plan, LLAMA if rank == 0 else "no/such-model", "fp8", 0.9,
                          gpu="H200")  # fmt: skip
    # rank 1 cannot fit the plan: 1 byte short of the activation reserve
    short = [60 * GIB, 8 * GIB - 1][rank]
    r["fit"] = _catch(agree_plan, LLAMA, "fp8", 0.9, total_memory=80 * GIB, available_memory=short)
    # a rank that cannot allocate its shard stops every rank
    def alloc():
        if rank == 1:
            raise MemoryError("CUDA out of memory (simulated)")
        return "pool"

    from kvpool.distributed import on_every_rank

    r["alloc"] = _catch(on_every_rank, alloc, what="KVPool")
    r["alloc_ok"] = on_every_rank(lambda: rank)
    # the group is still usable after all those errors
    # (DeepSeek-V3's weights need 8 H200s: give the memory left after loading instead)
    g = agree_plan(DSV3, "fp8", 0.9, gpu="H200", available_memory=60 * GIB, dp_attention=True)
    r["dp"] = (g.dp_size, g.attn_tp_size, g.dp_rank, g.plan.tp_size, g.num_tokens_per_rank,
               g.num_tokens_total, g.requests_fit_total(4096), list(g.kv_heads))  # fmt: skip

    # one broadcast per step, growth and shrink, views valid after later steps, close
    bc = StepBroadcaster(capacity=256, shrink_after=4)
    r["bc"] = []
    first = None
    if rank == 0:
        r["bad"] = _catch(bc.send, page_table=np.zeros((2, 2), np.int64))
        r["bad_step"] = bc.step
        for i in range(NUM_STEPS):
            arrays = _step(i)
            before = bc.collectives
            bc.send(**arrays)
            r["bc"].append((_digest(arrays), bc.collectives - before, bc.size))
        bc.close()
    else:
        for _ in range(NUM_STEPS):
            before = bc.collectives
            got = bc.recv()
            first = got if first is None else first
            addrs = [(a.__array_interface__["data"][0], a.nbytes) for a in got.values() if a.size]
            adjacent = all(a + nb == b for (a, nb), (b, _) in zip(addrs, addrs[1:], strict=False))
            owns = any(a.flags.owndata for a in got.values())
            r["bc"].append((_digest(got), bc.collectives - before, bc.size, adjacent, owns,
                            list(got), {k: a.dtype.str for k, a in got.items()}))  # fmt: skip
        r["closed"] = bc.recv()
        r["first_still"] = _digest(first)
    return r


def _w_heads(rank: int, n: int) -> dict:
    """Rank 0 schedules one batch; each rank writes its heads of the full K/V into its shard."""
    import torch
    from kvpool.distributed import StepBroadcaster, agree_plan
    from kvpool.write import write_kv

    out = {}
    for model in (LLAMA, TINY_GQA):
        g = agree_plan(model, "bf16", num_tokens=64, page_size=16)
        bc = StepBroadcaster()
        if rank == 0:
            alloc = kvpool.PageAllocator(g.plan.num_pages, g.plan.page_size)
            lens = np.array([20, 7], dtype=np.int32)
            pages = [alloc.alloc(int(p)) for p in kvpool.pages_needed(lens * 0, lens, 16)]
            table = kvpool.page_table(pages)
            slots = kvpool.extend_slots(table, lens * 0, lens, 16)
            meta = dict(page_table=table, seq_lens=lens, slots=slots)
            bc.send(**meta)
        else:
            meta = bc.recv()
        spec = g.plan.spec
        t = int(meta["seq_lens"].sum())
        gen = torch.Generator().manual_seed(0)  # the same full K/V on every rank
        k = torch.randn(t, spec.num_kv_heads, spec.head_dim, generator=gen)
        v = torch.randn(t, spec.num_kv_heads, spec.v_head_dim, generator=gen)
        pool = kvpool.KVPool(g.plan, "cpu")
        view = pool.layer(0)
        loc = torch.from_numpy(meta["slots"].copy())
        write_kv(view, loc, shard_kv_heads(k, spec, n, rank), shard_kv_heads(v, spec, n, rank),
                 backend="torch")  # fmt: skip
        out[spec.name] = dict(
            table=_digest(meta), heads=list(g.kv_heads), k_full=k.bfloat16().float().numpy(),
            v_full=v.bfloat16().float().numpy(), k=view.k[loc].float().numpy(),
            v=view.v[loc].float().numpy(),
        )  # fmt: skip
    return out


def _w_death(rank: int, n: int) -> dict:
    """Rank 2 dies between steps; ranks 0 and 1 must end with an error, not wait forever."""
    from kvpool.distributed import StepBroadcaster, agree_plan

    bc = StepBroadcaster()
    t0 = time.monotonic()
    for i in range(50):
        if rank == 2 and i == 3:
            os._exit(7)  # no clean-up: as a crashed worker
        try:
            bc.send(**_step(i % NUM_STEPS)) if rank == 0 else bc.recv()
        except Exception as e:
            return {"error": (type(e).__name__, str(e)), "step": i, "secs": time.monotonic() - t0,
                    "again": _catch(bc.send if rank == 0 else bc.recv)[0]}  # fmt: skip
    # sends into a dead peer's socket may be buffered: the next collective must fail
    e = _catch(agree_plan, LLAMA, "fp8", 0.9, gpu="H200", timeout=2)
    return {"error": e[:2], "step": 50, "secs": time.monotonic() - t0}


def _w_absent(rank: int, n: int) -> dict:
    """Rank 1 never calls agree_plan (busy for 2 s, then leaves)."""
    from kvpool.distributed import agree_plan

    if rank == 1:
        time.sleep(2)
        return {}
    return {"e": _catch(agree_plan, LLAMA, "fp8", 0.9, gpu="H200", timeout=1)}


# ---------------------------------------------------------------------------- multi-rank tests
def test_two_ranks_agree_and_broadcast(tmp_path):
    res, codes, secs = _launch("_w_plans", 2, tmp_path)
    assert codes == [0, 0]
    r0, r1 = res

    # min-memory rule: both ranks get the plan size_for makes from rank 1's figures
    ref = kvpool.size_for(LLAMA, "fp8", 0.9, total_memory=79 * GIB, available_memory=50 * GIB,
                          page_size=16, tp_size=2)  # fmt: skip
    assert r0["min"][:-1] == r1["min"][:-1]  # all but the heads each rank holds
    assert (r0["min"][-1], r1["min"][-1]) == ([0, 1, 2, 3], [4, 5, 6, 7])
    fields, fp, memory_rank, total, avail, num_pages, tp, kvh, _ = r0["min"]
    assert (memory_rank, total, avail, tp) == (1, 79 * GIB, 50 * GIB, 2)
    # budget = 50 GiB - 79 GiB x 0.1 = 53,687,091,200 - 8,482,560,409.6 -> 45,204,530,790 bytes
    # (floor). Llama-3.1-8B fp8 TP-2: 32 layers x (K + V) x 4 KV heads x 128 x 1 byte = 32,768
    # bytes/token, plus 2 x 32 fp32 scales = 256 bytes: (45,204,530,790 - 256) // 32,768 =
    # 1,379,532 rows -> 86,220 whole pages of 16, one the padding page -> 86,219 usable pages.
    assert ref.budget_bytes == 45_204_530_790
    assert ref.bytes_per_token == 32_768 and ref.fixed_bytes == 256
    assert num_pages == ref.num_pages == 86_219
    assert fields["total_bytes"] == ref.total_bytes == 86_220 * 16 * 32_768 + 256
    assert kvh == 4
    # rank 0 alone would have had more pages: the min rule is what made them equal
    alone = kvpool.size_for(LLAMA, "fp8", 0.9, total_memory=80 * GIB, available_memory=60 * GIB,
                            page_size=16, tp_size=2)  # fmt: skip
    assert alone.num_pages > num_pages
    assert r0["gpu"] == r1["gpu"]
    if "hook" in r0:  # size_for(..., group=) is agree_plan(...).plan
        assert r0["hook"] == r1["hook"] == (r0["gpu"][0], 2)
    assert r0["gpu"][0] == kvpool.size_for(LLAMA, "bf16", 0.9, gpu="H100", tp_size=2).num_pages

    # mismatches: the same error on both ranks, naming the field and the ranks, at once
    for key, field, text in (
        ("tp", "tp_size", "`tp_size` is 2 on rank 0 but 1 on rank 1"),
        ("model", "model", "`model` is 'meta-llama/Llama-3.1-8B' on rank 0 but 'Qwen/Qwen3-8B'"),
        ("dtype", "dtype", "`dtype` is 'fp8' on rank 0 but 'bf16' on rank 1"),
    ):
        for r in (r0, r1):
            name, msg, took = r[key]
            assert name == "RankMismatchError", (key, r[key])
            assert text in msg and field in msg, msg
            assert took < GROUP_TIMEOUT / 2, (key, took)  # no waiting on a timeout
        assert r0[key][:2] == r1[key][:2]
    for r in (r0, r1):  # rank 1's unknown model: its name is the mismatch named
        assert r["unknown"][0] == "RankMismatchError" and "'no/such-model' on rank 1" in r[
            "unknown"][1]  # fmt: skip
    # rank 1 cannot fit: BudgetTooSmallError on both ranks, naming rank 1's memory
    for r in (r0, r1):
        name, msg, _ = r["fit"]
        assert name == "BudgetTooSmallError", r["fit"]
        assert "sized from rank 1's memory" in msg and "8589934591 bytes available" in msg, msg

    for r in (r0, r1):
        assert r["alloc"][:2] == ("MemoryError",
                                  "KVPool failed on rank 1: CUDA out of memory (simulated)")
    assert (r0["alloc_ok"], r1["alloc_ok"]) == (0, 1)

    # DP attention over 2 ranks: each rank holds its own requests' latents
    dp = tp_plan(DSV3, "fp8", 0.9, tp_size=2, gpu="H200", available_memory=60 * GIB,
                 dp_attention=True)  # fmt: skip
    assert r0["dp"][:2] == r1["dp"][:2] == (2, 1)
    assert (r0["dp"][2], r1["dp"][2]) == (0, 1)  # dp_rank
    assert r0["dp"][3:] == r1["dp"][3:] == (
        1, dp.plan.num_tokens, 2 * dp.plan.num_tokens, 2 * (dp.plan.num_pages // 4096), [0])

    # the broadcaster: identical arrays on both ranks, names, dtypes, one buffer, collectives
    assert r0["bad"][0] == "ArrayTypeError" and "`page_table` must be int32" in r0["bad"][1]
    assert r0["bad_step"] == 0  # nothing was sent
    assert [x[0] for x in r0["bc"]] == [x[0] for x in r1["bc"]]
    assert [x[0] for x in r0["bc"]] == [_digest(_step(i)) for i in range(NUM_STEPS)]
    # step 2 (64 x 64 page table) grows 256 words to its size + 25% in whole KiB: a grow
    # message, then the step; four low steps later the next message shrinks back to 256
    per_step = [x[1] for x in r0["bc"]]
    assert per_step == [1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert [x[1] for x in r1["bc"]] == per_step
    sizes = [x[2] for x in r0["bc"]]
    a2 = _step(2)
    need = len(pack_header(2, 0, 0, a2)) + sum(a.size for a in a2.values())
    grown = -(-(need * 5 // 4) // 256) * 256  # e.g. 4,642 words -> 5,888
    assert 4096 < need < grown < 1.3 * need + 256 and grown == fitted_size(need)
    assert sizes == [256, 256, grown, grown, grown, grown, 256, 256, 256, 256, 256], sizes
    assert [x[2] for x in r1["bc"]] == sizes
    for x in r1["bc"]:
        assert x[3] and not x[4]  # adjacent views of one buffer, none owning its data
        assert x[5] == ["page_table", "seq_lens", "slots", "cu_seqlens", "max_seq_len", "work"]
        assert set(x[6].values()) == {"<i4"}
    assert r1["closed"] is None
    assert r1["first_still"] == _digest(_step(0))  # step 0's views survive 10 later steps
    print(f"2-rank group: {secs:.1f} s")


def test_kv_heads_land_on_their_ranks(tmp_path):
    res, codes, secs = _launch("_w_heads", 4, tmp_path)
    assert codes == [0, 0, 0, 0]
    for name, per_rank in ((LLAMA, [[0, 1], [2, 3], [4, 5], [6, 7]]),
                           ("<dict>", [[0], [0], [1], [1]])):  # fmt: skip
        got = [r[name] for r in res]
        assert len({x["table"] for x in got}) == 1  # identical page table, seq_lens, slots
        assert [x["heads"] for x in got] == per_rank
        for x in got:
            # the shard's rows at the request's slots hold exactly its heads of the full K/V
            np.testing.assert_array_equal(x["k"], x["k_full"][:, x["heads"]])
            np.testing.assert_array_equal(x["v"], x["v_full"][:, x["heads"]])
        # the ranks' shards side by side (one rank per head set) are the full tensor
        one_each = {tuple(x["heads"]): x["k"] for x in got}
        np.testing.assert_array_equal(np.concatenate(list(one_each.values()), axis=1),
                                      got[0]["k_full"])  # fmt: skip
    print(f"4-rank group: {secs:.1f} s")


def test_rank_dying_mid_step_errors_the_others(tmp_path):
    res, codes, secs = _launch("_w_death", 3, tmp_path, deadline=30)
    assert codes[2] == 7 and codes[:2] == [0, 0]
    assert res[2] is None
    for r in res[:2]:
        assert r["error"][0] == "CollectiveError", r
        assert r["secs"] < 3 * GROUP_TIMEOUT, r
        if "again" in r:  # a broken broadcaster refuses further use at once
            assert r["again"] == "CollectiveError"
    assert secs < 30


def test_absent_rank_is_named_not_waited_for(tmp_path):
    res, codes, secs = _launch("_w_absent", 2, tmp_path, deadline=20)
    name, msg, took = res[0]["e"]
    assert name == "CollectiveError" and "agree_plan" in msg, res[0]
    assert "1" in msg.split("not every rank arrived")[1]  # gloo names rank 1
    assert took < GROUP_TIMEOUT


# ---------------------------------------------------------------------------- single process
@pytest.mark.parametrize(
    ("kv", "tp", "want"),
    [
        (8, 1, [range(0, 8)]),
        (8, 2, [range(0, 4), range(4, 8)]),
        (8, 8, [range(i, i + 1) for i in range(8)]),
        (8, 16, [range(i // 2, i // 2 + 1) for i in range(16)]),  # each head on 2 ranks
        (2, 8, [range(i // 4, i // 4 + 1) for i in range(8)]),
    ],
)
def test_kv_heads_of_rank_split(kv, tp, want):
    spec = kvpool.ModelSpec.from_dict({**TINY_GQA, "num_attention_heads": 32,
                                       "num_key_value_heads": kv})  # fmt: skip
    assert [kv_heads_of_rank(spec, tp, r) for r in range(tp)] == want
    per_rank = kvpool.size_for(spec, "bf16", num_tokens=16, tp_size=tp).kv_heads_per_rank
    assert all(len(h) == per_rank for h in want)


def test_kv_heads_of_rank_mla_and_errors():
    mla = kvpool.ModelSpec.from_pretrained(DSV3)
    assert [kv_heads_of_rank(mla, 8, r) for r in range(8)] == [range(0, 1)] * 8
    spec = kvpool.ModelSpec.from_dict(TINY_GQA)  # 2 KV heads
    with pytest.raises(kvpool.ModelConfigError, match="tp_size `3` exceeds the 2 KV heads"):
        kv_heads_of_rank(spec, 3, 0)
    eight = kvpool.ModelSpec.from_pretrained(LLAMA)
    with pytest.raises(kvpool.ModelConfigError, match="tp_size `3` does not divide the 8"):
        kv_heads_of_rank(eight, 3, 0)
    with pytest.raises(ValueError, match=r"`rank` = 2 is outside 0..1"):
        kv_heads_of_rank(eight, 2, 2)
    with pytest.raises(ValueError, match="`rank` must be an integer"):
        kv_heads_of_rank(eight, 2, True)
    with pytest.raises(ValueError, match=r"must be \[T, 8, D\]"):
        shard_kv_heads(np.zeros((3, 4, 2)), eight, 2, 0)


def test_dp_attention_capacity_deepseek_v3_h200():
    """TP-8 vs DP-8 attention for DeepSeek-V3 on H200s, fp8 latent, worked by hand."""
    tp8 = tp_plan(DSV3, "fp8", 0.9, tp_size=8, gpu="H200")
    dp8 = tp_plan(DSV3, "fp8", 0.9, tp_size=8, gpu="H200", dp_attention=True)
    ref = kvpool.size_for(DSV3, "fp8", 0.9, tp_size=8, gpu="H200")
    b = ref.budget
    # H200: 143,771 MiB; weights (the estimate, split over the 8 ranks) are the same per rank
    # under DP attention (the attention weights it replicates are not counted)
    assert b.total_memory == 143_771 * MIB == 150_754_820_096
    assert dp8.plan.budget.weights == b.weights == 84_143_786_966
    # budget = (total - weights) - total x 0.1 = 66,611,033,130 - 15,075,482,009.6
    assert b.budget == 51_535_551_120 == dp8.plan.budget_bytes
    # the latent: 61 layers x (512 + 64) x 1 byte = 35,136 bytes/token, replicated under TP;
    # 61 fp32 per-layer scales = 244 fixed bytes. (51,535,551,120 - 244) // 35,136 = 1,466,744
    # rows, one the padding page: 1,466,743 tokens per rank either way.
    assert ref.bytes_per_token == 35_136 and ref.fixed_bytes == 244
    assert tp8.num_tokens_per_rank == dp8.num_tokens_per_rank == 1_466_743
    # TP-8: all 8 ranks hold the same tokens (8 copies of each latent) -> 1,466,743 in total.
    # DP-8: each rank holds its own requests -> 8 x 1,466,743 = 11,733,944 tokens.
    assert (tp8.dp_size, tp8.num_tokens_total) == (1, 1_466_743)
    assert (dp8.dp_size, dp8.attn_tp_size, dp8.num_tokens_total) == (8, 1, 11_733_944)
    # requests of 32,768 tokens: 1,466,743 // 32,768 = 44 per rank; 352 over DP-8
    assert (dp8.requests_fit(32_768), dp8.requests_fit_total(32_768)) == (44, 352)
    assert tp8.requests_fit_total(32_768) == 44
    assert dp8.plan.tp_size == 1 and dp8.fingerprint != tp8.fingerprint  # dp_size differs
    # DP-4 on 8 ranks: attention TP groups of 2 (the latent still replicated within them)
    dp4 = tp_plan(DSV3, "fp8", 0.9, tp_size=8, gpu="H200", dp_attention=True, dp_size=4, rank=5)
    assert (dp4.attn_tp_size, dp4.dp_rank, dp4.attn_tp_rank) == (2, 2, 1)
    assert dp4.num_tokens_total == 4 * 1_466_743
    with pytest.raises(ValueError, match="`dp_size` = 3 must be >= 1 and divide tp_size 8"):
        tp_plan(DSV3, "fp8", tp_size=8, gpu="H200", dp_attention=True, dp_size=3)
    with pytest.raises(ValueError, match="needs `dp_attention=True`"):
        tp_plan(DSV3, "fp8", tp_size=8, gpu="H200", dp_size=8)
    assert isinstance(dp8, GroupPlan)


def test_message_format_round_trip():
    """Header and data of one message, parsed without a process group."""
    from kvpool.distributed.broadcast import _DATA

    arrays = {"page_table": np.arange(12, dtype=np.int32).reshape(3, 4),
              "empty": np.zeros((0, 5), np.int32), "scalar": np.array(7, np.int32),
              "é": np.array([-1, 2**31 - 1], np.int32)}  # fmt: skip
    words = pack_header(5, _DATA, 300, arrays)
    buf = np.zeros(300, np.int32)
    buf[: len(words)] = words
    off = len(words)
    for a in arrays.values():
        buf[off : off + a.size] = a.reshape(-1)
        off += a.size
    kind, nxt, head, meta = parse_header(buf, 300, 5)
    assert (kind, nxt, head) == (_DATA, 300, len(words))
    got = views(buf, head, meta)
    assert list(got) == list(arrays)
    for k, a in arrays.items():
        assert got[k].shape == a.shape
        np.testing.assert_array_equal(got[k], a)
        assert np.shares_memory(got[k], buf) or a.size == 0
    import torch  # the NCCL path slices the device buffer the same way: torch views

    tv = views(torch.from_numpy(buf), head, meta)
    for k, a in arrays.items():
        np.testing.assert_array_equal(tv[k].numpy(), a)
    err = kvpool.distributed.CollectiveError
    with pytest.raises(err, match="received step 5, expected step 6"):
        parse_header(buf, 300, 6)
    with pytest.raises(kvpool.distributed.CollectiveError, match="not a StepBroadcaster"):
        parse_header(np.zeros(300, np.int32), 300, 5)
