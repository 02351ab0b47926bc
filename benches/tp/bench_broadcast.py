"""Per-step metadata broadcast cost and a TP-2 decode of the Llama-3.1-8B geometry (issue 23).

Run on 2 GPUs of one host (NVLink multicast stays off, as the device notes require):

    NCCL_NVLS_ENABLE=0 PYTHONPATH=python torchrun --standalone --nproc_per_node 2 \\
        benches/tp/bench_broadcast.py --out benches/tp/results/h200x2.json

and for the TP-1 baseline of the decode on one GPU, the same with ``--nproc_per_node 1``.
A CPU smoke run of the broadcast part (no GPU): ``--backend gloo`` (decode is skipped).

What it measures (median over ``--iters``, after warm-up):

1. ``nccl_broadcast_us``: one ``dist.broadcast`` of the packed step buffer of a decode step at
   B = 256 (page table ``[B, ctx / page]``, seq_lens, slots, cu_seqlens: what
   :class:`kvpool.distributed.StepBroadcaster` sends), CUDA events on the receiving rank.
   Target < 30 us.
2. ``step_us``: :meth:`StepBroadcaster.send` / :meth:`recv` end to end (host packing, the
   copy to the device, the broadcast, the receivers' header read-back), wall clock.
3. ``per_tensor_us``: the same arrays as four broadcasts (one per tensor), for comparison.
4. ``gloo_step_us``: StepBroadcaster over a gloo group of the same ranks (SGLang broadcasts its
   scheduler output over a CPU group).
5. ``decode_layer_us``: one layer of decode attention per rank (``kvpool.attention.decode``,
   Llama-3.1-8B: 32 query heads, 8 KV heads, head_dim 128, split over the ranks) and the
   all-reduce of the attention output ``[B, 4096]`` bf16 that TP adds after ``o_proj``;
   ``decode_step_us`` = 32 x (layer + all-reduce). Compare the TP-2 and TP-1 runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import kvpool
import numpy as np
import torch
import torch.distributed as dist
from kvpool.distributed import StepBroadcaster, agree_plan

LLAMA = "meta-llama/Llama-3.1-8B"


def step_arrays(b: int, ctx: int, page: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A decode step's metadata at B requests of ``ctx`` tokens on shuffled pages."""
    rng = np.random.default_rng(seed)
    pages = ctx // page
    table = (rng.permutation(b * pages) + 1).astype(np.int32).reshape(b, pages)
    seq = np.full(b, ctx, dtype=np.int32)
    return dict(
        page_table=table,
        seq_lens=seq,
        slots=kvpool.decode_slots(table, seq, page),
        cu_seqlens=np.arange(b + 1, dtype=np.int32),
    )


def median_us(fn, iters: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def cuda_median_us(fn, iters: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()  # both ranks start together: the time is the broadcast, not the skew
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def bench_broadcast(args, rank: int, world: int, device: torch.device, res: dict) -> None:
    arrays = step_arrays(args.batch, args.ctx, args.page)
    words = sum(a.size for a in arrays.values())
    res["payload_words"] = words
    res["payload_bytes"] = 4 * words
    if world == 1:
        return
    bc = StepBroadcaster(capacity=1 << 16)

    def step():
        if rank == 0:
            bc.send(**arrays)
        else:
            got = bc.recv()
            assert got["page_table"].shape == arrays["page_table"].shape

    res["step_us"] = median_us(step, args.iters)
    size = bc.size
    buf = torch.zeros(size, dtype=torch.int32, device=device)
    timer = cuda_median_us if device.type == "cuda" else median_us
    res["broadcast_words"] = size
    res["nccl_broadcast_us" if device.type == "cuda" else "broadcast_us"] = timer(
        lambda: dist.broadcast(buf, 0), args.iters
    )
    ts = [torch.from_numpy(a.reshape(-1).copy()).to(device) for a in arrays.values()]

    def per_tensor():
        for t in ts:
            dist.broadcast(t, 0)

    res["per_tensor_us"] = timer(per_tensor, args.iters)
    if device.type == "cuda":
        cpu = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
        gbc = StepBroadcaster(cpu, capacity=1 << 16)

        def gloo_step():
            gbc.send(**arrays) if rank == 0 else gbc.recv()

        res["gloo_step_us"] = median_us(gloo_step, args.iters)


def bench_decode(args, rank: int, world: int, res: dict) -> None:
    from kvpool import attention

    cfg = dict(kvpool.ModelSpec.from_pretrained(LLAMA).config)
    cfg["num_hidden_layers"] = 1  # every layer decodes alike: time one, report x 32
    b, ctx, page = args.batch, args.ctx, args.page
    g = agree_plan(cfg, args.dtype, num_tokens=b * ctx, page_size=page)
    pool = kvpool.KVPool(g.plan, "cuda")
    view = pool.layer(0)
    for t in (view.k, view.v):
        t.view(torch.uint8).random_(0, 64)  # finite values in every dtype
    arrays = step_arrays(b, ctx, page)
    pt = torch.from_numpy(arrays["page_table"]).cuda()
    sl = torch.from_numpy(arrays["seq_lens"]).cuda()
    hq = 32 // world
    q = torch.randn(b, hq, 128, dtype=torch.bfloat16, device="cuda")
    plan = attention.plan_decode(view, hq, pt, sl, max_seq_len=ctx)
    out = torch.empty(b, hq, 128, dtype=torch.bfloat16, device="cuda")
    layer = cuda_median_us(lambda: attention.decode(view, q, plan=plan, out=out), args.iters)
    hidden = torch.randn(b, 4096, dtype=torch.bfloat16, device="cuda")
    ar = cuda_median_us(lambda: dist.all_reduce(hidden), args.iters) if world > 1 else 0.0
    res.update(
        tp_size=world, dtype=g.plan.dtype, kv_heads_per_rank=g.plan.kv_heads_per_rank,
        q_heads_per_rank=hq, decode_layer_us=layer, allreduce_us=ar,
        decode_step_us=32 * (layer + ar),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device notes)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=120))
    res: dict = {"backend": args.backend, "world": world, "batch": args.batch, "ctx": args.ctx,
                 "page": args.page}  # fmt: skip
    if device.type == "cuda":
        res["device"] = torch.cuda.get_device_name()
    bench_broadcast(args, rank, world, device, res)
    if device.type == "cuda":
        bench_decode(args, rank, world, res)
    rows: list = [None] * world
    dist.all_gather_object(rows, res)
    if rank == 0:
        text = json.dumps(rows, indent=1)
        print(text)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
