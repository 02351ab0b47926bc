"""GPU benchmark of kvpool's fused paged attention (decode and extend) for every KV dtype.

Llama-3.1-8B geometry (32 query heads, 8 KV heads, head_dim 128), one layer call. Each fused
call is captured in a CUDA graph and replayed; the L2 is flushed (a 256 MiB buffer is zeroed)
before every repetition, outside the timed region; the median of ``--reps`` (>= 20) CUDA-event
timings is reported. In the same run: torch SDPA on a contiguous bf16 KV of the same shape
(``enable_gqa``), the unfused path (gather pages, dequantize with kvpool.formats, SDPA; eager,
no graph: it allocates), and the device copy bandwidth (bytes read + written / time).

Cache contents are random valid codes (no NaN/Inf), not zeros. Results are appended to
``<out>/attention.json`` after every point, so a run cut short keeps what it measured.

    python benches/attention/bench_attention.py --out DIR \\
        [--sections copy,key,variants,small,grid,extend]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from kvpool import attention, formats
from kvpool.pool import LayerView

HQ, HK, D = 32, 8, 128
DTYPES = formats.DTYPES
RESULTS: list[dict] = []
OUT = "."


def log(*a):
    print(*a, flush=True)


def save(rec):
    rec.setdefault("flush", FLUSH_MODE)
    RESULTS.append(rec)
    with open(os.path.join(OUT, "attention.json"), "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "triton": __import__("triton").__version__,
                "results": RESULTS,
            },
            f,
            indent=1,
        )


# ----------------------------------------------------------------------------- timing

_FLUSH = None
FLUSH_MODE = "write"


def flush_l2():
    """Evict the L2: ``write`` zeroes a 256 MiB buffer (leaves the L2 full of dirty lines that
    the timed kernel's first reads write back), ``read`` sums it (leaves clean lines)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    if FLUSH_MODE == "read":
        _FLUSH.view(torch.float32).sum()
    else:
        _FLUSH.zero_()


def time_ms(fn, reps, graph=True):
    """Median ms of ``fn`` over ``reps`` runs, L2 flushed before each."""
    fn()
    torch.cuda.synchronize()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        flush_l2()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2], ts


def copy_bandwidth(reps):
    n = 4 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms, _ = time_ms(lambda: y.copy_(x), reps, graph=False)
    return 2 * n / (ms * 1e-3)


# ----------------------------------------------------------------------------- caches


def bytes_per_token(dtype):
    """KV bytes per token per layer (K + V, data + block scales)."""
    vals = HK * D * 2
    if dtype in ("nvfp4", "fp4_mx_block16"):
        return vals // 2 + vals // 16
    return vals * {"fp32": 4, "bf16": 2, "fp16": 2}.get(dtype, 1)


