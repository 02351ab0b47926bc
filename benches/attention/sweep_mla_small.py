"""Sweep of the few-heads MLA decode kernel (``mla_small``, issue 17) against the head-block one.

Points: DeepSeek-V3 at TP 8 (16 heads) and Kimi-K2 at TP 8 (8 heads), latent 512 + 64,
B x L = 64 x 8k (``--shape``), pages 16 and 64, caches bf16 / fp8_e4m3 / nvfp4. Variants per
point (``VARIANTS``, ``--variants``): ``old`` (``mla_triton``, the head-block kernel's default
plan), ``small`` (``mla_small``'s default plan), and ``bn:nw:ns:pf[:splits[:hp]]`` = block_n,
num_warps, num_stages, prefetch 0/1, an explicit split count (``d`` = the planner's) and the
padded heads ``block_h``. Loops run dtype -> variant -> model -> page so that each compile (one
per dtype and variant: the page size and the head count up to 16 are not constants) serves
four points back to back.

Timing: ``bench_attention.time_ms`` (each call captured in a CUDA graph and replayed, a
256 MiB buffer zeroed before every replay to flush the L2, median of ``--reps``). The copy
bandwidth is measured first (a 1 GiB device-to-device ``torch`` copy, bytes read + written /
time); each record's ``latent_TBps`` (latent bytes the call reads, data + FP4 block scales,
/ time) is also given as ``copy_frac`` of it (issue 17's target: fp8 >= 0.75 at 16 heads).

Accuracy: before its first timed point each (dtype, variant, model) decodes a small batch
(3 requests of 1 / 777 / 2,048 tokens, page 16) and records ``max_abs_err`` / ``rel_err``
against ``reference_mla_decode`` (torch: dequantize, fp32 attention); ``err_ok`` is
``rel_err`` < 2e-2 (the tests' tolerances are 8e-3..1.6e-2 against an fp64 oracle).

    PYTHONPATH=$PWD/python:$PWD/benches/attention \\
        python3 benches/attention/sweep_mla_small.py --out $OUT --budget-s 200
    python3 benches/attention/sweep_mla_small.py --quick --out DIR   # CPU smoke (interpreter)

Output: one line per record, then a table (rows model x dtype x page, a column per variant:
ms and fraction of the copy bandwidth) and the fastest variant per row; ``--warm-procs``
workers compile and check the variants in parallel first (logs ``<out>/warm_<i>.log``).
``--budget-s`` (default 200) is a hard limit on starting points: the run stops, keeps what it
measured (``<out>/sweep_mla_small.json`` is rewritten after every record) and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as bm  # noqa: E402  (random caches, page tables, the timing harness)
from kvpool import attention  # noqa: E402
from kvpool.attention import mla_small  # noqa: E402

MODELS = {"deepseek-v3-tp8": 16, "kimi-k2-tp8": 8, "deepseek-v3-tp4": 32}  # heads per rank
DEFAULT_MODELS = "deepseek-v3-tp8,kimi-k2-tp8"  # (TP 4: --models deepseek-v3-tp4)
DTYPES = ("fp8_e4m3", "nvfp4", "bf16")  # (the target first: a cut run keeps it)
#: the default plans, then mla_small tiles compiled for sm_90 without spills (see
#: attention/mla_small.py DEFAULT_TILE), then split counts around the default ones
VARIANTS = (
    "old,small,32:4:1:1,32:4:3:0,64:4:1:1,64:8:2:0,32:8:1:0,32:4:2:0,"
    "32:4:1:1:2,32:4:1:1:8,32:4:1:1:16,32:4:3:0:2,32:4:3:0:8,32:4:3:0:d:8"
)
REL_OK = 2e-2


class BudgetSpent(BaseException):
    """Raised by SIGALRM when ``--budget-s`` runs out inside a point (a compile, a timing)."""


def log(*a):
    print(*a, flush=True)


def parse_variant(v: str) -> dict | None:
    """``old`` -> None; ``small`` -> {}; ``bn:nw:ns:pf[:splits[:hp]]`` -> plan knobs."""
    if v == "old":
        return None
    if v == "small":
        return {}
    parts = v.split(":")
    if not 4 <= len(parts) <= 6:
        raise SystemExit(f"variant {v!r}: expected old, small or bn:nw:ns:pf[:splits[:hp]]")
    kw = dict(block_n=int(parts[0]), num_warps=int(parts[1]), num_stages=int(parts[2]),
              prefetch=parts[3] == "1")  # fmt: skip
    if len(parts) > 4 and parts[4] != "d":
        kw["num_splits"] = int(parts[4])
    if len(parts) > 5:
        kw["block_h"] = int(parts[5])
    return kw


def make_plan(view, heads, pt, sl, rank, ctx, knobs, num_splits=None):
    """``knobs`` None: the head-block kernel's default plan; else ``plan_mla_small_decode``
    with them (``num_splits`` overrides theirs)."""
    if knobs is None:
        return attention.plan_mla_decode(
            view, heads, pt, sl, kv_lora_rank=rank, max_seq_len=ctx, kernel="mla_triton",
            num_splits=num_splits,
        )  # fmt: skip
    kw = dict(knobs) if num_splits is None else {**knobs, "num_splits": num_splits}
    return mla_small.plan_mla_small_decode(
        view, heads, pt, sl, kv_lora_rank=rank, max_seq_len=ctx, **kw
    )


def check_error(bench, dtype, d, heads, rank, knobs, splits) -> dict:
    """Max abs / relative error of the variant against the torch reference on a small batch
    (its own small cache), with the timed points' split count: the compile it triggers is
    the one the timed points reuse (same constants and integer specializations)."""
    dev = bench.dev
    lens = [1, 777, 2048] if not bench.quick else [1, 37, 70]
    page = 16
    gen = torch.Generator().manual_seed(11)
    view = bm.random_view(dtype, 4096 + 64 * 4, 0, d, dev, True)
    need = sum(-(-n // page) for n in lens)
    ids = (torch.randperm(view.k.shape[0] // page - 1, generator=gen)[:need] + 1).tolist()
    width = 128 if not bench.quick else 8  # (a multiple of 16 like the timed page tables)
    pt = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens):
        k = -(-n // page)
        pt[b, :k] = torch.tensor([ids.pop() for _ in range(k)], dtype=torch.int32)
    pt, sl = pt.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)
    pv = dataclasses.replace(view, page_size=page)
    q = torch.randn(len(lens), heads, view.head_dim, generator=gen).to(torch.bfloat16).to(dev)
    plan = make_plan(pv, heads, pt, sl, rank, max(lens), knobs, num_splits=splits)
    out = attention.mla_decode(pv, q, plan=plan, sm_scale=bm.MLA_SCALE, backend="triton")
    ref = attention.reference_mla_decode(pv, q, pt, sl, sm_scale=bm.MLA_SCALE, kv_lora_rank=rank)
    err = (out.float() - ref).abs().max().item()
    rel = err / max(ref.abs().max().item(), 1e-30)
    return dict(max_abs_err=err, rel_err=rel, err_ok=bool(rel < REL_OK))


def timed_splits(bench, view_like, heads, rank, b, n, knobs) -> int:
    """The split count the timed points' plans take (page 16; the planner's count does not
    depend on the page size)."""
    pt = torch.ones(b, n // 16, dtype=torch.int32, device=bench.dev)
    sl = torch.full((b,), n, dtype=torch.int32, device=bench.dev)
    pv = dataclasses.replace(view_like, page_size=16)
    return make_plan(pv, heads, pt, sl, rank, n, knobs).num_splits


def copy_TBps(bench) -> float | None:
    if bench.quick:
        return None
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = bench.ba.time_ms(lambda: y.copy_(x), max(bench.reps, 25), graph=False)[0]
    return 2 * n / ms / 1e9  # (x and y are freed on return)


def point(bench, view, model, heads, rank, b, n, page, knobs, vname) -> dict:
    gen = torch.Generator().manual_seed(b * 7 + n + page)
    pv = dataclasses.replace(view, page_size=page)
    pt = bm.page_table(b, n, page, view.k.shape[0], gen, bench.dev)
    sl = torch.full((b,), n, dtype=torch.int32, device=bench.dev)
    q = torch.randn(b, heads, view.head_dim, device=bench.dev).to(torch.bfloat16)
    out = torch.empty(b, heads, rank, dtype=torch.bfloat16, device=bench.dev)
    plan = make_plan(pv, heads, pt, sl, rank, n, knobs)

    def call():
        attention.mla_decode(pv, q, plan=plan, sm_scale=bm.MLA_SCALE, out=out, backend="triton")

    ms = bench.time_ms(call)
    nbytes = b * n * bm.bytes_per_token(view)
    return dict(
        model=model, heads=heads, dtype=view.dtype, page=page, B=b, L=n, variant=vname,
        kernel=plan.kernel, splits=plan.num_splits, block_h=plan.block_h,
        block_n=plan.block_n, num_warps=plan.num_warps, num_stages=plan.num_stages,
        prefetch=getattr(plan, "prefetch", None), time_ms=ms, latent_bytes=nbytes,
        latent_TBps=nbytes / ms / 1e9,
    )  # fmt: skip


def short(r) -> str:
    """One line per record (the JSON has every field)."""
    if "time_ms" not in r:
        return f"{r.get('dtype')} {r.get('model')} {r.get('variant')}: error {r.get('error')}"
    frac = f" {r['copy_frac']:.0%}" if r.get("copy_frac") else ""
    return (
        f"{r['dtype']} {r['model']} p{r['page']} {r['variant']} s={r['splits']}: "
        f"{r['time_ms']:.4f} ms {r['latent_TBps']:.2f} TB/s{frac} err {r.get('rel_err', 0):.1e}"
    )


def table(records, copy) -> str:
    """Rows (model, dtype, page), one column per variant: ms and the fraction of the copy
    bandwidth (``!`` marks an error above the check's limit)."""
    variants, rows = [], {}
    for r in records:
        if "time_ms" not in r:
            continue
        if r["variant"] not in variants:
            variants.append(r["variant"])
        frac = f" {r['copy_frac']:.0%}" if r.get("copy_frac") else ""
        bad = "" if r.get("err_ok", True) else "!"
        cell = f"{r['time_ms']:.4f}{frac}{bad}"
        rows.setdefault((r["model"], r["dtype"], r["page"]), {})[r["variant"]] = cell
    head = "| model | dtype | page | " + " | ".join(variants) + " |"
    lines = [head, "|" + "---|" * (3 + len(variants))]
    for (model, dtype, page), cells in rows.items():
        vals = " | ".join(cells.get(v, "-") for v in variants)
        lines.append(f"| {model} | {dtype} | {page} | {vals} |")
    cap = f"ms (fraction of the {copy:.2f} TB/s copy bandwidth)\n\n" if copy else "ms\n\n"
    errs = [short(r) for r in records if "time_ms" not in r]
    return cap + "\n".join(lines) + "\n" + "".join(e + "\n" for e in errs)


def best_lines(records) -> list[str]:
    """The fastest variant per (model, dtype, page) and its gain over ``old``."""
    out, groups = [], {}
    for r in records:
        if "time_ms" in r and r.get("err_ok", True):
            groups.setdefault((r["model"], r["dtype"], r["page"]), []).append(r)
    for key, rs in groups.items():
        best = min(rs, key=lambda r: r["time_ms"])
        old = [r for r in rs if r["variant"] == "old"]
        gain = f", {old[0]['time_ms'] / best['time_ms']:.2f}x old" if old else ""
        frac = f" ({best['copy_frac']:.0%} of copy)" if best.get("copy_frac") else ""
        out.append(f"best {key}: {best['variant']} {best['time_ms']:.4f} ms{frac}{gain}")
    return out


def groups(args):
    """``(dtype, variant name, knobs, model, heads)`` in run order: one compile each."""
    out = []
    for dtype in args.dtypes.split(","):
        for vname in args.variants.split(","):
            knobs = parse_variant(vname)
            for model in args.models.split(","):
                heads = MODELS[model]
                if knobs and knobs.get("block_h", heads) < heads:
                    continue  # (an 8-wide head block is for Kimi's 8 heads)
                out.append((dtype, vname, knobs, model, heads))
    return out


def gkey(g) -> str:
    return f"{g[0]}|{g[1]}|{g[3]}"


def geometry(args):
    """``(B, L, kv_lora_rank, latent width)`` of the timed points."""
    if args.quick:
        return 2, 64, 32, 48
    b, n = map(int, args.shape.split("x"))
    return b, n, bm.RANK, bm.RANK + bm.ROPE


def warm(args, bench, shard: int, nshards: int) -> None:
    """Worker: compile and check a shard of the groups (fills Triton's disk cache), writing
    ``{group: error record}`` to ``<out>/warm_<shard>.json`` after each."""
    b, n, rank, d = geometry(args)
    res, path = {}, os.path.join(args.out, f"warm_{shard}.json")
    for i, g in enumerate(groups(args)):
        if i % nshards != shard:
            continue
        dtype, vname, knobs, model, heads = g
        try:
            like = bm.random_view(dtype, 256, 0, d, bench.dev, True)
            splits = timed_splits(bench, like, heads, rank, b, n, knobs)
            res[gkey(g)] = check_error(bench, dtype, d, heads, rank, knobs, splits)
        except Exception as e:  # noqa: BLE001
            res[gkey(g)] = dict(error=repr(e)[:300])
        with open(path, "w") as f:
            json.dump(res, f)


def run_warm(args, t0) -> dict:
    """Start ``--warm-procs`` workers (this script with ``--warm i/n``), wait for them at most
    ``--warm-share`` of the budget, stop the ones still running, and merge their results."""
    nproc = args.warm_procs
    if nproc <= 0:
        return {}
    argv = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--models",
            args.models, "--dtypes", args.dtypes, "--shape", args.shape, "--variants",
            args.variants] + (["--quick"] if args.quick else [])  # fmt: skip
    procs = []
    for i in range(nproc):
        with open(os.path.join(args.out, f"warm_{i}.log"), "w") as f:
            procs.append(subprocess.Popen([*argv, "--warm", f"{i}/{nproc}"], stdout=f, stderr=f))
    deadline = t0 + args.budget_s * args.warm_share
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:  # (ours: a cut warm-up; the sweep compiles what is left itself)
            if p.poll() is None:
                p.kill()
                p.wait()
    merged = {}
    for i in range(nproc):
        path = os.path.join(args.out, f"warm_{i}.json")
        if os.path.exists(path):
            with open(path) as f:
                merged.update(json.load(f))
            os.remove(path)
    log(f"warm-up: {len(merged)} groups compiled and checked in {time.time() - t0:.0f} s")
    return merged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--pages", default="16,64")
    ap.add_argument("--shape", default="64x8192")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument(
        "--warm-procs",
        type=int,
        default=None,
        help="parallel compile workers (default min(12, cores - 2); 0: none)",
    )
    ap.add_argument(
        "--warm-share", type=float, default=0.45, help="most of the budget the warm-up may take"
    )
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)  # worker: shard i/n
    ap.add_argument("--quick", action="store_true", help="CPU smoke run at tiny sizes")
    args = ap.parse_args(argv)
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    quick = args.quick
    bench = bm.Bench(args.out, 2 if quick else max(args.reps, 25), quick)
    if args.warm:
        shard, nshards = map(int, args.warm.split("/"))
        return warm(args, bench, shard, nshards)
    if args.warm_procs is None:
        args.warm_procs = 0 if quick else max(0, min(12, (os.cpu_count() or 2) - 2))
    b, n, rank, d = geometry(args)
    pages = [int(p) for p in args.pages.split(",")]
    records: list[dict] = []
    path = os.path.join(args.out, "sweep_mla_small.json")
    copy = None

    def alarm(signum, frame):
        raise BudgetSpent

    # hard limit: points are not started when the longest one so far would not fit, and an
    # alarm ends one that overruns (its record is dropped, the rest is written)
    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(max(1, int(args.budget_s)))
    stopped = False
    try:
        checked = run_warm(args, t0)
        copy = copy_TBps(bench)
        if not quick:
            torch.cuda.empty_cache()
        log(f"copy bandwidth: {copy:.3f} TB/s" if copy else "copy bandwidth: not measured")
        meta = dict(device=torch.cuda.get_device_name() if not quick else "cpu",
                    torch=torch.__version__, triton=__import__("triton").__version__,
                    copy_TBps=copy, shape=[b, n])  # fmt: skip

        def save(rec):
            if copy and "latent_TBps" in rec:
                rec["copy_frac"] = rec["latent_TBps"] / copy
            records.append(rec)
            with open(path, "w") as f:
                json.dump({**meta, "records": records}, f, indent=1)
            log(short(rec))

        stopped = sweep(args, bench, (b, n, rank, d), pages, checked, save, t0)
    except BudgetSpent:
        stopped = True
    signal.alarm(0)
    finish(args, records, copy, path, stopped, t0)
    return records


