"""Sweep of the Gluon decode variants at head_dim 64 (issue 17): gpt-oss-120b's full-attention
layer (64 query / 8 KV heads x 64, sinks), B x L = 64 x 8k, page 16, beside torch SDPA on
contiguous bf16 K/V in the same process.

Variants (:func:`variants_for`): the default plan, the measured kernels with other constants
(``GluonKnobs(multi=False, ...)``: ring stages, FP4 tiles a stage, TMA, lazy rescale) and the
multi kernel (``decode_gluon_multi.py``: 1/2/4 tiles a stage, 1/2 KV heads a program, ring
depth, TMA or cp.async, page ids one or two stages ahead), each at the planner's split count;
then the three fastest of each dtype at other split counts.

1. Check (``--workers`` processes in parallel, which also fills Triton's cache): each variant
   at a small ragged batch with the same launch specialization (page-table width, splits),
   rows past each request's end poisoned (NaN codes where the dtype has them), against
   ``attention.reference_decode``: ``max_abs`` and ``rel`` (max |out - ref| / max |ref|). A
   variant that fails to compile or exceeds the tolerance is recorded and not timed.
2. Time (this process, after the checks): harness of ``bench_attention.py`` (CUDA graph, L2
   flushed before each of ``--reps`` replays, median), dtypes round robin so a cut run covers
   each; ``ratio`` = SDPA ms / variant ms, ``TBps`` = the cache bytes read / time.
3. The best variant per dtype also on the sliding-window layer (window 128) and checked there.

``--budget-s`` (default 200) bounds the whole run: checks get ~45% of it, no timing starts past
it. Prints a table and the best per dtype (as the ``gluon_knobs.HD64_DEFAULTS`` line that would
make it the default); writes ``<out>/sweep_hd64.json`` (records as they come) and
``sweep_hd64.md``.

    PYTHONPATH=$PWD/python:$PWD/benches/attention \\
        python3 benches/attention/sweep_hd64.py --out $OUT --budget-s 200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback

HQ, HK, D = 64, 8, 64
DTYPES = ("fp8_e4m3", "nvfp4", "bf16", "fp4_mx_block16")
TARGETS = {"bf16": 0.95, "fp8_e4m3": 1.6, "nvfp4": 2.0}
TOL = {"bf16": 1.6e-2, "fp16": 8e-3, "fp8_e4m3": 8e-3, "fp8_e5m2": 8e-3, "nvfp4": 8e-3,
       "fp4_mx_block16": 1.6e-2}  # fmt: skip
CHECK_LENS = (1, 17, 300, 1000, 4093, 2048, 64, 5)
SPLITS = (3, 4, 5, 6, 8)
FP4 = ("nvfp4", "fp4_mx_block16")

# the multi kernel's points: (tiles a stage, KV heads a program, stages, extra knobs)
MULTI = (
    (1, 1, 3, {}), (1, 1, 4, {}), (1, 1, 4, {"ahead": 2}), (2, 1, 2, {}), (2, 1, 3, {}),
    (2, 1, 4, {}), (2, 1, 3, {"ahead": 2}), (4, 1, 2, {}), (4, 1, 3, {}), (1, 2, 3, {}),
    (1, 2, 4, {}), (2, 2, 2, {}), (2, 2, 3, {}), (2, 1, 3, {"tma": False}),
    (2, 2, 3, {"tma": False}), (2, 1, 3, {"rescale": -1.0}),
)  # fmt: skip


def variants_for(dtype: str) -> list[tuple[str, dict | None]]:
    """``(name, knobs)`` of the sweep for ``dtype`` (knobs None: the default plan)."""
    out: list[tuple[str, dict | None]] = [("default", None)]
    if dtype in FP4:
        base = [dict(stages=3), dict(stages=4), dict(sub=1, stages=3), dict(sub=1, stages=4),
                dict(tma=False)]  # fmt: skip
    else:
        base = [dict(stages=2), dict(stages=4), dict(stages=6), dict(rescale=8.0)]
    for kw in base:
        out.append((_name(False, kw), kw))
    for sub, heads, stages, extra in MULTI:
        kw = dict(multi=True, sub=sub, heads=heads, stages=stages, **extra)
        out.append((_name(True, kw), kw))
    return out


def _name(multi: bool, kw: dict) -> str:
    from kvpool.attention.gluon_knobs import GluonKnobs

    return GluonKnobs(**{**kw, "multi": multi}).label()


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------- batches


def make_view(dtype, rows, dev="cuda"):
    import bench_models as bm

    view = bm.random_view(dtype, rows, HK, D, dev, False)
    return dataclasses.replace(view, page_size=16)


def big_batch(view, b, n, seed=0):
    """Page table ``[b, n / 16]`` of random distinct pages, lengths ``n``, bf16 q, sinks."""
    import bench_models as bm
    import torch

    gen = torch.Generator().manual_seed(seed)
    pt = bm.page_table(b, n, 16, view.k.shape[0], gen, "cuda")
    sl = torch.full((b,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(b, HQ, D, generator=gen).to("cuda", torch.bfloat16)
    sinks = torch.linspace(-2.0, 3.0, HQ, device="cuda")
    return pt, sl, q, sinks


def check_batch(dtype, width, seed=1):
    """A small ragged batch: its own cache, ``CHECK_LENS``, a page table ``width`` pages wide
    (the timed batch's width: the same launch specialization), the slots past each request's
    end in its last page poisoned (fp8 0x7F, 16-bit NaN; FP4 scale bytes NaN)."""
    import torch

    pages = [-(-n // 16) for n in CHECK_LENS]
    rows = (sum(pages) + 2) * 16
    view = make_view(dtype, rows)
    gen = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    pt = torch.zeros(len(CHECK_LENS), width, dtype=torch.int32)
    for b, n in enumerate(CHECK_LENS):
        mine = [perm.pop() for _ in range(pages[b])]
        pt[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        tail = torch.arange(n, pages[b] * 16)
        slots = torch.tensor(mine)[tail // 16] * 16 + tail % 16
        # (FP4 data: every byte is a finite code; its scale rows are what can be NaN)
        poison = (view.k_block_scale, view.v_block_scale) if dtype in FP4 else (view.k, view.v)
        for t in poison:
            if t.dtype in (torch.bfloat16, torch.float16):
                t[slots.cuda()] = float("nan")
            else:
                t.view(torch.uint8)[slots.cuda()] = 0xFF if dtype == "fp4_mx_block16" else 0x7F
    sl = torch.tensor(CHECK_LENS, dtype=torch.int32, device="cuda")
    q = torch.randn(len(CHECK_LENS), HQ, D, generator=gen).to("cuda", torch.bfloat16)
    sinks = torch.linspace(-2.0, 3.0, HQ, device="cuda")
    return view, pt.cuda(), sl, q, sinks


def plan_for(view, pt, sl, knobs, splits, ctx):
    from kvpool import attention

    kw = {"gluon_knobs": knobs} if knobs is not None else {}
    if splits is not None:
        kw["num_splits"] = splits
    return attention.plan_decode(view, HQ, pt, sl, max_seq_len=ctx, **kw)


def planned_splits(view, knobs, b, n) -> int:
    """The planner's split count for the timed batch (a page table of its width, no data)."""
    import torch

    pt = torch.zeros(b, n // 16, dtype=torch.int32, device="cuda")
    sl = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return plan_for(view, pt, sl, knobs, None, n).num_splits


def check(dtype, knobs, splits, n, window=None) -> dict:
    """Max abs / relative error of one variant against ``reference_decode`` (see module)."""
    import torch
    from kvpool import attention

    view, pt, sl, q, sinks = check_batch(dtype, n // 16)
    plan = plan_for(view, pt, sl, knobs, splits, n)
    opts = {"sinks": sinks, **({"window": window} if window else {})}
    t = time.time()
    out = attention.decode(view, q, plan=plan, backend="triton", **opts)
    torch.cuda.synchronize()
    secs = time.time() - t
    ref = attention.reference_decode(view, q, pt, sl, sm_scale=1 / math.sqrt(D), **opts)
    err = (out.float() - ref.float()).abs()
    finite = bool(torch.isfinite(out.float()).all())
    max_abs = err.max().item() if finite else float("inf")
    rel = max_abs / max(ref.float().abs().max().item(), 1e-30)
    return dict(max_abs=max_abs, rel=rel, ok=finite and rel <= TOL[dtype],
                first_call_s=round(secs, 2), kernel=plan.kernel)  # fmt: skip


# ----------------------------------------------------------------------------- workers


def worker(args) -> None:
    """``--worker i/N``: check every N-th job of ``<out>/sweep_jobs.json`` from the i-th; a
    ``start`` line before each job, its result after (the parent kills a job that hangs)."""
    i, n = map(int, args.worker.split("/"))
    with open(os.path.join(args.out, "sweep_jobs.json")) as f:
        jobs = json.load(f)
    path = os.path.join(args.out, f"sweep_check_{i}.jsonl")
    b, ctx = map(int, args.shape.split("x"))
    views = {}
    for j, job in enumerate(jobs):
        if j % n != i:
            continue
        with open(path, "a") as f:
            f.write(json.dumps({"id": job["id"], "start": time.time()}) + "\n")
        rec = {"id": job["id"]}
        t = time.time()
        try:
            dtype = job["dtype"]
            if dtype not in views:
                views[dtype] = make_view(dtype, 64 * 16)
            splits = job.get("splits") or planned_splits(views[dtype], job["knobs"], b, ctx)
            rec.update(splits=splits, **check(dtype, job["knobs"], splits, ctx, job.get("window")))
        except Exception as e:  # noqa: BLE001  (a compile error, a refused variant, a fault)
            rec.update(ok=False, error=repr(e)[:400])
            traceback.print_exc()
        rec["secs"] = round(time.time() - t, 1)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        err = rec.get("error", "").lower()
        if "illegal" in err or "cuda error" in err or "misaligned" in err:
            return  # (this process's CUDA context is gone: the rest of its jobs go unchecked)


def _read_checks(path):
    """``(results by id, the id started last without a result or None, its start time)``."""
    done, started = {}, {}
    if os.path.exists(path):
        for line in open(path):
            try:
                rec = json.loads(line)
            except ValueError:  # (a line cut by a kill)
                continue
            if "start" in rec:
                started[rec["id"]] = rec["start"]
            else:
                done[rec.pop("id")] = rec
    pending = [(k, t) for k, t in started.items() if k not in done]
    return done, *(pending[-1] if pending else (None, None))


def run_checks(args, jobs, deadline) -> dict:
    """Check ``jobs`` in ``--workers`` processes until ``deadline``. A job running longer than
    ``--job-limit-s`` (a hang: e.g. a TMA barrier that never completes) is recorded as such and
    its worker killed; jobs a dead or killed worker left go to new processes while that makes
    progress."""
    results: dict = {}
    todo = list(jobs)
    while todo and time.time() < deadline - 10:
        with open(os.path.join(args.out, "sweep_jobs.json"), "w") as f:
            json.dump(todo, f)
        for p in os.listdir(args.out):
            if p.startswith("sweep_check_"):
                os.remove(os.path.join(args.out, p))
        nw = max(1, min(args.workers, len(todo)))
        cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--shape", args.shape]
        procs = []
        for i in range(nw):
            logf = open(os.path.join(args.out, f"worker_{i}.log"), "a")
            procs.append(subprocess.Popen(cmd + ["--worker", f"{i}/{nw}"], stdout=logf,
                                          stderr=subprocess.STDOUT))  # fmt: skip
        paths = [os.path.join(args.out, f"sweep_check_{i}.jsonl") for i in range(nw)]
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            for p, path in zip(procs, paths, strict=True):
                if p.poll() is not None:
                    continue
                _, job, since = _read_checks(path)
                late = job is not None and time.time() - since > args.job_limit_s
                if late or time.time() > deadline:
                    p.kill()
                    p.wait()
                    if job is not None:
                        why = "hung" if late else "cut by the check deadline"
                        results[job] = {"ok": False, "error": f"{why} after "
                                        f"{time.time() - since:.0f} s (worker killed)"}  # fmt: skip
        for path in paths:
            done, job, since = _read_checks(path)
            results.update(done)
            if job is not None and job not in results:  # (its worker died inside it)
                results[job] = {"ok": False, "error": "the worker died in this check"}
        left = [j for j in todo if j["id"] not in results]
        if len(left) == len(todo):  # (no progress: do not spin)
            break
        todo = left
    for j in todo:
        results[j["id"]] = {"ok": False, "error": "unchecked (out of time)"}
    return results


# ----------------------------------------------------------------------------- timing


def time_point(bench, view, batch, knobs, splits, n, window=None):
    from kvpool import attention

    pt, sl, q, sinks = batch
    plan = plan_for(view, pt, sl, knobs, splits, n)
    opts = {"sinks": sinks, **({"window": window} if window else {})}
    ms = bench.time_ms(lambda: attention.decode(view, q, plan=plan, backend="triton", **opts))
    return ms, plan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--shape", default="64x8192")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 4) - 2)))
    ap.add_argument("--only", default="", help="comma list: variant names to keep (+ default)")
    ap.add_argument("--job-limit-s", type=float, default=60.0, help="a check's wall limit")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        return worker(args)
    t0 = time.time()
    deadline = t0 + args.budget_s
    jobs = []
    for dtype in args.dtypes.split(","):
        for name, knobs in variants_for(dtype):
            if args.only and name != "default" and name not in args.only.split(","):
                continue
            jobs.append(dict(id=f"{dtype}:{name}", dtype=dtype, name=name, knobs=knobs))
    log(f"{len(jobs)} variants, checks in {args.workers} processes")
    checks = run_checks(args, jobs, t0 + 0.45 * args.budget_s)
    log(f"checks done at +{time.time() - t0:.0f} s: "
        f"{sum(c.get('ok', False) for c in checks.values())} of {len(jobs)} pass")  # fmt: skip
    records = [{"dtype": j["dtype"], "variant": j["name"], "knobs": j["knobs"],
                "check": checks[j["id"]]} for j in jobs]  # fmt: skip
    try:
        time_all(args, records, deadline)
    finally:
        finish(args, records, t0)


def time_all(args, records, deadline) -> None:
    import bench_models as bm

    b, n = map(int, args.shape.split("x"))
    bench = bm.Bench(args.out, max(args.reps, 5), False)
    base = bm.baseline_ms(bench, HQ, HK, D, b, n, False)
    log(f"SDPA bf16 (contiguous, GQA) {base:.4f} ms")
    args.sdpa_ms = base
    views, batches = {}, {}
    for dtype in args.dtypes.split(","):
        views[dtype] = make_view(dtype, b * n + 64)
        batches[dtype] = big_batch(views[dtype], b, n)
    by_dtype = {}
    for r in records:
        by_dtype.setdefault(r["dtype"], []).append(r)
    # pass 1: dtypes round robin, each variant at its planned split count
    for r in _round_robin(list(by_dtype.values())):
        if time.time() > deadline - 5:
            log("budget spent: stopping")
            return
        if r["check"].get("ok"):
            _time_record(bench, views, batches, r, r["check"].get("splits"), n, b, base)
    # pass 2: the three fastest of each dtype at other split counts
    extra = []
    for dtype, rs in by_dtype.items():
        timed = sorted((r for r in rs if r.get("time_ms")), key=lambda r: r["time_ms"])[:3]
        for r in timed:
            for sp in SPLITS:
                if sp != r["splits"]:
                    extra.append(dict(dtype=dtype, variant=r["variant"], knobs=r["knobs"],
                                      check=r["check"], forced_splits=sp))  # fmt: skip
    for r in _round_robin([[e for e in extra if e["dtype"] == d] for d in by_dtype]):
        if time.time() > deadline - 5:
            log("budget spent: stopping")
            break
        records.append(r)
        _time_record(bench, views, batches, r, r["forced_splits"], n, b, base)
    # pass 3: the default and the best of each dtype on the sliding-window layer, checked
    # there first (in a worker process: a fault cannot take this one's timings down)
    jobs = []
    for dtype in by_dtype:
        rs = [r for r in records if r["dtype"] == dtype]
        for r in {id(x): x for x in (_default(rs), _best(rs)) if x and x.get("time_ms")}.values():
            jobs.append(dict(id=f"{dtype}:{r['variant']}:{r['splits']}:w128", dtype=dtype,
                             name=r["variant"], knobs=r["knobs"], splits=r["splits"],
                             window=128))  # fmt: skip
    if not jobs or time.time() > deadline - 25:
        return
    checks = run_checks(args, jobs, deadline - 10)
    for j in jobs:
        r = dict(dtype=j["dtype"], variant=j["name"], knobs=j["knobs"], window=128,
                 check=checks[j["id"]])  # fmt: skip
        records.append(r)
        if r["check"].get("ok") and time.time() < deadline - 3:
            _time_record(bench, views, batches, r, j["splits"], n, b, base, window=128)


def _round_robin(lists):
    out, i = [], 0
    while any(i < len(x) for x in lists):
        out += [x[i] for x in lists if i < len(x)]
        i += 1
    return out


def _time_record(bench, views, batches, r, splits, n, b, base, window=None) -> None:
    import bench_models as bm

    dtype = r["dtype"]
    try:
        ms, plan = time_point(bench, views[dtype], batches[dtype], r["knobs"], splits, n, window)
        kvb = b * (min(n, window) if window else n) * bm.bytes_per_token(views[dtype])
        r.update(time_ms=ms, splits=plan.num_splits, kernel=plan.kernel, ratio=base / ms,
                 TBps=kvb / ms / 1e9)  # fmt: skip
        log(
            f"{dtype:15s} {r['variant']:34s} splits {plan.num_splits:3d} {ms:.4f} ms "
            f"{base / ms:5.2f}x {kvb / ms / 1e9:5.2f} TB/s{'  window' if window else ''}"
        )
    except Exception as e:  # noqa: BLE001
        r["error"] = repr(e)[:300]
        log(f"{dtype} {r['variant']}: {r['error']}")


def _default(rs):
    return next((r for r in rs if r["variant"] == "default" and not r.get("window")), None)


def _best(rs):
    timed = [r for r in rs if r.get("time_ms") and not r.get("window")]
    return min(timed, key=lambda r: r["time_ms"]) if timed else None


def _row(r) -> str:
    c = r.get("check", {})
    note = r.get("error") or c.get("error") or ("window 128" if r.get("window") else "")
    ms = r.get("time_ms")
    return (
        f"| {r['dtype']} | {r['variant']} | {r.get('splits', '')} | "
        f"{'' if ms is None else f'{ms:.4f}'} | {r.get('ratio', 0):.2f} | "
        f"{r.get('TBps', 0):.2f} | {c.get('max_abs', float('nan')):.2e} | "
        f"{c.get('rel', float('nan')):.1e} | {note[:70]} |"
    )


def finish(args, records, t0) -> None:
    """``sweep_hd64.json`` and ``.md`` (every record); printed: the default and the six
    fastest of each dtype, the variants that failed, the best per dtype."""
    sdpa = getattr(args, "sdpa_ms", None)
    with open(os.path.join(args.out, "sweep_hd64.json"), "w") as f:
        json.dump({"sdpa_ms": sdpa, "shape": args.shape, "records": records}, f, indent=1)
    head = ["| dtype | variant | splits | ms | x SDPA | TB/s | max abs err | rel | note |",
            "|" + "---|" * 9]  # fmt: skip
    short = list(head)
    lines = ["", f"best per dtype (full-attention layer; SDPA {sdpa} ms):"]
    for dtype in args.dtypes.split(","):
        rs = [r for r in records if r["dtype"] == dtype]
        timed = sorted((r for r in rs if r.get("time_ms") and not r.get("window")),
                       key=lambda r: r["time_ms"])  # fmt: skip
        best, dflt = _best(rs), _default(rs)
        keep = timed[:6] + [dflt] + [r for r in rs if r.get("window")]
        short += [_row(r) for r in {id(r): r for r in keep if r}.values()]
        bad = [r["variant"] for r in rs if not r.get("time_ms") and not r.get("window")]
        if bad:
            short.append(f"| {dtype} | not timed ({len(bad)}): {', '.join(bad)[:300]} |")
        if best is None:
            lines.append(f"  {dtype}: nothing timed")
            continue
        want = TARGETS.get(dtype)
        gain = "" if not dflt or not dflt.get("time_ms") else (
            f", default {dflt['time_ms']:.4f} ms ({dflt['ratio']:.2f}x)")  # fmt: skip
        lines.append(
            f"  {dtype}: {best['variant']} splits {best['splits']}: {best['time_ms']:.4f} ms "
            f"{best['ratio']:.2f}x SDPA{'' if want is None else f' (target {want}x)'}{gain}"
        )
        if best["knobs"] is not None:
            kn = ", ".join(f"{k}={v!r}" for k, v in best["knobs"].items())
            lines.append(f"    gluon_knobs.HD64_DEFAULTS[{dtype!r}] = GluonKnobs({kn})"
                         f"  # + num_splits {best['splits']} if the planner differs")  # fmt: skip
    tail = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "sweep_hd64.md"), "w") as f:
        f.write(f"SDPA {sdpa} ms, shape {args.shape}, {time.time() - t0:.0f} s\n\n")
        f.write("\n".join(head + [_row(r) for r in records]) + "\n" + tail)
    log("\n".join(short) + "\n" + tail)
    log(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