def make_pool(dtype, rows):
    """One layer's buffers with random valid contents (moderate magnitudes)."""
    dev = "cuda"
    fp4 = dtype in ("nvfp4", "fp4_mx_block16")
    st = attention._STORAGE[dtype]
    kv = []
    for _ in range(2):
        if st in (torch.float32, torch.bfloat16, torch.float16):
            kv.append(torch.randn(rows, HK, D, dtype=st, device=dev))
        elif fp4:
            kv.append(torch.randint(0, 256, (rows, HK, D // 2), dtype=torch.uint8, device=dev))
        else:
            lo, hi = (0x28, 0x58) if dtype == "fp8_e4m3" else (0x30, 0x48)
            u = torch.randint(lo, hi, (rows, HK, D), dtype=torch.uint8, device=dev)
            u |= torch.randint(0, 2, (rows, HK, D), dtype=torch.uint8, device=dev) << 7
            kv.append(u.view(st))
    bs = [None, None]
    if dtype == "nvfp4":
        bs = [
            torch.randint(0x30, 0x40, (rows, HK, D // 16), dtype=torch.uint8, device=dev).view(
                torch.float8_e4m3fn
            )
            for _ in range(2)
        ]
    elif dtype == "fp4_mx_block16":
        bs = [
            torch.randint(124, 129, (rows, HK * D // 16), dtype=torch.uint8, device=dev)
            for _ in range(2)
        ]
    sc = None
    if dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4"):
        sc = [
            torch.tensor([0.05 if dtype != "nvfp4" else 0.3], device=dev),
            torch.tensor([0.04 if dtype != "nvfp4" else 0.2], device=dev),
        ]
    return LayerView(
        layer=0,
        dtype=dtype,
        page_size=16,
        num_kv_heads=HK,
        head_dim=D,
        v_head_dim=D,
        k=kv[0],
        v=kv[1],
        k_block_scale=bs[0],
        v_block_scale=bs[1],
        k_scale=None if sc is None else sc[0],
        v_scale=None if sc is None else sc[1],
    )


def with_page(view, page):
    return dataclasses.replace(view, page_size=page)


def page_table(b, ctx, page, rows, gen):
    n_pages = rows // page
    need = b * (ctx // page)
    ids = torch.randperm(n_pages - 1, generator=gen, device="cpu")[:need] + 1
    return ids.reshape(b, ctx // page).to(torch.int32).cuda()


# ----------------------------------------------------------------------------- points


def decode_case(view, b, ctx, page, **plan_kw):
    """``(view at page, q, plan, out)`` of one decode point: B requests of ``ctx`` tokens on
    shuffled pages (seeded by B and ctx), a bf16 query, the planner's plan (with overrides)."""
    gen = torch.Generator().manual_seed(b * 7 + ctx)
    pv = with_page(view, page)
    pt = page_table(b, ctx, page, view.k.shape[0], gen)
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(b, HQ, D, dtype=torch.bfloat16, device="cuda")
    plan = attention.plan_decode(pv, HQ, pt, sl, max_seq_len=ctx, **plan_kw)
    out = torch.empty(b, HQ, D, dtype=torch.bfloat16, device="cuda")
    return pv, q, plan, out


def bench_decode(view, b, ctx, page, reps, tag="fused", **plan_kw):
    pv, q, plan, out = decode_case(view, b, ctx, page, **plan_kw)
    ms, _ = time_ms(lambda: attention.decode(pv, q, plan=plan, out=out), reps)
    kvb = b * ctx * bytes_per_token(view.dtype)
    rec = {
        "kind": "decode",
        "impl": tag,
        "dtype": view.dtype,
        "page": page,
        "B": b,
        "ctx": ctx,
        "ms": ms,
        "kv_bytes": kvb,
        "kv_TBps": kvb / ms / 1e9,
        "splits": plan.num_splits,
        "block_n": plan.block_n,
        "warps": plan.num_warps,
        "stages": plan.num_stages,
        "use_dot": plan.use_dot,
        "prefetch": plan.prefetch,
        "asm": plan.asm,
        "swap": plan.swap,
        "group_pad": plan.group_pad,
        "maxnreg": plan.maxnreg,
        "ablate": plan.ablate,
        "gluon": plan.gluon,
        "variant_kw": plan_kw,
    }
    save(rec)
    return rec


def read_bytes_kernel_factory():
    """A bare read of a contiguous buffer: ``grid`` programs each sum a contiguous chunk of
    int32 words (16-byte loads, 8 warps) and store one value, so nothing is dead code."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(X, OUT, n, chunk, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.int32)
        start = pid * chunk
        for i in range(start, start + chunk, BLOCK):
            acc ^= tl.load(X + i + offs, mask=i + offs < n, other=0)
        tl.store(OUT + pid, tl.sum(acc, 0))

    return read_kernel


_READ_KERNEL = None


def bare_read_ms(nbytes, reps):
    """Median ms of the fastest bare read of ``nbytes`` (programs per SM 2, 4 or 8)."""
    global _READ_KERNEL
    if _READ_KERNEL is None:
        _READ_KERNEL = read_bytes_kernel_factory()
    n = nbytes // 4
    x = torch.ones(n, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = None
    block = 8 * 32 * 4  # int32 words: 8 warps x 16 bytes
    for per_sm in (2, 4, 8):
        grid = sms * per_sm
        chunk = attention._cdiv(attention._cdiv(n, grid), block) * block
        out = torch.empty(grid, dtype=torch.int32, device="cuda")
        ms = time_ms(
            lambda g=grid, c=chunk, o=out: _READ_KERNEL[(g,)](x, o, n, c, BLOCK=block, num_warps=8),
            reps,
        )[0]
        best = ms if best is None else min(best, ms)
    return best


def bench_small_parts(view, b, ctx, page, reps):
    """Where a small batch's decode time goes, all through the same harness (graph, L2 flush):
    the default plan with the merge launched as a programmatic dependent (PDL) and as a plain
    launch, the split kernel alone (merge left out), the merge alone, and a bare read of the
    same KV bytes: ``torch.sum`` over a contiguous buffer, a copy, and a bare read kernel
    (:func:`bare_read_ms`)."""
    import dataclasses

    pv, q, plan, out = decode_case(view, b, ctx, page)
    kvb = b * ctx * bytes_per_token(view.dtype)
    _, _, has_scale, fp4_mul = attention._KERNEL_FORMAT[view.dtype]
    _, _, _, vsc = attention._scale_args(pv)
    parts = {}

    def full():
        attention.decode(pv, q, plan=plan, out=out)

    try:
        for rnd in ("", "_2"):  # twice, alternating (a pool's first timing can be an outlier)
            attention.launch_decode._MERGE_PDL = True
            parts["full_pdl" + rnd] = time_ms(full, reps)[0]
            attention.launch_decode._MERGE_PDL = False
            parts["full_plain" + rnd] = time_ms(full, reps)[0]
    finally:
        attention.launch_decode._MERGE_PDL = True
    if plan.num_splits > 1:
        split_only = dataclasses.replace(plan, ablate=4)
        parts["split_kernel"] = time_ms(
            lambda: attention.decode(pv, q, plan=split_only, out=out), reps
        )[0]
        parts["merge"] = time_ms(
            lambda: attention._merge(plan, out, None, vsc, has_scale, fp4_mul), reps
        )[0]
    x = torch.ones(kvb // 4, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    parts["sum_same_bytes"] = time_ms(x.sum, reps)[0]
    parts["copy_same_bytes"] = time_ms(lambda: y.copy_(x), reps)[0]
    parts["read_same_bytes"] = bare_read_ms(kvb, reps)
    rec = {
        "kind": "decode_parts",
        "dtype": view.dtype,
        "page": page,
        "B": b,
        "ctx": ctx,
        "kv_bytes": kvb,
        "splits": plan.num_splits,
        "block_n": plan.block_n,
        "gluon": plan.gluon,
        "ms": parts,
    }
    save(rec)
    return rec


def bench_sdpa(b, ctx, reps):
    q = torch.randn(b, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, HK, ctx, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(b, HK, ctx, D, dtype=torch.bfloat16, device="cuda")
    ms, _ = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), reps)
    kvb = b * ctx * bytes_per_token("bf16")
    rec = {
        "kind": "decode",
        "impl": "sdpa_bf16_contiguous",
        "dtype": "bf16",
        "B": b,
        "ctx": ctx,
        "ms": ms,
        "kv_bytes": kvb,
        "kv_TBps": kvb / ms / 1e9,
    }
    save(rec)
    return rec


def bench_unfused(view, b, ctx, page, reps):
    """Gather the request's pages, dequantize (kvpool.formats), SDPA: what a non-fused stack does."""  # noqa: E501
    gen = torch.Generator().manual_seed(b * 7 + ctx)
    pt = page_table(b, ctx, page, view.k.shape[0], gen)
    pos = torch.arange(ctx, device="cuda")
    slots = (pt[:, pos // page].long() * page + pos % page).reshape(-1)
    q = torch.randn(b, HQ, 1, D, dtype=torch.bfloat16, device="cuda")

    def deq(data, bs, sc):
        x = data[slots]
        bb = None if bs is None else bs[slots].reshape(len(slots), HK, -1)
        s = sc.reshape(()) if sc is not None else 1.0
        return formats.dequantize(x, bb, view.dtype, scale=s, out_dtype=torch.bfloat16)

    def run():
        k = deq(view.k, view.k_block_scale, view.k_scale).reshape(b, ctx, HK, D).transpose(1, 2)
        v = deq(view.v, view.v_block_scale, view.v_scale).reshape(b, ctx, HK, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    ms, _ = time_ms(run, max(5, reps // 4), graph=False)
    kvb = b * ctx * bytes_per_token(view.dtype)
    rec = {
        "kind": "decode",
        "impl": "unfused",
        "dtype": view.dtype,
        "page": page,
        "B": b,
        "ctx": ctx,
        "ms": ms,
        "kv_bytes": kvb,
        "kv_TBps": kvb / ms / 1e9,
    }
    save(rec)
    return rec


def extend_flops(b, prefix, new):
    keys = new * prefix + new * (new + 1) // 2
    return 4 * b * HQ * D * keys


def bench_extend(view, b, prefix, new, page, reps, **plan_kw):
    gen = torch.Generator().manual_seed(3)
    ctx = prefix + new
    pv = with_page(view, page)
    pt = page_table(b, ctx, page, view.k.shape[0], gen)
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, (b + 1) * new, new, dtype=torch.int32, device="cuda")
    q = torch.randn(b * new, HQ, D, dtype=torch.bfloat16, device="cuda")
    plan = attention.plan_extend(pv, HQ, cu, pt, sl, **plan_kw)
    out = torch.empty(b * new, HQ, D, dtype=torch.bfloat16, device="cuda")
    ms, _ = time_ms(lambda: attention.extend(pv, q, plan=plan, out=out), reps)
    fl = extend_flops(b, prefix, new)
    rec = {
        "kind": "extend",
        "impl": "fused",
        "dtype": view.dtype,
        "page": page,
        "B": b,
        "prefix": prefix,
        "new": new,
        "ms": ms,
        "flops": fl,
        "TFLOPs": fl / ms / 1e9,
        "block_t": plan.block_t,
        "block_n": plan.block_n,
        "warps": plan.num_warps,
        "stages": plan.num_stages,
        "asm": plan.asm,
    }
    save(rec)
    return rec


def bench_extend_sdpa(b, prefix, new, reps):
    from torch.nn.attention.bias import causal_lower_right

    ctx = prefix + new
    q = torch.randn(b, HQ, new, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, HK, ctx, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(b, HK, ctx, D, dtype=torch.bfloat16, device="cuda")
    mask = causal_lower_right(new, ctx)
    impl = "sdpa_bf16_contiguous"
    try:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
        fn()
    except Exception:  # older torch: no GQA with a causal bias; expand the KV heads instead
        ke = k.repeat_interleave(HQ // HK, 1)
        ve = v.repeat_interleave(HQ // HK, 1)
        fn = lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)  # noqa: E731
        impl = "sdpa_bf16_contiguous_expanded"
    ms, _ = time_ms(fn, reps)
    fl = extend_flops(b, prefix, new)
    rec = {
        "kind": "extend",
        "impl": impl,
        "dtype": "bf16",
        "B": b,
        "prefix": prefix,
        "new": new,
        "ms": ms,
        "flops": fl,
        "TFLOPs": fl / ms / 1e9,
    }
    save(rec)
    return rec


# ----------------------------------------------------------------------------- sections


def guarded(fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as e:  # keep going: one failing point must not lose the others
        args = a[1:] if a and isinstance(a[0], LayerView) else a
        log(f"  FAILED {fn.__name__} {args} {k}: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(limit=2)
        save(
            {
                "kind": "error",
                "fn": fn.__name__,
                "args": repr(args)[:200],
                "kw": repr(k),
                "error": f"{type(e).__name__}: {str(e)[:500]}",
            }
        )
        return None


def fmt(r):
    if r is None:
        return "failed"
    extra = f" {r['kv_TBps']:.2f} TB/s" if "kv_TBps" in r else f" {r.get('TFLOPs', 0):.0f} TFLOP/s"
    return f"{r['ms']:.4f} ms{extra}"


def warm_configs(args, dtypes, dflt):
    """Every (kind, dtype, B, ctx-or-prefix, page, plan kwargs) the timed run will launch."""
    sections = args.sections.split(",")
    out = []
    for dtype in dtypes:
        if "key" in sections:
            for b, ctx in ((64, 8192), (1, 32768)):
                for page in (16, 64):
                    out.append(("decode", dtype, b, ctx, page, dflt))
        if "variants" in sections and args.variants:
            for kw in json.loads(args.variants):
                kw = dict(kw)
                only = kw.pop("dtypes", None)
                bc = kw.pop("at", [64, 8192])
                if not only or dtype in only:
                    out.append(("decode", dtype, bc[0], bc[1], 16, kw))
        if "extend" in sections:
            for cfg in json.loads(args.extend_configs):
                out.append(("extend", dtype, 16, 4096, 16, cfg))
        if "grid" in sections:
            for cfg in json.loads(args.grid_configs):
                for page in (16, 64):
                    for b in (1, 16, 64, 128):
                        for ctx in (1024, 8192, 32768):
                            out.append(("decode", dtype, b, ctx, page, {**dflt, **cfg}))
    return out


def warm(args, dtypes, dflt, shard, nshards):
    """Compile (fill Triton's disk cache) for a shard of the configs with tiny inputs whose
    integer arguments specialize like the real ones (same strides, page-table width, splits)."""
    seen = set()
    views = {}
    for i, (kind, dtype, b, ctx, page, kw) in enumerate(warm_configs(args, dtypes, dflt)):
        if i % nshards != shard:
            continue
        if dtype not in views:
            views[dtype] = make_pool(dtype, 4096)
        pv = with_page(views[dtype], page)
        try:
            if kind == "decode":
                kw = dict(kw)
                if "num_splits" not in kw:  # the timed run's split count (it specializes)
                    kw["num_splits"] = attention.plan_decode(
                        pv,
                        HQ,
                        torch.ones(b, ctx // page, dtype=torch.int32, device="cuda"),
                        torch.full((b,), ctx, dtype=torch.int32, device="cuda"),
                        max_seq_len=ctx,
                        **kw,
                    ).num_splits
                key = (
                    dtype,
                    kw["num_splits"] == 1,
                    kw["num_splits"] % 16 == 0,
                    page == 1,
                    json.dumps(kw, sort_keys=True),
                )
                if key in seen:
                    continue
                seen.add(key)
                pt = torch.ones(1, ctx // page, dtype=torch.int32, device="cuda")
                sl = torch.full((1,), 64, dtype=torch.int32, device="cuda")
                q = torch.randn(1, HQ, D, dtype=torch.bfloat16, device="cuda")
                plan = attention.plan_decode(pv, HQ, pt, sl, **kw)
                attention.decode(pv, q, plan=plan)
            else:
                new = 512
                pt = torch.ones(1, (ctx + new) // page, dtype=torch.int32, device="cuda")
                sl = torch.full((1,), 64, dtype=torch.int32, device="cuda")
                cu = torch.tensor([0, 32], dtype=torch.int32, device="cuda")
                q = torch.randn(32, HQ, D, dtype=torch.bfloat16, device="cuda")
                plan = attention.plan_extend(pv, HQ, cu, pt, sl, **kw)
                attention.extend(pv, q, plan=plan)
        except Exception as e:
            log(f"warm {kind} {dtype} {kw}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()


def main():
    global OUT, FLUSH_MODE
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--sections", default="copy,key,variants,extend,grid")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--variants", default="")
    ap.add_argument("--default", default="", help="JSON plan overrides for every fused decode")
    ap.add_argument("--extend-configs", default="[{}]", help="JSON list of extend plan overrides")
    ap.add_argument(
        "--grid-configs", default="[{}]", help="JSON list of plan overrides; the grid runs each"
    )
    ap.add_argument("--warm", default="", help="i/N: only compile shard i of N (no timing)")
    ap.add_argument("--flush", default="write", choices=["write", "read"], help="L2 flush mode")
    args = ap.parse_args()
    FLUSH_MODE = args.flush
    if args.warm:
        i, n = map(int, args.warm.split("/"))
        warm(args, args.dtypes.split(","), json.loads(args.default) if args.default else {}, i, n)
        return 0
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    reps = args.reps
    sections = args.sections.split(",")
    dtypes = args.dtypes.split(",")
    dflt = json.loads(args.default) if args.default else {}
    t0 = time.time()
    log(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__)

    if "copy" in sections:
        bw = copy_bandwidth(reps)
        save({"kind": "copy", "Bps": bw})
        log(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
        # the timing floor: one tiny kernel through the same harness (graph, flush, events)
        tiny = torch.empty(256, dtype=torch.float32, device="cuda")
        ms, _ = time_ms(tiny.zero_, reps)
        save({"kind": "floor", "ms": ms})
        log(f"timing floor (one tiny kernel) {ms * 1e3:.1f} us")

    rows_key = 64 * 8192 + 64
    if "key" in sections or "variants" in sections:
        sd = {}
        for b, ctx in ((64, 8192), (1, 32768)):
            sd[(b, ctx)] = guarded(bench_sdpa, b, ctx, reps)
            log(f"sdpa B={b} ctx={ctx}: {fmt(sd[(b, ctx)])}")
        for dtype in dtypes:
            view = make_pool(dtype, rows_key)
            if "key" in sections:
                for b, ctx in ((64, 8192), (1, 32768)):
                    for page in (16, 64):
                        r = guarded(bench_decode, view, b, ctx, page, reps, **dflt)
                        ratio = sd[(b, ctx)]["ms"] / r["ms"] if r and sd[(b, ctx)] else float("nan")
                        log(
                            f"{dtype:15s} B={b:3d} ctx={ctx:6d} p={page:2d}: {fmt(r)}  x{ratio:.2f} vs sdpa"  # noqa: E501
                        )
                    u = guarded(bench_unfused, view, b, ctx, 16, reps)
                    log(f"{dtype:15s} B={b:3d} ctx={ctx:6d} unfused: {fmt(u)}")
            if "variants" in sections and args.variants:
                for kw in json.loads(args.variants):
                    kw = dict(kw)
                    only = kw.pop("dtypes", None)
                    bc = kw.pop("at", [64, 8192])
                    if only and dtype not in only:
                        continue
                    r = guarded(bench_decode, view, bc[0], bc[1], 16, reps, tag="variant", **kw)
                    log(f"{dtype:15s} B={bc[0]} ctx={bc[1]} variant {kw}: {fmt(r)}")
            del view
            torch.cuda.empty_cache()
        log(f"[{time.time() - t0:.0f}s]")

    if "small" in sections:
        for b, ctx in ((1, 32768), (1, 8192), (4, 32768)):
            sd = guarded(bench_sdpa, b, ctx, reps)
            log(f"sdpa B={b} ctx={ctx}: {fmt(sd)}")
            for dtype in dtypes:
                view = make_pool(dtype, b * ctx + 64)
                r = guarded(bench_small_parts, view, b, ctx, 16, reps)
                if r:
                    log(
                        f"parts {dtype:15s} B={b} ctx={ctx} splits={r['splits']}: "
                        + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["ms"].items())
                        + " us"
                    )
                del view
                torch.cuda.empty_cache()
        log(f"[{time.time() - t0:.0f}s]")

    if "extend" in sections:
        b, prefix, new = 16, 4096, 512
        s = guarded(bench_extend_sdpa, b, prefix, new, reps)
        log(f"extend sdpa: {fmt(s)}")
        for dtype in dtypes:
            view = make_pool(dtype, b * (prefix + new) + 64 * 4)
            for cfg in json.loads(args.extend_configs):
                r = guarded(bench_extend, view, b, prefix, new, 16, reps, **cfg)
                ratio = s["ms"] / r["ms"] if r and s else float("nan")
                log(f"extend {dtype:15s} {cfg}: {fmt(r)}  x{ratio:.2f} vs sdpa")
            del view
            torch.cuda.empty_cache()
        log(f"[{time.time() - t0:.0f}s]")

    if "grid" in sections:
        bs, ctxs = (1, 16, 64, 128), (1024, 8192, 32768)
        for b in bs:
            for ctx in ctxs:
                guarded(bench_sdpa, b, ctx, reps)
        for dtype in dtypes:
            view = make_pool(dtype, 128 * 32768 + 64)
            for ci, cfg in enumerate(json.loads(args.grid_configs)):
                for page in (16, 64):
                    for b in bs:
                        for ctx in ctxs:
                            guarded(
                                bench_decode,
                                view,
                                b,
                                ctx,
                                page,
                                reps,
                                tag=f"grid{ci}",
                                **{**dflt, **cfg},
                            )
                g = [
                    r
                    for r in RESULTS
                    if r.get("impl") == f"grid{ci}"
                    and r["dtype"] == dtype
                    and r["B"] == 64
                    and r["ctx"] == 8192
                ]
                log(
                    f"grid {dtype} cfg {cfg}: B=64/8k "
                    + ", ".join(f"p{r['page']} {r['ms']:.4f} ms" for r in g)
                    + f" [{time.time() - t0:.0f}s]"
                )
            del view
            torch.cuda.empty_cache()
    log(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
