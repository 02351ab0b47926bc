"""Sweep of the Gluon MLA decode kernel (``kernel="mla_gluon"``, issue 17) beside the Triton
head-block kernel (``mla_triton``, the default at 128 heads) at DeepSeek-V3 TP 1: the latent
512 + 64, 128 query heads, B=64 x 8k (``--shape``), pages 16 then 64, bf16, fp8_e4m3 and fp16
caches (``--dtypes``; fp8_e5m2 may be added).

Variants, in priority order until ``--budget-s`` is spent (the rest recorded as skipped):
first the Triton default, then the Gluon default (64-token tiles, 2 stages), then the pipelined
Gluon loop (``pipeline``: tile i's scores under tile i - 1's P V; 32-token tiles, 3 stages),
each on pages 16 and 64 for every dtype; then the others on page 16 (32-token tiles at 2 / 3 /
4 stages, pipelined or not; fp8 at 6; split counts 1, the default's x2, x4; the Triton kernel
at x2 splits); then each dtype's best of page 16 on page 64. A variant that fails to compile or run
is recorded with its error and the sweep goes on. Each call (plan made outside) is captured in
a CUDA graph and replayed, the L2 flushed before every repetition, the median of ``--reps``
CUDA-event timings kept (``bench_attention.time_ms`` through ``bench_models.Bench``);
``first_call_s`` includes the compile.

Correctness per variant: the same knobs (split count included) on a small batch of the same
cache (4 requests of 1, 333, 4099 and 8192 tokens) against the torch reference
(``reference_mla_decode``, fp32): ``err`` = max abs error / max |ref|.

Printed: a line per point (ms, TFLOP/s = 2 B L H (576 + 512) / t, latent GB/s, err), then a
compact table and the best variant per (dtype, page) against the Triton default. Written:
``<out>/sweep_mla_gluon.json`` after every point (a cut run keeps what it measured). A
watchdog stops the process ``--budget-s`` + 60 s after the start whatever runs then.

    PYTHONPATH=$PWD/python:$PWD/benches/attention \\
        python3 benches/attention/sweep_mla_gluon.py --out $OUT --budget-s 150
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402  (the harness: Bench, random caches, page tables)
from kvpool import attention  # noqa: E402
from kvpool.attention import mla_gluon  # noqa: E402
from kvpool.pool import LayerView  # noqa: E402

RANK, ROPE, HEADS = 512, 64, 128  # DeepSeek-V3 at TP 1
DTYPES = ("bf16", "fp8_e4m3", "fp16")
CHECK_LENS = (1, 333, 4099, 8192)
G = "mla_gluon"
# (label, plan knobs); "splits_x": the default split count times it; "(fp8)" / "(16-bit)":
# those caches only
VARIANTS = [
    ("triton default", {}),
    ("gluon n64 s2", dict(kernel=G)),
    ("gluon pipe n32 s3", dict(kernel=G, pipeline=True, block_n=32, num_stages=3)),
    ("gluon n32 s3", dict(kernel=G, block_n=32, num_stages=3)),
    ("gluon pipe n32 s4", dict(kernel=G, pipeline=True, block_n=32, num_stages=4)),
    ("gluon pipe n64 s2 (16-bit)", dict(kernel=G, pipeline=True)),
    ("gluon n32 s4", dict(kernel=G, block_n=32, num_stages=4)),
    ("gluon n32 s6 (fp8)", dict(kernel=G, block_n=32, num_stages=6)),
    ("gluon n32 s2", dict(kernel=G, block_n=32, num_stages=2)),
    ("gluon n64 splits 1", dict(kernel=G, num_splits=1)),
    ("gluon n64 splits x2", dict(kernel=G, splits_x=2)),
    ("gluon n32 s3 splits x2", dict(kernel=G, block_n=32, num_stages=3, splits_x=2)),
    ("gluon n64 splits x4", dict(kernel=G, splits_x=4)),
    (
        "gluon pipe n32 s3 splits x2",
        dict(kernel=G, pipeline=True, block_n=32, num_stages=3, splits_x=2),
    ),
    ("triton splits x2", dict(splits_x=2)),
]
FIRST = 3  # (the first FIRST variants also run on the later pages, then each best variant)


def log(*a):
    print(*a, flush=True)


class Sweep:
    def __init__(self, args):
        self.args = args
        self.bench = bm.Bench(args.out, args.reps, False)
        self.dev = self.bench.dev
        self.t0 = time.time()
        self.records: list[dict] = []
        self.b, self.n = map(int, args.shape.split("x"))
        self.d = RANK + ROPE
        self.views: dict[str, LayerView] = {}
        self.refs: dict[tuple, tuple] = {}

    def over(self) -> bool:
        return time.time() - self.t0 > self.args.budget_s

    def save(self, rec: dict | None = None) -> None:
        if rec is not None:
            self.records.append(rec)
        meta = {"torch": torch.__version__, "triton": __import__("triton").__version__,
                "device": torch.cuda.get_device_name()}  # fmt: skip
        with open(os.path.join(self.args.out, "sweep_mla_gluon.json"), "w") as f:
            json.dump({**meta, "shape": [self.b, self.n], "heads": HEADS,
                       "records": self.records}, f, indent=1)  # fmt: skip

    def view(self, dtype: str, page: int) -> LayerView:
        if dtype not in self.views:
            rows = max(self.b * self.n, sum(CHECK_LENS) + 64 * len(CHECK_LENS)) + 128
            self.views[dtype] = bm.random_view(dtype, rows, 0, self.d, self.dev, True)
        return dataclasses.replace(self.views[dtype], page_size=page)

    def plan(self, view, pt, sl, ctx, knobs, splits=None):
        kw = dict(knobs)
        mult = kw.pop("splits_x", None)
        if splits is not None:
            kw["num_splits"] = splits
        planner = attention.plan_mla_decode
        if "pipeline" in kw:  # (the Gluon kernel's own knob: its own planner)
            kw.pop("kernel")
            planner = mla_gluon.plan_mla_gluon_decode
        p = planner(view, HEADS, pt, sl, kv_lora_rank=RANK, max_seq_len=ctx, **kw)
        if mult and splits is None:
            kw["num_splits"] = min(p.num_splits * mult, attention.MAX_SPLITS)
            p = planner(view, HEADS, pt, sl, kv_lora_rank=RANK, max_seq_len=ctx, **kw)
        return p

    def point(self, dtype, page, label, knobs) -> dict:
        view = self.view(dtype, page)
        gen = torch.Generator().manual_seed(7 * page + 1)
        pt = bm.page_table(self.b, self.n, page, view.k.shape[0], gen, self.dev)
        sl = torch.full((self.b,), self.n, dtype=torch.int32, device=self.dev)
        q = torch.randn(self.b, HEADS, self.d, device=self.dev).to(torch.bfloat16)
        p = self.plan(view, pt, sl, self.n, knobs)
        rec = dict(
            dtype=dtype, page=page, B=self.b, L=self.n, heads=HEADS, variant=label, knobs=knobs,
            kernel=p.kernel, block_h=p.block_h, block_n=p.block_n, num_warps=p.num_warps,
            num_stages=p.num_stages, num_splits=p.num_splits,
            pipeline=getattr(p, "pipeline", None),
        )  # fmt: skip

        def call():
            return attention.mla_decode(view, q, plan=p, sm_scale=bm.MLA_SCALE)

        t = time.time()
        call()
        torch.cuda.synchronize()
        rec["first_call_s"] = round(time.time() - t, 2)
        ms = self.bench.time_ms(call)
        rec.update(
            time_ms=ms,
            tflops=2 * self.b * self.n * HEADS * (self.d + RANK) / ms / 1e9,
            latent_GBps=self.b * self.n * bm.bytes_per_token(view) / ms / 1e6,
        )
        rec["err"] = self.check(view, dtype, page, knobs, p.num_splits)
        return rec

    def check(self, view, dtype, page, knobs, splits) -> float:
        """The variant's knobs and split count on the small batch against the torch reference."""
        key = (dtype, page)
        if key not in self.refs:
            gen = torch.Generator().manual_seed(11 + page)
            pages = [-(-n // page) for n in CHECK_LENS]
            ids = torch.randperm(view.k.shape[0] // page - 1, generator=gen)[: sum(pages)] + 1
            pt = torch.zeros(len(CHECK_LENS), max(pages), dtype=torch.int32)
            for i, c in enumerate(torch.tensor(pages).cumsum(0).tolist()):
                pt[i, : pages[i]] = ids[c - pages[i] : c]
            pt = pt.to(self.dev)
            sl = torch.tensor(CHECK_LENS, dtype=torch.int32, device=self.dev)
            q = torch.randn(len(CHECK_LENS), HEADS, self.d, generator=gen).to(torch.bfloat16)
            q = q.to(self.dev)
            ref = attention.reference_mla_decode(
                view, q, pt, sl, sm_scale=bm.MLA_SCALE, kv_lora_rank=RANK
            )
            self.refs[key] = (pt, sl, q, ref)
        pt, sl, q, ref = self.refs[key]
        small = self.plan(view, pt, sl, max(CHECK_LENS), knobs, splits=splits)
        out = attention.mla_decode(view, q, plan=small, sm_scale=bm.MLA_SCALE).float()
        if not torch.isfinite(out).all():
            return float("inf")
        return ((out - ref).abs().max() / ref.abs().max()).item()

    def run_list(self, items) -> None:
        for dtype, page, label, knobs in items:
            if self.over():
                self.save(dict(dtype=dtype, page=page, variant=label, knobs=knobs,
                               skipped="budget"))  # fmt: skip
                continue
            try:
                rec = self.point(dtype, page, label, knobs)
                log(line(rec))
            except Exception as e:  # noqa: BLE001  (a variant that fails is recorded, skipped)
                traceback.print_exc(limit=3)
                rec = dict(dtype=dtype, page=page, variant=label, knobs=knobs,
                           error=repr(e)[:400])  # fmt: skip
                log(f"{dtype} p{page} {label}: ERROR {rec['error'][:200]}")
            self.save(rec)

    def best(self, dtype, page):
        ok = [r for r in self.records
              if "time_ms" in r and (r["dtype"], r["page"]) == (dtype, page)]  # fmt: skip
        return min(ok, key=lambda r: r["time_ms"]) if ok else None

    def run(self) -> None:
        p0, rest = self.args.pages[0], self.args.pages[1:]
        first, others = VARIANTS[:FIRST], VARIANTS[FIRST:]
        # the headline variants on every page first, variant by variant (the Triton kernel's
        # points are measured before a Gluon one could fault the CUDA context)
        self.run_list([(dtype, page, label, k) for label, k in first
                       for page in (p0, *rest) for dtype in self.args.dtypes
                       if _fits(label, dtype)])  # fmt: skip
        self.run_list([(dtype, p0, label, k) for dtype in self.args.dtypes
                       for label, k in others if _fits(label, dtype)])  # fmt: skip
        heads = {label for label, _ in first}
        for page in rest:  # each (dtype)'s best variant of the first page
            for dtype in self.args.dtypes:
                b = self.best(dtype, p0)
                if b and b["variant"] not in heads:
                    self.run_list([(dtype, page, b["variant"], b["knobs"])])


def _fits(label: str, dtype: str) -> bool:
    """Variants marked for one kind of cache: "(fp8)" or "(16-bit)"."""
    if "(fp8)" in label:
        return dtype.startswith("fp8")
    return "(16-bit)" not in label or not dtype.startswith("fp8")


def line(r: dict) -> str:
    return (
        f"{r['dtype']:8s} p{r['page']:<2d} {r['variant']:27s} {r['kernel']:10s} "
        f"n{r['block_n']} s{r['num_stages']} x{r['num_splits']} | {r['time_ms']:.4f} ms "
        f"{r['tflops']:6.1f} TFLOP/s {r['latent_GBps']:7.1f} GB/s | err {r['err']:.2e} | "
        f"first call {r['first_call_s']} s"
    )


def summary(records) -> str:
    ok = [r for r in records if "time_ms" in r]
    rows = ["| dtype | page | variant | kernel | n/s/splits | ms | TFLOP/s | GB/s | err |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in ok:
        rows.append(
            f"| {r['dtype']} | {r['page']} | {r['variant']} | {r['kernel']} | {r['block_n']}/"
            f"{r['num_stages']}/{r['num_splits']} | {r['time_ms']:.4f} | {r['tflops']:.0f} | "
            f"{r['latent_GBps']:.0f} | {r['err']:.1e} |"
        )
    best = {}
    for r in ok:
        k = (r["dtype"], r["page"])
        if k not in best or r["time_ms"] < best[k]["time_ms"]:
            best[k] = r
    rows.append("\nbest per (dtype, page):")
    for (dt, pg), r in sorted(best.items()):
        d = next((x for x in ok if (x["dtype"], x["page"], x["variant"])
                  == (dt, pg, "triton default")), None)  # fmt: skip
        vs = ""
        if d:
            vs = f" (triton default {d['time_ms']:.4f} ms: {d['time_ms'] / r['time_ms']:.2f}x)"
        rows.append(f"  {dt} p{pg}: {r['variant']} {r['time_ms']:.4f} ms "
                    f"{r['tflops']:.0f} TFLOP/s err {r['err']:.1e}{vs}")  # fmt: skip
    for r in records:
        if "error" in r:
            rows.append(f"  error: {r['dtype']} p{r['page']} {r['variant']}: {r['error'][:160]}")
    skipped = sum("skipped" in r for r in records)
    errors = sum("error" in r for r in records)
    rows.append(f"{len(ok)} points, {skipped} skipped (budget), {errors} errors")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=150.0, help="no point starts after")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--shape", default="64x8192", help="B x L of the timed points")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--pages", default="16,64", help="the first gets every variant")
    args = ap.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.pages = [int(x) for x in args.pages.split(",")]
    os.makedirs(args.out, exist_ok=True)
    s = Sweep(args)

    def watchdog(signum, frame):  # (a hung point: keep what was measured, print, stop)
        s.save()
        log(summary(s.records))
        log(f"watchdog: stopped at {time.time() - s.t0:.0f} s")
        os._exit(3)

    signal.signal(signal.SIGALRM, watchdog)
    signal.alarm(int(args.budget_s) + 60)
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{__import__('triton').__version__}, B x L = {s.b} x {s.n}, {HEADS} heads")  # fmt: skip
    s.run()
    signal.alarm(0)
    log(summary(s.records))
    log(f"wall {time.time() - s.t0:.0f} s; {os.path.join(args.out, 'sweep_mla_gluon.json')}")
    return s.records


if __name__ == "__main__":
    main()
