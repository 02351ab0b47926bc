"""Host-tier benchmark: demote/load bandwidth per KV dtype, and a replayed multi-turn workload.

1. **Bandwidth.** For each dtype, one run of ``--pages`` contiguous pages (default 64 pages of
   16 tokens) of a real model's geometry (default Llama-3.1-8B) is demoted (device -> pinned
   host, ``HostPool.copy_pages``: one copy per buffer) and loaded back (host -> device, on a
   side stream as ``HostTier.load`` does), against one ``torch`` copy of the same number of
   bytes between one contiguous device tensor and one pinned host tensor. GB/s = 1e9 bytes/s
   over the best of ``--reps`` synchronized runs.
2. **Workload.** Sessions sharing a system prompt take turns (each turn: the conversation so
   far + new user tokens; the answer is appended), with a working set of ``--working-set`` x
   the device pool; replayed with and without the host tier. Per request it measures the KV
   path of the time to first token: match, load (waited layer by layer before each layer's
   ``extend``), the quantized write of the recomputed tokens and ``extend`` of every layer
   over the prompt; the TTFT proxy adds the recomputed tokens at ``--prefill-tokens-per-s``
   (the model's GEMMs, which this benchmark does not run: an assumption, stated in the
   output). Reported: hit rate (prompt tokens not recomputed), mean KV-path ms, mean proxy ms.

    python benches/tier/bench_tier.py --device cuda --out benches/tier/results/h200.json
    python benches/tier/bench_tier.py --device cpu --small --out benches/tier/results/cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings

import kvpool
import numpy as np
import torch
from kvpool.tier import HostPool, HostTier, TierMatch

TOY = kvpool.ModelSpec.from_dict({"num_hidden_layers": 4, "hidden_size": 512,
                                  "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "head_dim": 64}, name="toy-4L")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B", help="bundled name or path")
    p.add_argument("--dtypes", default="bf16,fp8_e4m3,nvfp4,fp4_mx_block16")
    p.add_argument("--pages", type=int, default=64, help="pages in the bandwidth run")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per copy")
    p.add_argument("--pool-pages", type=int, default=256, help="device pool of the workload")
    p.add_argument("--working-set", type=float, default=3.0, help="working set / device pool")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=256, help="shared system-prompt tokens")
    p.add_argument("--user", type=int, default=64, help="user tokens per turn")
    p.add_argument("--answer", type=int, default=64, help="answer tokens per turn")
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0,
                   help="assumed prefill rate of the model's GEMMs for the TTFT proxy")
    p.add_argument("--workload-dtypes", default="bf16,nvfp4")
    p.add_argument("--small", action="store_true",
                   help="CPU-sized run: a 4-layer toy geometry, a smaller workload")
    p.add_argument("--out", help="write the results as JSON here")
    return p


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int) -> float:
    """Best seconds of ``fn()`` over ``reps`` runs (synchronized; the least disturbed run)."""
    fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return float(np.min(ts))


def bandwidth(spec, dtype: str, a) -> dict:
    dev = torch.device(a.device)
    ps, n = a.page_size, a.pages
    plan = kvpool.size_for(spec, dtype, num_tokens=(n + 1) * ps, page_size=ps, host_pages=n + 1)
    pool = kvpool.KVPool(plan, device=dev)
    host = HostPool(pool)
    for t in pool.buffers.values():
        t.view(torch.uint8).random_(0, 256) if t.dtype != torch.uint8 else t.random_(0, 256)
    pages = np.arange(1, n + 1, dtype=np.int32)
    nbytes = n * ps * plan.host.bytes_per_token
    copies = host.copy_pages(pages, pages, to_host=True)
    stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None

    def load():
        if stream is None:
            host.copy_pages(pages, pages, to_host=False)
            return
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            host.copy_pages(pages, pages, to_host=False)

    demote_s = timed(lambda: host.copy_pages(pages, pages, to_host=True), dev, a.reps)
    load_s = timed(load, dev, a.reps)
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    d2h_s = timed(lambda: h.copy_(d, non_blocking=True), dev, a.reps)
    h2d_s = timed(lambda: d.copy_(h, non_blocking=True), dev, a.reps)
    # bytes equal both ways
    host.copy_pages(pages, pages, to_host=True)
    sync(dev)
    ok = all(torch.equal(dv[1:n + 1].cpu().view(torch.uint8), hv[1:n + 1].view(torch.uint8))
             for pairs in host.layers.values() for dv, hv in pairs)
    gb = lambda s: nbytes / s / 1e9  # noqa: E731
    return {"dtype": dtype, "pages": n, "page_size": ps, "bytes": nbytes, "copies": copies,
            "demote_GBps": gb(demote_s), "load_GBps": gb(load_s),
            "torch_d2h_GBps": gb(d2h_s), "torch_h2d_GBps": gb(h2d_s),
            "bytes_vs_bf16": None, "bytes_equal": ok}  # fmt: skip


def workload(a, pool_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    per_session = a.system + a.turns * (a.user + a.answer)
    sessions = max(2, round(a.working_set * pool_tokens / per_session))
    rng = np.random.default_rng(0)
    system = rng.integers(0, 30000, a.system)
    hist = [system.copy() for _ in range(sessions)]
    out = []
    for _ in range(a.turns):
        for s in range(sessions):
            prompt = np.concatenate([hist[s], rng.integers(0, 30000, a.user)]).astype(np.int32)
            ans = rng.integers(0, 30000, a.answer).astype(np.int32)
            out.append((prompt, ans))
            hist[s] = np.concatenate([prompt, ans])
    return out


def replay(spec, dtype: str, a, with_host: bool) -> dict:
    dev = torch.device(a.device)
    ps = a.page_size
    reqs = workload(a, a.pool_pages * ps)
    need_host = sum(len(p) + len(x) for p, x in reqs[-len(reqs) // a.turns:]) // ps + 64
    plan = kvpool.size_for(spec, dtype, num_tokens=a.pool_pages * ps, page_size=ps,
                           host_pages=need_host)
    pool = kvpool.KVPool(plan, device=dev)
    if with_host:
        tier = HostTier(pool)
        cache, alloc = tier.cache, tier.allocator
    else:
        tier, alloc = None, kvpool.PageAllocator(plan.num_pages, ps)
        cache = kvpool.RadixCache(alloc)
    H, Hq, D = plan.kv_heads_per_rank, spec.num_attention_heads, spec.head_dim
    layers = pool.layers
    asked = reused = 0
    kv_ms = []
    proxy_ms = []
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the model's activations
    for prompt, ans in reqs:
        sync(dev)
        t0 = time.perf_counter()
        mt = prompt[:-1]  # the last prompt token is always computed (its logits start decode)
        if tier is not None:
            m = tier.match(mt)
        else:
            p, node, n = cache.match_prefix(mt)
            m = TierMatch(p, node, n, np.zeros(0, np.int32), node, 0)
        cache.lock(m.node)
        load = tier.load(m) if tier is not None else None
        loaded = load.device_pages if load is not None else np.zeros(0, np.int32)
        prefix = np.concatenate([m.pages, loaded]).astype(np.int32)
        cached = len(prefix) * ps
        total = len(prompt)
        own = (tier.alloc if tier is not None else cache.alloc)(-(-total // ps) - len(prefix))
        table = kvpool.page_table([np.concatenate([prefix, own]).astype(np.int32)])
        pre = np.array([cached], np.int32)
        seq = np.array([total], np.int32)
        loc = kvpool.extend_slots(table, pre, seq, ps)
        nt = len(loc)
        cu = np.array([0, nt], np.int32)
        for layer in layers:
            k = torch.randn(nt, H, D, device=dev, generator=g, dtype=dt)
            v = torch.randn(nt, H, D, device=dev, generator=g, dtype=dt)
            q = torch.randn(nt, Hq, D, device=dev, generator=g, dtype=dt)
            if load is not None:
                load.wait(layer)
            pool.write(layer, loc, k, v)
            pool.extend(layer, q, cu, table, seq)
        sync(dev)
        t = time.perf_counter() - t0
        recomputed = total - int(pre[0])
        kv_ms.append(1000 * t)
        proxy_ms.append(1000 * (t + recomputed / a.prefill_tokens_per_s))
        asked += total
        reused += int(pre[0])
        # the answer's pages (decode not timed), then cache the conversation
        full = np.concatenate([prompt, ans])
        more = (tier.alloc if tier is not None else cache.alloc)(
            -(-len(full) // ps) - len(prefix) - len(own))
        cache.insert(full, (m.pages, loaded, own, more))
        cache.unlock(m.node)
        for x in (own, more, loaded):
            if len(x):
                alloc.free(x)
    out = {"dtype": dtype, "with_host": with_host, "requests": len(reqs),
           "device_pool_tokens": plan.num_tokens, "host_pool_tokens": plan.host_pages * ps,
           "working_set_tokens": sum(len(p) + len(x) for p, x in reqs[-len(reqs) // a.turns:]),
           "hit_rate": reused / asked, "kv_path_ms_mean": float(np.mean(kv_ms)),
           "ttft_proxy_ms_mean": float(np.mean(proxy_ms)),
           "ttft_proxy_ms_p90": float(np.percentile(proxy_ms, 90))}  # fmt: skip
    if tier is not None:
        out["metrics"] = tier.metrics()
    return out


def main(argv=None) -> dict:
    a = parser().parse_args(argv)
    warnings.filterwarnings("ignore")
    spec = kvpool.ModelSpec.from_pretrained(a.model)
    wspec = spec
    if a.small:  # the workload on a toy geometry (CPU); the bandwidth runs keep --model
        wspec = TOY
        a.pool_pages, a.turns, a.system, a.user, a.answer = 32, 4, 64, 16, 16
    dev = torch.device(a.device)
    cpu = f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    machine = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu
    res = {"machine": machine, "model": spec.name, "workload_model": wspec.name,
           "torch": torch.__version__,
           "prefill_tokens_per_s_assumed": a.prefill_tokens_per_s,
           "bandwidth": [], "workload": []}  # fmt: skip
    for d in a.dtypes.split(","):
        r = bandwidth(spec, d, a)
        res["bandwidth"].append(r)
        print(f"bw {d:15s} {r['bytes'] / 2**20:8.2f} MiB {r['copies']:4d} copies  "
              f"demote {r['demote_GBps']:7.2f} GB/s (torch {r['torch_d2h_GBps']:7.2f})  "
              f"load {r['load_GBps']:7.2f} GB/s (torch {r['torch_h2d_GBps']:7.2f})  "
              f"bytes_equal={r['bytes_equal']}", flush=True)
    bf = next((r["bytes"] for r in res["bandwidth"] if r["dtype"] == "bf16"), None)
    for r in res["bandwidth"]:
        r["bytes_vs_bf16"] = None if bf is None else bf / r["bytes"]
    for d in a.workload_dtypes.split(","):
        for with_host in (False, True):
            r = replay(wspec, d, a, with_host)
            res["workload"].append(r)
            print(f"workload {d:10s} host={with_host!s:5s} hit_rate {r['hit_rate']:.3f}  "
                  f"kv path {r['kv_path_ms_mean']:8.2f} ms  "
                  f"TTFT proxy {r['ttft_proxy_ms_mean']:8.2f} ms "
                  f"(p90 {r['ttft_proxy_ms_p90']:.2f})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
