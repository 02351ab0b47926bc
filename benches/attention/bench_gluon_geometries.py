"""The Gluon decode kernels at head_dim 64 / 256 and query groups up to 16 (issue 17), beside
the generic Triton kernel and SDPA on contiguous bf16, in one process (one device call).

For each model geometry (per rank, as ``bench_models.MODELS``; plus a 64/4 x 128 layer for
a query group of 16 and Llama-3.1-8B for the unchanged head_dim-128 path) and dtype at
B x L (default 64 x 8k), page 16: the default plan (``plan.kernel`` names the variant), the
generic kernel (``plan_decode(..., gluon=False)``), and SDPA (``enable_gqa``, no sinks,
window or soft-cap). Harness of ``bench_attention.py``: CUDA graphs, L2 flushed before each
of ``--reps`` replays, median. Each point also checks the default plan's output against the
generic kernel's (``rel_diff``: max |a - b| / max |b|) so that a wrong kernel cannot pass as a
fast one.

Prints one line per point and writes ``<out>/gluon_geometries.json`` (records as
``bench_models``: ``time_ms``, ``generic_ms``, ``baseline_ms``, ``ratio`` = SDPA / default,
``generic_ratio``, ``rel_diff``, ``kernel``, ``splits``) and ``gluon_geometries.md``.

    python benches/attention/bench_gluon_geometries.py --out DIR [--dtypes bf16,fp8_e4m3,nvfp4]
        [--models gpt-oss-120b,qwen3.5-27b] [--shapes 64x8192] [--warm 0/8]

``--warm i/N``: compile only (every N-th point from the i-th, one call each; no timing), to
fill Triton's cache from N processes in parallel before the timed run
(``run_gluon_geometries.sh``). ``KVPOOL_GLUON_WIDE=0`` makes the default plans generic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402
from kvpool import attention  # noqa: E402

MODELS = {
    name: bm.MODELS[name]
    for name in (
        "gpt-oss-120b",
        "gpt-oss-120b-sliding",
        "qwen3.5-27b",
        "qwen3.5-35b-a3b",
        "gemma-2-9b",
        "llama-3.1-8b",
    )
}
MODELS["group16-64x4x128"] = (1, 64, 4, 128, {})
MODELS["group16-32x2x64"] = (1, 32, 2, 64, {})
DTYPES = ("bf16", "fp8_e4m3", "nvfp4", "fp8_e5m2", "fp4_mx_block16")
TARGETS = {"bf16": 0.95, "fp8_e4m3": 1.6, "nvfp4": 2.0}


def point(bench, view, hq, opts, b, ctx, gluon):
    """(ms, plan, output) of one decode at B x ctx, page 16; ``gluon`` False: generic."""
    gen = torch.Generator().manual_seed(b * 7 + ctx)
    pt = bm.page_table(b, ctx, 16, view.k.shape[0], gen, "cuda")
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, view.head_dim, generator=gen).to("cuda", torch.bfloat16)
    kw = {} if gluon else {"gluon": False}
    plan = attention.plan_decode(view, hq, pt, sl, max_seq_len=ctx, **kw)
    call = dict(plan=plan, backend="triton")
    if opts.get("sinks"):
        call["sinks"] = torch.linspace(-2.0, 3.0, hq, device="cuda")
    call.update({k: opts[k] for k in ("window", "softcap") if k in opts})
    out = attention.decode(view, q, **call)
    ms = None if bench is None else bench.time_ms(lambda: attention.decode(view, q, **call))
    return ms, plan, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--shapes", default="64x8192")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--budget-s", type=float, default=220.0)
    ap.add_argument("--warm", default="", help="i/N: compile every N-th point only")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    warm = tuple(map(int, args.warm.split("/"))) if args.warm else None
    bench = None if warm else bm.Bench(args.out, max(args.reps, 25), False)
    records, t0, k = [], time.time(), -1
    for name in args.models.split(","):
        tp, hq, hk, d, opts = MODELS[name]
        rows = max(b * n for b, n in shapes) + 64
        base = {}
        for dtype in args.dtypes.split(","):
            k += 1
            if warm and k % warm[1] != warm[0]:
                continue
            if time.time() - t0 > args.budget_s:
                bm.log(f"budget of {args.budget_s} s spent: stopping")
                break
            view = bm.random_view(dtype, rows, hk, d, "cuda", False)
            view = dataclasses.replace(view, page_size=16)
            for b, n in shapes:
                rec = dict(model=name, dtype=dtype, B=b, L=n, q_heads=hq, kv_heads=hk,
                           head_dim=d, options=sorted(opts))  # fmt: skip
                try:
                    ms, plan, out = point(bench, view, hq, opts, b, n, True)
                    rec.update(kernel=plan.kernel, splits=plan.num_splits, time_ms=ms)
                    gms, gplan, gout = ms, plan, out
                    if plan.gluon:
                        gms, gplan, gout = point(bench, view, hq, opts, b, n, False)
                    den = gout.float().abs().max().clamp_min(1e-30)
                    rec.update(
                        generic_ms=gms,
                        generic_kernel=gplan.kernel,
                        rel_diff=((out.float() - gout.float()).abs().max() / den).item(),
                    )
                    if bench is not None:
                        if (b, n) not in base:
                            base[(b, n)] = bm.baseline_ms(bench, hq, hk, d, b, n, False)
                        rec["baseline_ms"] = base[(b, n)]
                        rec["ratio"] = base[(b, n)] / ms
                        rec["generic_ratio"] = base[(b, n)] / gms
                        rec["kv_TBps"] = b * n * bm.bytes_per_token(view) / ms / 1e9
                        want = TARGETS.get(dtype)
                        if want is not None and d != 128 and "window" not in opts:
                            rec["target"] = want
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    rec["error"] = repr(e)[:300]
                records.append(rec)
                bm.log(json.dumps(rec))
                if bench is not None:  # (as they come: a cut run keeps its points)
                    with open(os.path.join(args.out, "gluon_geometries.json"), "w") as f:
                        json.dump(records, f, indent=1)
            del view
            torch.cuda.empty_cache()
    if bench is None:
        return records
    with open(os.path.join(args.out, "gluon_geometries.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(args.out, "gluon_geometries.md"), "w") as f:
        f.write(table(records))
    print(table(records))
    return records


def table(records) -> str:
    rows = [
        "| model | heads q/kv x d | dtype | B x L | kernel | ms | generic ms | SDPA ms | ratio "
        "| generic ratio | target | rel diff |",
        "|" + "---|" * 12,
    ]
    for r in records:
        if "error" in r:
            rows.append(
                f"| {r['model']} | | {r['dtype']} | | error: {r['error'][:80]} |" + " |" * 7
            )
            continue
        t = r.get("target")
        mark = "" if t is None else (f"{t} {'met' if r['ratio'] >= t else 'missed'}")
        rows.append(
            f"| {r['model']} | {r['q_heads']}/{r['kv_heads']} x {r['head_dim']} | {r['dtype']} "
            f"| {r['B']} x {r['L']} | {r['kernel']} | {r['time_ms']:.4f} | "
            f"{r['generic_ms']:.4f} | {r['baseline_ms']:.4f} | {r['ratio']:.2f} | "
            f"{r['generic_ratio']:.2f} | {mark} | {r['rel_diff']:.1e} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