def sweep(args, bench, geom, pages, checked, save, t0) -> bool:
    """The timed points, dtype -> variant -> model -> page; True when the budget stopped them.
    A point is not started when the longest one so far would overrun the budget."""
    b, n, rank, d = geom
    longest, view, vdtype = 0.0, None, None
    for g in groups(args):
        dtype, vname, knobs, model, heads = g
        if time.time() - t0 + longest > args.budget_s:
            return True
        t1 = time.time()
        if dtype != vdtype:
            view = None
            if not bench.quick:
                torch.cuda.empty_cache()
            view, vdtype = bm.random_view(dtype, b * n + 64 * 2, 0, d, bench.dev, True), dtype
        try:
            err = checked.get(gkey(g))
            if err is None or "error" in err:
                splits = timed_splits(bench, view, heads, rank, b, n, knobs)
                err = check_error(bench, dtype, d, heads, rank, knobs, splits)
        except Exception as e:  # noqa: BLE001  (a variant that fails: record, go on)
            traceback.print_exc()
            save(dict(model=model, dtype=dtype, variant=vname, error=repr(e)[:300]))
            continue
        for page in pages:
            if time.time() - t0 + longest > args.budget_s:
                return True
            try:
                rec = point(bench, view, model, heads, rank, b, n, page, knobs, vname)
                save({**rec, **err})
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                save(dict(model=model, dtype=dtype, page=page, variant=vname,
                          error=repr(e)[:300]))  # fmt: skip
            longest = max(longest, time.time() - t1)
            t1 = time.time()
    return False


def finish(args, records, copy, path, stopped, t0) -> None:
    if stopped:
        log(f"budget of {args.budget_s} s spent: stopped")
    text = table(records, copy)
    with open(os.path.join(args.out, "sweep_mla_small.md"), "w") as f:
        f.write(text)
    log(text)
    for line in best_lines(records):
        log(line)
    log(f"{len(records)} records in {time.time() - t0:.0f} s -> {path}")


if __name__ == "__main__":
    main()
