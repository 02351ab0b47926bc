"""Decode attention for one layer of each bundled model's geometry, per rank, every KV dtype.

Geometries (``MODELS``; from ``python/kvpool/models/*.json``, per rank at the TP size each
model is usually served with; DeepSeek-V3/R1 also at TP 8, Kimi-K2 at TP 1 and 8): query / KV
heads, head_dim, and the options the layer runs with (gemma-2's soft-capping 50 and sliding
window 4,096; gpt-oss' sinks, and its sliding layers' window of 128 as a second entry). MLA
layers run :func:`kvpool.attention.mla.mla_decode` on the 512 + 64 latent.

Points: page 16 (MLA also 64), B x L in {1 x 32k, 16 x 8k, 64 x 8k, 128 x 4k}. Each call is
captured in a CUDA graph and replayed, the L2 flushed before every repetition (outside the
timed region), the median of ``--reps`` (>= 25) CUDA-event timings kept (the harness of
``bench_attention.py``). Baselines in the same process, same B x L: torch SDPA on contiguous
bf16 K/V (``enable_gqa``; without soft-capping, sinks or windows: the best torch path, not the
same math at those layers), and for MLA the same absorbed attention as contiguous bf16
matmul -> fp32 softmax -> matmul over a ``[B, L, 576]`` latent.

Records (``<out>/models.json``, one per (model, tp, dtype, page, B, L), appended as they come so
a cut run keeps its points): ``time_ms``, ``baseline_ms``, ``ratio`` (baseline / kvpool),
``kv_bytes`` (cache bytes the call reads: data + block scales), ``kv_TBps``, ``kernel`` (the
plan's kernel variant), ``splits``, and for MLA ``tflops`` (``2 B H L (576 + 512)`` FLOP / time).
``<out>/models.md`` holds the table.

    python benches/attention/bench_models.py --out DIR [--models deepseek-v3,gpt-oss-20b]
        [--dtypes bf16,fp8_e4m3] [--shapes 64x8192] [--reps 25] [--budget-s 450]
    python benches/attention/bench_models.py --quick --out DIR   # CPU smoke, tiny sizes

``--quick`` runs tiny geometries on the CPU (the torch reference path, or the Triton kernels
under ``TRITON_INTERPRET=1``) with wall-clock timing, to check the script end to end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from kvpool import attention
from kvpool.pool import LayerView

#: name -> (tp, query heads, KV heads, head_dim, options); MLA: KV heads 0, head_dim 576
MODELS = {  # (the off-fast-path models first: a run cut by --budget-s keeps them)
    "deepseek-v3": (1, 128, 0, 576, {}),  # (DeepSeek-R1: the same attention)
    "deepseek-v3-tp8": (8, 16, 0, 576, {}),
    "kimi-k2": (1, 64, 0, 576, {}),
    "kimi-k2-tp8": (8, 8, 0, 576, {}),
    "gpt-oss-120b": (1, 64, 8, 64, {"sinks": True}),  # (gpt-oss-20b: the same attention)
    "gpt-oss-120b-sliding": (1, 64, 8, 64, {"sinks": True, "window": 128}),
    "gemma-2-9b": (1, 16, 8, 256, {"softcap": 50.0, "window": 4096}),
    "qwen3.5-27b": (1, 24, 4, 256, {}),
    "qwen3.5-35b-a3b": (1, 16, 2, 256, {}),  # (Qwen3-Next-80B: the same per-rank geometry)
    "llama-3.1-8b": (1, 32, 8, 128, {}),
    "llama-3.1-70b": (8, 8, 1, 128, {}),
    "qwen3-30b-a3b": (1, 32, 4, 128, {}),
    "mixtral-8x7b": (2, 16, 4, 128, {}),
}
DTYPES = ("bf16", "fp8_e4m3", "nvfp4", "fp8_e5m2", "fp4_mx_block16", "fp16")
SHAPES = ((1, 32768), (16, 8192), (64, 8192), (128, 4096))
RANK, ROPE = 512, 64
QUICK_SHAPES = ((2, 128), (3, 64))
# DeepSeek-V3's softmax scale (1/sqrt(192) x mscale^2, YaRN factor 40)
MLA_SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)


def log(*a):
    print(*a, flush=True)


class Bench:
    """Timing and output of one run (GPU: CUDA graphs + L2 flush; quick: wall clock on CPU)."""

    def __init__(self, out: str, reps: int, quick: bool):
        self.out, self.reps, self.quick, self.records = out, reps, quick, []
        self.dev = "cpu" if quick else "cuda"
        if not quick:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import bench_attention as ba  # the shared harness (graphs, L2 flush, medians)

            self.ba = ba

    def time_ms(self, fn) -> float:
        if not self.quick:
            return self.ba.time_ms(fn, self.reps)[0]
        fn()
        ts = []
        for _ in range(self.reps):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)

    def save(self, rec: dict) -> None:
        self.records.append(rec)
        with open(os.path.join(self.out, "models.json"), "w") as f:
            json.dump(self.records, f, indent=1)
        log(json.dumps(rec))


# ----------------------------------------------------------------------------- caches


def random_view(dtype, rows, hk, d, dev, mla: bool) -> LayerView:
    """One layer's buffers with random valid codes (moderate magnitudes, no NaN/Inf).

    MLA: ``k`` the latent ``[rows, 1, d]``, ``v`` None; else K and V ``[rows, hk, d]``.
    """
    heads = 1 if mla else hk
    st = attention._STORAGE[dtype]
    fp4 = dtype in ("nvfp4", "fp4_mx_block16")

    def data():
        if st in (torch.float32, torch.bfloat16, torch.float16):
            return torch.randn(rows, heads, d, device=dev).to(st)
        if fp4:
            return torch.randint(0, 256, (rows, heads, d // 2), dtype=torch.uint8, device=dev)
        lo, hi = (0x28, 0x58) if dtype == "fp8_e4m3" else (0x30, 0x48)
        u = torch.randint(lo, hi, (rows, heads, d), dtype=torch.uint8, device=dev)
        return (u | torch.randint(0, 2, u.shape, dtype=torch.uint8, device=dev) << 7).view(st)

    def scales():
        if dtype == "nvfp4":
            u = torch.randint(0x30, 0x40, (rows, heads, d // 16), dtype=torch.uint8, device=dev)
            return u.view(torch.float8_e4m3fn)
        if dtype == "fp4_mx_block16":
            return torch.randint(124, 129, (rows, heads * d // 16), dtype=torch.uint8, device=dev)
        return None

    scaled = dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4")
    sc = (lambda: torch.tensor([0.05 if dtype != "nvfp4" else 0.3], device=dev)) if scaled else None
    return LayerView(
        layer=0, dtype=dtype, page_size=16, num_kv_heads=heads, head_dim=d,
        v_head_dim=0 if mla else d, k=data(), v=None if mla else data(),
        k_block_scale=scales(), v_block_scale=None if mla else scales(),
        k_scale=sc() if sc else None, v_scale=sc() if sc and not mla else None,
    )  # fmt: skip


def bytes_per_token(view: LayerView) -> int:
    n = view.k[0].numel() * view.k.element_size()
    if view.v is not None:
        n += view.v[0].numel() * view.v.element_size()
    for t in (view.k_block_scale, view.v_block_scale):
        if t is not None:
            n += t[0].numel() * t.element_size()
    return n


def page_table(b, ctx, page, rows, gen, dev):
    need = b * (ctx // page)
    ids = torch.randperm(rows // page - 1, generator=gen)[:need] + 1
    return ids.reshape(b, ctx // page).to(torch.int32).to(dev)


# ----------------------------------------------------------------------------- points


def kvpool_point(bench, view, name, tp, hq, opts, b, ctx, page, **plan_kw):
    mla = view.v is None
    gen = torch.Generator().manual_seed(b * 7 + ctx)
    pv = dataclasses.replace(view, page_size=page)
    pt = page_table(b, ctx, page, view.k.shape[0], gen, bench.dev)
    sl = torch.full((b,), ctx, dtype=torch.int32, device=bench.dev)
    d = view.head_dim
    q = torch.randn(b, hq, d, device=bench.dev).to(torch.bfloat16)
    kw = {"kv_lora_rank": RANK if not bench.quick else d - 16} if mla else {}
    plan = attention.plan_decode(pv, hq, pt, sl, max_seq_len=ctx, **kw, **plan_kw)
    call = dict(plan=plan, sm_scale=MLA_SCALE if mla else None, **kw)
    if not mla:
        if opts.get("sinks"):
            call["sinks"] = torch.randn(hq, device=bench.dev)
        call.update({k: opts[k] for k in ("window", "softcap") if k in opts})
    backend = "triton" if not bench.quick or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    ms = bench.time_ms(lambda: attention.decode(pv, q, backend=backend, **call))
    rec = dict(
        model=name, tp=tp, dtype=view.dtype, page=page, B=b, L=ctx, q_heads=hq,
        kv_heads=0 if mla else view.num_kv_heads, head_dim=d, time_ms=ms,
        kv_bytes=b * ctx * bytes_per_token(view), kernel=plan.kernel, splits=plan.num_splits,
        options=sorted(opts),
    )  # fmt: skip
    rec["kv_TBps"] = rec["kv_bytes"] / ms / 1e9
    if mla:
        rank = kw["kv_lora_rank"]
        rec["tflops"] = 2 * b * hq * ctx * (d + rank) / ms / 1e9
        rec.update(block_h=plan.block_h, block_n=plan.block_n, warps=plan.num_warps)
    if plan_kw:
        rec["variant"] = plan_kw
    return rec


def baseline_ms(bench, hq, hk, d, b, ctx, mla: bool) -> float:
    """Contiguous bf16: SDPA (GQA) or the absorbed MLA as matmul-softmax-matmul."""
    dev, bf = bench.dev, torch.bfloat16
    if mla:
        rank = RANK if not bench.quick else d - 16
        q = torch.randn(b, hq, d, device=dev).to(bf)
        lat = torch.randn(b, ctx, d, device=dev).to(bf)
        v = lat[..., :rank]

        def fn():
            s = torch.bmm(q, lat.transpose(1, 2)).float() * MLA_SCALE
            return torch.bmm(torch.softmax(s, -1).to(bf), v)

        return bench.time_ms(fn)
    q = torch.randn(b, hq, 1, d, device=dev).to(bf)
    k = torch.randn(b, hk, ctx, d, device=dev).to(bf)
    v = torch.randn(b, hk, ctx, d, device=dev).to(bf)
    return bench.time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def table(records) -> str:
    head = (
        "| model | tp | heads q/kv | head_dim | dtype | page | B x L | kvpool ms | baseline ms "
        "| ratio | TB/s | TFLOP/s | kernel |"
    )
    rows = [head, "|" + "---|" * 13]
    for r in records:
        if "error" in r:
            continue
        rows.append(
            f"| {r['model']} | {r['tp']} | {r['q_heads']}/{r['kv_heads'] or 'MLA'} | "
            f"{r['head_dim']} | {r['dtype']} | {r['page']} | {r['B']} x {r['L']} | "
            f"{r['time_ms']:.4f} | {r['baseline_ms']:.4f} | {r['ratio']:.2f} | "
            f"{r['kv_TBps']:.2f} | {r.get('tflops', float('nan')):.0f} | {r['kernel']} |"
        )
    return "\n".join(rows) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES))
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting points after")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run at tiny sizes")
    ap.add_argument(
        "--mla-sweep",
        default="",
        help="MLA tile variants first, block_h:num_warps:block_n,... (e.g. 16:4:32,32:4:32,"
        "32:8:64,64:8:32) at --sweep-shape for the bf16/fp8_e4m3/nvfp4 caches of deepseek-v3",
    )
    ap.add_argument("--sweep-shape", default="64x8192")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    quick = args.quick
    bench = Bench(args.out, 3 if quick else max(args.reps, 25), quick)
    shapes = (
        QUICK_SHAPES if quick else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    )
    t0 = time.time()
    if args.mla_sweep and not quick:
        sweep(bench, args)
    for name in args.models.split(","):
        tp, hq, hk, d, opts = MODELS[name]
        mla = hk == 0
        if quick:  # tiny: heads / 8 (>= 1 KV head, the group kept), head_dim 32, latent 32 + 16
            g = 1 if mla else hq // hk
            hk = 0 if mla else max(1, hk // 8)
            hq = max(2, hq // 8) if mla else hk * g
            d = 48 if mla else 32
            opts = {**opts, **({"window": 16} if "window" in opts else {})}
        rows = max(b * n for b, n in shapes) + 64
        base = {}
        for dtype in args.dtypes.split(","):
            try:
                view = random_view(dtype, rows, hk, d, bench.dev, mla)
            except Exception as e:  # noqa: BLE001  (out of memory: record and go on)
                bench.save(dict(model=name, tp=tp, dtype=dtype, error=repr(e)[:300]))
                continue
            for page in (16, 64) if mla else (16,):
                for b, n in shapes:
                    if time.time() - t0 > args.budget_s:
                        log(f"budget of {args.budget_s} s spent: stopping")
                        return finish(bench)
                    try:
                        if (b, n) not in base:
                            base[(b, n)] = baseline_ms(bench, hq, hk, d, b, n, mla)
                        rec = kvpool_point(bench, view, name, tp, hq, opts, b, n, page)
                        rec["baseline_ms"] = base[(b, n)]
                        rec["ratio"] = base[(b, n)] / rec["time_ms"]
                        bench.save(rec)
                    except Exception as e:  # noqa: BLE001
                        traceback.print_exc()
                        bench.save(dict(model=name, tp=tp, dtype=dtype, page=page, B=b, L=n,
                                        error=repr(e)[:300]))  # fmt: skip
            del view
            if not quick:
                torch.cuda.empty_cache()
    return finish(bench)


def sweep(bench, args) -> None:
    """MLA tile variants (records with ``variant``) before the main run: the defaults of
    :func:`kvpool.attention.mla.plan_mla_decode` are not measured yet."""
    b, n = map(int, args.sweep_shape.split("x"))
    tp, hq, _, d, _ = MODELS["deepseek-v3"]
    base = baseline_ms(bench, hq, 0, d, b, n, True)
    for dtype in ("bf16", "fp8_e4m3", "nvfp4"):
        view = random_view(dtype, b * n + 64, 0, d, bench.dev, True)
        for v in args.mla_sweep.split(","):
            bh, nw, bn = map(int, v.split(":"))
            kw = dict(block_h=bh, num_warps=nw, block_n=bn)
            try:
                # (plan_decode takes no block_h: plan through plan_mla_decode's knobs)
                rec = mla_variant_point(bench, view, tp, hq, b, n, kw)
                rec.update(baseline_ms=base, ratio=base / rec["time_ms"])
                bench.save(rec)
            except Exception as e:  # noqa: BLE001
                bench.save(dict(model="deepseek-v3", dtype=dtype, variant=kw, error=repr(e)[:300]))
        del view
        torch.cuda.empty_cache()


def mla_variant_point(bench, view, tp, hq, b, n, kw) -> dict:
    gen = torch.Generator().manual_seed(b * 7 + n)
    pt = page_table(b, n, 16, view.k.shape[0], gen, bench.dev)
    sl = torch.full((b,), n, dtype=torch.int32, device=bench.dev)
    q = torch.randn(b, hq, view.head_dim, device=bench.dev).to(torch.bfloat16)
    plan = attention.plan_mla_decode(view, hq, pt, sl, kv_lora_rank=RANK, max_seq_len=n, **kw)
    ms = bench.time_ms(lambda: attention.mla_decode(view, q, plan=plan, sm_scale=MLA_SCALE))
    kvb = b * n * bytes_per_token(view)
    return dict(
        model="deepseek-v3", tp=tp, dtype=view.dtype, page=16, B=b, L=n, q_heads=hq, kv_heads=0,
        head_dim=view.head_dim, time_ms=ms, kv_bytes=kvb, kv_TBps=kvb / ms / 1e9,
        kernel=plan.kernel, splits=plan.num_splits, variant=kw,
        tflops=2 * b * hq * n * (view.head_dim + RANK) / ms / 1e9,
    )  # fmt: skip


def finish(bench) -> list[dict]:
    with open(os.path.join(bench.out, "models.md"), "w") as f:
        f.write(table(bench.records))
    return bench.records


if __name__ == "__main__":
    main()
