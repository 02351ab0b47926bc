"""Sweep of the MLA decode kernel's variants (issue 17): ``dots`` (f16 / fp8), tiles, warps,
stages and splits, at DeepSeek-V3's latent (512 + 64) with 128 heads (TP 1) and 16 (TP 8).

Points: B=64 x 8k (``--shape``), page 16 (then page 64 for each (TP, dtype)'s default, fp8-dots
default and best variant), dtypes bf16 / fp8_e4m3 / fp8_e5m2. Each call (plan made outside) is
captured in a CUDA graph and replayed, the L2 flushed before every repetition (outside the
timed region), the median of ``--reps`` CUDA-event timings kept (``bench_attention.time_ms``,
through ``bench_models.Bench``). Variants run in priority order (the planner's default and the
fp8-dots default of every (TP, dtype) first) until ``--budget-s`` is spent; the rest are
recorded as skipped. A compile happens in a variant's first call (``first_call_s``).

Correctness, per variant: the same plan knobs (split count included) on a small batch of the
same cache (4 requests of 1, 333, 4099 and 8192 tokens) against the torch reference
(``reference_mla_decode``: dequantized latent, fp32): ``err`` = max abs error / max |ref|.
For ``dots="fp8"`` also ``err_q8``: against the reference run on q rounded to e4m3 as the
kernel does (per (request, head) scale amax / 448), i.e. P's rounding and the tensor cores'
sums alone (``kvpool.attention.mla_dots`` on both).

Printed: one line per point (ms, TFLOP/s = 2 B L H (576 + 512) / t, latent GB/s = the cache
bytes read / t, errors), then a table and the best variant per (TP, dtype, page). Written:
``<out>/sweep_mla.json`` after every point (a cut run keeps what it measured).

    PYTHONPATH=$PWD/python:$PWD/benches/attention \\
        python3 benches/attention/sweep_mla.py --out $OUT --budget-s 240
    ... --quick   # CPU smoke test at tiny sizes (TRITON_INTERPRET=1 runs the kernels)
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
import bench_models as bm  # noqa: E402  (the harness: Bench, random caches, page tables)
from kvpool import attention  # noqa: E402
from kvpool.pool import LayerView  # noqa: E402

RANK, ROPE = 512, 64
TPS = {1: 128, 8: 16}  # TP size -> DeepSeek-V3's query heads per rank
DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2")
CHECK_LENS = (1, 333, 4099, 8192)

# (label, plan knobs, which caches, which TP sizes), in priority order within a tier
HEADLINE = [
    ("default", {}, "all", (1, 8)),
    ("fp8dots", {"dots": "fp8"}, "fp8", (1, 8)),
]
VARIANTS = [
    # fp8 dots: tiles and stages (128 heads, and 16 heads in 64-row blocks)
    ("fp8 h64 n32 w8 s2", dict(dots="fp8", block_n=32), "fp8", (1, 8)),
    ("fp8 h64 n64 w8 s3", dict(dots="fp8", num_stages=3), "fp8", (1, 8)),
    # 128 heads: the 16-bit path's tiles and stages
    ("f16 h64 n32 w8 s2", dict(block_h=64, block_n=32, num_warps=8, num_stages=2), "all", (1,)),
    ("f16 h64 n64 w8 s3", dict(block_h=64, block_n=64, num_warps=8, num_stages=3), "all", (1,)),
    ("fp8 h64 n32 w8 s3", dict(dots="fp8", block_n=32, num_stages=3), "fp8", (1, 8)),
    ("f16 h64 n32 w8 s3", dict(block_h=64, block_n=32, num_warps=8, num_stages=3), "all", (1,)),
    # split counts (the default's, x2, and none)
    ("fp8 splits x2", dict(dots="fp8", splits_x=2), "fp8", (1, 8)),
    ("f16 splits x2", dict(splits_x=2), "all", (1, 8)),
    ("fp8 splits 1", dict(dots="fp8", num_splits=1), "fp8", (1, 8)),
    ("f16 splits 1", dict(num_splits=1), "all", (1, 8)),
    # the fp8 caches' 16-bit path without the word decode
    ("f16 asm off", dict(asm=False), "fp8", (1, 8)),
    # 16 heads: the 16-bit path's tiles (64-row blocks: the same kernel as 128 heads' default)
    ("f16 h16 n64 w4 s2", dict(block_h=16, block_n=64, num_warps=4, num_stages=2), "all", (8,)),
    ("f16 h16 n32 w4 s3", dict(block_h=16, block_n=32, num_warps=4, num_stages=3), "all", (8,)),
    ("f16 h64 n64 w8 s2", dict(block_h=64, block_n=64, num_warps=8, num_stages=2), "all", (8,)),
    # more stages, and 32-head blocks (no wgmma below 64 rows)
    ("fp8 h64 n64 w8 s4", dict(dots="fp8", num_stages=4), "fp8", (1,)),
    ("f16 h64 n32 w8 s4", dict(block_h=64, block_n=32, num_warps=8, num_stages=4), "all", (1,)),
    ("f16 h32 n32 w4 s3", dict(block_h=32, block_n=32, num_warps=4, num_stages=3), "all", (1, 8)),
]
QUICK_KNOBS = {"block_n": 32}  # (tiny latents: tiles of 32 tokens)


def log(*a):
    print(*a, flush=True)


class Sweep:
    def __init__(self, args):
        self.args, self.quick = args, args.quick
        self.bench = bm.Bench(args.out, 3 if args.quick else args.reps, args.quick)
        self.dev = self.bench.dev
        self.t0 = time.time()
        self.records: list[dict] = []
        b, n = (2, 128) if args.quick else map(int, args.shape.split("x"))
        self.b, self.n = b, n
        self.rank = 32 if args.quick else RANK
        self.d = self.rank + (32 if args.quick else ROPE)
        self.views: dict[str, LayerView] = {}
        self.refs: dict[tuple, tuple] = {}

    def over(self) -> bool:
        return time.time() - self.t0 > self.args.budget_s

    def save(self, rec: dict) -> None:
        self.records.append(rec)
        meta = {"torch": torch.__version__, "triton": __import__("triton").__version__}
        if not self.quick:
            meta["device"] = torch.cuda.get_device_name()
        with open(os.path.join(self.args.out, "sweep_mla.json"), "w") as f:
            json.dump({**meta, "shape": [self.b, self.n], "records": self.records}, f, indent=1)

    def view(self, dtype: str, page: int) -> LayerView:
        if dtype not in self.views:
            rows = max(self.b * self.n, sum(CHECK_LENS) + 64 * len(CHECK_LENS)) + 128
            self.views[dtype] = bm.random_view(dtype, rows, 0, self.d, self.dev, True)
        return dataclasses.replace(self.views[dtype], page_size=page)

    # ------------------------------------------------------------------------- one point

    def plan(self, view, heads, pt, sl, ctx, knobs):
        kw = dict(knobs)
        if self.quick:
            kw = {**QUICK_KNOBS, **{k: v for k, v in kw.items() if k == "dots"}}
        mult = kw.pop("splits_x", None)
        p = attention.plan_mla_decode(
            view, heads, pt, sl, kv_lora_rank=self.rank, max_seq_len=ctx, **kw
        )
        if mult:  # the default split count times mult
            kw["num_splits"] = min(p.num_splits * mult, attention.MAX_SPLITS)
            p = attention.plan_mla_decode(
                view, heads, pt, sl, kv_lora_rank=self.rank, max_seq_len=ctx, **kw
            )
        return p

    def point(self, tp, dtype, page, label, knobs) -> dict:
        heads = TPS[tp] // (8 if self.quick else 1)
        view = self.view(dtype, page)
        gen = torch.Generator().manual_seed(7 * page + tp)
        pt = bm.page_table(self.b, self.n, page, view.k.shape[0], gen, self.dev)
        sl = torch.full((self.b,), self.n, dtype=torch.int32, device=self.dev)
        q = torch.randn(self.b, heads, self.d, device=self.dev).to(torch.bfloat16)
        p = self.plan(view, heads, pt, sl, self.n, knobs)
        rec = dict(
            tp=tp, heads=heads, dtype=dtype, page=page, B=self.b, L=self.n, variant=label,
            knobs=knobs, block_h=p.block_h, block_n=p.block_n, num_warps=p.num_warps,
            num_stages=p.num_stages, num_splits=p.num_splits, dots=p.dots, asm=p.asm,
            kernel=p.kernel,
        )  # fmt: skip
        backend = (
            "triton" if not self.quick or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
        )

        def call():
            return attention.mla_decode(view, q, plan=p, sm_scale=bm.MLA_SCALE, backend=backend)

        t = time.time()
        call()
        if not self.quick:
            torch.cuda.synchronize()
        rec["first_call_s"] = round(time.time() - t, 2)
        ms = self.bench.time_ms(call)
        kv_bytes = self.b * self.n * bm.bytes_per_token(view)
        rec.update(
            time_ms=ms,
            tflops=2 * self.b * self.n * heads * (self.d + self.rank) / ms / 1e9,
            latent_GBps=kv_bytes / ms / 1e6,
        )
        rec.update(self.check(view, heads, p, tp, dtype, page, backend))
        return rec

    def check(self, view, heads, p, tp, dtype, page, backend) -> dict:
        """The plan's knobs on the small batch against the torch reference (module doc)."""
        lens = (1, 40, 77) if self.quick else CHECK_LENS
        key = (tp, dtype, page)
        if key not in self.refs:
            gen = torch.Generator().manual_seed(11 + page)
            pages = [-(-n // page) for n in lens]
            ids = torch.randperm(view.k.shape[0] // page - 1, generator=gen)[: sum(pages)] + 1
            pt = torch.zeros(len(lens), max(pages), dtype=torch.int32)
            for i, c in enumerate(torch.tensor(pages).cumsum(0).tolist()):
                pt[i, : pages[i]] = ids[c - pages[i] : c]
            pt, sl = pt.to(self.dev), torch.tensor(lens, dtype=torch.int32, device=self.dev)
            q = torch.randn(len(lens), heads, self.d, generator=gen).to(torch.bfloat16)
            q = q.to(self.dev)
            kw = dict(sm_scale=bm.MLA_SCALE, kv_lora_rank=self.rank)
            ref = attention.reference_mla_decode(view, q, pt, sl, **kw)
            ref8 = None
            if dtype.startswith("fp8"):  # q rounded as the fp8-dots kernel rounds it
                qf = q.float()
                amax = qf.abs().amax(-1, keepdim=True)
                sq = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
                q8 = ((qf / sq).to(torch.float8_e4m3fn).float() * sq).to(self.dev)
                ref8 = attention.reference_mla_decode(view, q8, pt, sl, **kw)
            self.refs[key] = (pt, sl, q, ref, ref8)
        pt, sl, q, ref, ref8 = self.refs[key]
        small = attention.plan_mla_decode(
            view, heads, pt, sl, kv_lora_rank=self.rank, num_splits=p.num_splits,
            block_h=p.block_h, block_n=p.block_n, num_warps=p.num_warps,
            num_stages=p.num_stages, asm=p.asm, dots=p.dots,
        )  # fmt: skip
        out = attention.mla_decode(
            view, q, plan=small, sm_scale=bm.MLA_SCALE, backend=backend
        ).float()
        res = {"err": ((out - ref).abs().max() / ref.abs().max()).item()}
        if ref8 is not None and p.dots == "fp8":
            res["err_q8"] = ((out - ref8).abs().max() / ref8.abs().max()).item()
        return res

    # ------------------------------------------------------------------------- the sweep

    def run_list(self, items) -> None:
        for tp, dtype, page, label, knobs in items:
            if self.over():
                self.save(dict(tp=tp, dtype=dtype, page=page, variant=label, knobs=knobs,
                               skipped="budget"))  # fmt: skip
                continue
            try:
                rec = self.point(tp, dtype, page, label, knobs)
                log(line(rec))
            except Exception as e:  # noqa: BLE001  (record, go on)
                traceback.print_exc()
                rec = dict(tp=tp, dtype=dtype, page=page, variant=label, knobs=knobs,
                           error=repr(e)[:400])  # fmt: skip
                log(f"tp{tp} {dtype} p{page} {label}: ERROR {rec['error'][:200]}")
            self.save(rec)

    def items(self, table, page):
        out = []
        for label, knobs, caches, tps in table:
            for tp in self.args.tps:
                for dtype in self.args.dtypes:
                    if tp in tps and (caches == "all" or dtype.startswith("fp8")):
                        out.append((tp, dtype, page, label, knobs))
        return out

    def best(self, tp, dtype, page):
        ok = [r for r in self.records if "time_ms" in r and (r["tp"], r["dtype"], r["page"])
              == (tp, dtype, page)]  # fmt: skip
        return min(ok, key=lambda r: r["time_ms"]) if ok else None

    def validate(self) -> None:
        """Quick mode: every variant's plan at DeepSeek's geometry (a small CPU cache; no kernel
        runs), so a knob the planner refuses shows before a GPU run."""
        for tp, dtype, _, label, knobs in self.items(HEADLINE + VARIANTS, 16):
            view = bm.random_view(dtype, 4096, 0, RANK + ROPE, "cpu", True)
            pt = torch.ones(64, 512, dtype=torch.int32)
            sl = torch.full((64,), 8192, dtype=torch.int32)
            kw = {k: v for k, v in knobs.items() if k != "splits_x"}
            p = attention.plan_mla_decode(view, TPS[tp], pt, sl, kv_lora_rank=RANK, **kw)
            log(f"plan ok: tp{tp} {dtype} {label}: h{p.block_h} n{p.block_n} w{p.num_warps} "
                f"s{p.num_stages} x{p.num_splits} {p.dots}")  # fmt: skip

    def run(self) -> None:
        p0, rest = self.args.pages[0], self.args.pages[1:]
        if self.quick:
            self.validate()
        self.run_list(self.items(HEADLINE, p0))
        self.run_list(self.items([] if self.quick else VARIANTS, p0))
        for page in rest:  # the headline points and each (TP, dtype)'s best variant
            items = self.items(HEADLINE, page)
            for tp in self.args.tps:
                for dtype in self.args.dtypes:
                    b = self.best(tp, dtype, p0)
                    if b and b["variant"] not in ("default", "fp8dots"):
                        items.append((tp, dtype, page, b["variant"], b["knobs"]))
            self.run_list(items)


def line(r: dict) -> str:
    e = f"err {r['err']:.2e}" + (f" err_q8 {r['err_q8']:.2e}" if "err_q8" in r else "")
    return (
        f"tp{r['tp']} {r['dtype']:9s} p{r['page']:<2d} {r['variant']:18s} "
        f"h{r['block_h']} n{r['block_n']} w{r['num_warps']} s{r['num_stages']} "
        f"x{r['num_splits']} {r['dots']:3s} | {r['time_ms']:.4f} ms {r['tflops']:6.1f} TFLOP/s "
        f"{r['latent_GBps']:7.1f} GB/s | {e} | first call {r['first_call_s']} s"
    )


def summary(records) -> str:
    ok = [r for r in records if "time_ms" in r]
    rows = ["| tp | dtype | page | variant | h/n/w/s/splits | dots | ms | TFLOP/s | GB/s | err |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in ok:
        rows.append(
            f"| {r['tp']} | {r['dtype']} | {r['page']} | {r['variant']} | {r['block_h']}/"
            f"{r['block_n']}/{r['num_warps']}/{r['num_stages']}/{r['num_splits']} | {r['dots']} "
            f"| {r['time_ms']:.4f} | {r['tflops']:.0f} | {r['latent_GBps']:.0f} | "
            f"{r['err']:.1e}{' / ' + format(r['err_q8'], '.1e') if 'err_q8' in r else ''} |"
        )
    best = {}
    for r in ok:
        k = (r["tp"], r["dtype"], r["page"])
        if k not in best or r["time_ms"] < best[k]["time_ms"]:
            best[k] = r
    rows.append("\nbest per (tp, dtype, page):")
    for (tp, dt, pg), r in sorted(best.items()):
        d = next((x for x in ok if (x["tp"], x["dtype"], x["page"], x["variant"])
                  == (tp, dt, pg, "default")), None)  # fmt: skip
        vs = f" (default {d['time_ms']:.4f} ms: {d['time_ms'] / r['time_ms']:.2f}x)" if d else ""
        rows.append(f"  tp{tp} {dt} p{pg}: {r['variant']} {r['time_ms']:.4f} ms "
                    f"{r['tflops']:.0f} TFLOP/s{vs}")  # fmt: skip
    skipped = sum("skipped" in r for r in records)
    errors = sum("error" in r for r in records)
    rows.append(f"{len(ok)} points, {skipped} skipped (budget), {errors} errors")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting points after")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--shape", default="64x8192", help="B x L of the timed points")
    ap.add_argument("--tps", default="1,8", help="TP sizes: 1 (128 heads), 8 (16 heads)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--pages", default="16,64", help="the first gets every variant")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run at tiny sizes")
    args = ap.parse_args(argv)
    args.tps = [int(x) for x in args.tps.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.pages = [int(x) for x in args.pages.split(",")]
    os.makedirs(args.out, exist_ok=True)
    s = Sweep(args)
    if not args.quick:
        log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {__import__('triton').__version__}, B x L = {s.b} x {s.n}")  # fmt: skip
    s.run()
    log(summary(s.records))
    log(f"wall {time.time() - s.t0:.0f} s; {os.path.join(args.out, 'sweep_mla.json')}")
    return s.records


if __name__ == "__main__":
    main()
