"""Run 8: the nvfp4 Gluon decode (``triton_kernels/decode_gluon_fp4.py``), one device call.

For B=64/8k (page 16, Llama-3.1-8B geometry) and a few other points, in one process: the
Gluon kernel with each nibble decode (``_GLUON_FP4_DEC``: K, V in {0: integer bit moves,
1: e4m3 bytes + cvt}) and split counts, the Triton kernel on the same cache, torch SDPA on
contiguous bf16 (at the start and at the end) and the fp8_e4m3 Gluon kernel; max |difference|
of each output from the Triton kernel's. ``bench_attention``'s harness (CUDA graph, L2 flushed
before each of 25 repetitions, median).

    OUT=dir python benches/attention/probes/gluon_fp4_check.py
    # modes: LOADS=1 DEPTH=1 SMALL=1 HEADMAJOR=1 REGS=1 STREAMS=1
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "benches/attention"))
import bench_attention as ba  # noqa: E402
import probe_loads  # noqa: E402
import torch  # noqa: E402
from kvpool import attention  # noqa: E402

OUT = os.environ.get("OUT", ".")
RES = []
DEFAULTS = (
    dict(attention._GLUON_CONFIG),
    attention._GLUON_FP4_DEC,
    attention._GLUON_FP4_OPTIONS,
)


def rec(**r):
    RES.append(r)
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "gluon_fp4.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": RES}, f, indent=1)


def point(view, b, ctx, page, points, hq=ba.HQ):
    gen = torch.Generator().manual_seed(b * 7 + ctx)
    pv = ba.with_page(view, page)
    pt = ba.page_table(b, ctx, page, view.k.shape[0], gen)
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    sl[0] = ctx - 5
    q = torch.randn(b, hq, ba.D, dtype=torch.bfloat16, device="cuda")
    ref = None
    for tag, dec, kw in points:
        kw = dict(kw)
        stages0, per_sm0, reg0 = DEFAULTS[0][view.dtype]
        stages = kw.pop("stages", stages0)
        cfg = (stages, kw.pop("per_sm", per_sm0), kw.pop("maxnreg", reg0))
        attention.variants._GLUON_FP4_OPTIONS = (
            kw.pop("head_fast", True),
            kw.pop("ablate", 0),
            kw.pop("tma", DEFAULTS[2][2]),
            kw.pop("sub", DEFAULTS[2][3]),
        )
        try:
            attention._GLUON_CONFIG[view.dtype] = cfg
            attention.clear_plan_memo()  # (plans made before the edit are not reused)
            if dec is not None:
                attention.variants._GLUON_FP4_DEC = dec
            plan = attention.plan_decode(pv, hq, pt, sl, max_seq_len=ctx, **kw)
            out = torch.empty(b, hq, ba.D, dtype=torch.bfloat16, device="cuda")
            attention.decode(pv, q, plan=plan, out=out)
            ms, _ = ba.time_ms(lambda p=plan, o=out: attention.decode(pv, q, plan=p, out=o), 25)
            if ref is None:
                ref = out.clone()
            diff = float((out.float() - ref.float()).abs().max())
            kvb = b * ctx * ba.bytes_per_token(view.dtype) * view.num_kv_heads // ba.HK
            rec(
                tag=tag,
                dtype=view.dtype,
                B=b,
                ctx=ctx,
                page=page,
                dec=dec,
                plan=kw,
                stages=stages,
                config=cfg,
                probe=attention.variants._GLUON_FP4_OPTIONS,
                splits=plan.num_splits,
                block_n=plan.block_n,
                gluon=plan.gluon,
                us=ms * 1e3,
                tbs=kvb / (ms * 1e-3) / 1e12,
                maxdiff_vs_first=diff,
            )
        except Exception as e:  # noqa: BLE001
            rec(tag=tag, dtype=view.dtype, B=b, ctx=ctx, dec=dec, plan=kw, error=repr(e)[:400])
    attention._GLUON_CONFIG.update(DEFAULTS[0])
    attention.variants._GLUON_FP4_DEC, attention.variants._GLUON_FP4_OPTIONS = DEFAULTS[1:]


def loads_main():
    """Session 6 (run 9): the ring's data tiles by TMA (``tma``) and 16-token tiles per ring
    stage (``sub`` 1 or 2), against the previous defaults (cp.async, one tile a stage); full
    kernel and loads only (``ablate=1``). Call 1 of run 9 also tried an L2 prefetch of whole
    cache rows (slower at every distance; the option is gone, its numbers are in the notes)."""
    rec(tag="sdpa_start", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)
    rows = 64 * 8192 + 4096
    old = {"tma": False, "sub": 1}
    for dt in ("nvfp4", "fp4_mx_block16"):
        v4 = ba.make_pool(dt, rows)
        pts = [("gluon_default", None, {}), ("triton", None, {"gluon": False}),
               ("cp_async_sub1", None, old), ("tma_sub1", None, {"tma": True, "sub": 1})]  # fmt: skip
        if dt == "nvfp4":
            pts += [
                ("loads_only", None, {"ablate": 1, "num_splits": 3}),
                ("loads_only_cp_async_sub1", None, {"ablate": 1, "num_splits": 3, **old}),
                ("st4", None, {"stages": 4, "num_splits": 3}),
                ("st2", None, {"stages": 2, "num_splits": 3}),
                ("sp4", None, {"num_splits": 4}),
                ("sp2", None, {"num_splits": 2}),
            ]
        point(v4, 64, 8192, 16, pts)
        if dt == "nvfp4":
            for b, ctx, page in ((64, 8192, 64), (128, 4096, 16), (16, 8192, 16), (1, 32768, 16),
                                 (1, 1024, 16), (4, 32768, 16)):  # fmt: skip
                pts = [("gluon_default", None, {}), ("cp_async_sub1", None, old),
                       ("tma_sub1", None, {"tma": True, "sub": 1})]  # fmt: skip
                point(v4, b, ctx, page, pts)
        del v4
    rec(tag="sdpa_end", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)


def depth_main():
    """Run 9, call 4: ring stages x tiles per stage at several batch shapes (TMA on). ``sub``
    allows two tiles a stage; the planner may still pick one (the record's ``block_n``; call 4
    predates that rule and forced the option). On fp4_mx_block16 call 4's ``stages`` set
    nvfp4's entry only (its rows all ran 3 stages)."""
    rec(tag="sdpa_start", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)
    rows = 64 * 8192 + 4096
    combos = [("sub1_st3", 1, 3), ("sub1_st2", 1, 2), ("sub2_st2", 2, 2), ("sub2_st3", 2, 3)]
    for dt in ("nvfp4", "fp4_mx_block16"):
        v4 = ba.make_pool(dt, rows)
        shapes = [(64, 8192, 16)]
        if dt == "nvfp4":
            shapes += [(128, 4096, 16), (16, 8192, 16), (4, 32768, 16), (1, 32768, 16), (1, 1024, 16),
                       (16, 1024, 16)]  # fmt: skip
        for b, ctx, page in shapes:
            pts = [(t, None, {"sub": u, "stages": st}) for t, u, st in combos]
            if b == 64 and dt == "nvfp4":
                pts += [("sub2_st2_sp4", None, {"sub": 2, "stages": 2, "num_splits": 4}),
                        ("sub2_st2_sp2", None, {"sub": 2, "stages": 2, "num_splits": 2}),
                        ("sub1_st2_loads", None, {"sub": 1, "stages": 2, "ablate": 1}),
                        ("sub2_st2_loads", None, {"sub": 2, "stages": 2, "ablate": 1})]  # fmt: skip
            point(v4, b, ctx, page, pts)
        del v4
    rec(tag="sdpa_end", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)


def small_main():
    """Run 10: the FP4 Gluon kernel at B=1 (32k, 8k) with loads only (``ablate=1``: TMA data
    tiles and scale rows arrive, no math) against the full kernel, at the planner's split
    count and at 64 and 256 splits; the merge runs in every point."""
    for dt in ("nvfp4", "fp4_mx_block16"):
        v4 = ba.make_pool(dt, 32768 + 4096)
        for ctx in (32768, 8192):
            pts = [("default", None, {}), ("loads_only", None, {"ablate": 1})]
            for sp in (64, 256):
                pts += [(f"sp{sp}", None, {"num_splits": sp}),
                        (f"sp{sp}_loads_only", None, {"num_splits": sp, "ablate": 1})]  # fmt: skip
            point(v4, 1, ctx, 16, pts)
        del v4


def headmajor_main():
    """Run 10: a head-major FP4 page layout emulated for the shipped TMA ring, B=64/8k.

    As ``probe_loads.per_head``: the token-major buffer ``[rows, H, 64 B]`` read as
    ``[rows * H, 1, 64 B]`` by B x H one-head requests, so a 16-row TMA box is 1 KiB of
    contiguous bytes. The ring needs 16-byte scale rows, so the emulated block scales sit in
    rows padded from 8 to 16 bytes: the DRAM sectors then carry 8 more bytes per 64-byte data
    row than the real layout would (72 -> 80 bytes, +11%), which counts against the emulation.
    ``attention._check_view`` (scales must be contiguous) is bypassed for those points only.
    Same process: the shipped token-major kernel, full and loads only (``ablate=1``)."""
    rec(tag="sdpa_start", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)
    rows = 64 * 8192 + 4096
    v4 = ba.make_pool("nvfp4", rows)
    for sp in (None,):
        kw = {} if sp is None else {"num_splits": sp}
        point(v4, 64, 8192, 16, [(f"token_major_sp{sp}", None, kw),
                                 (f"token_major_loads_sp{sp}", None, {**kw, "ablate": 1})])  # fmt: skip
    ph = probe_loads.per_head(v4)
    r = ph.k.shape[0]
    pads = []
    for t in (ph.k_block_scale, ph.v_block_scale):
        pad = torch.zeros(r, 1, 16, dtype=torch.uint8, device="cuda")
        pad[:, :, :8] = t.view(torch.uint8)
        # strides (16, 8, 1): a head's 8 scale bytes contiguous, as _gluon_unfit checks
        pads.append(pad.as_strided((r, 1, 8), (16, 8, 1)).view(torch.float8_e4m3fn))
    hm = ba.LayerView(**{**ph.__dict__, "k_block_scale": pads[0], "v_block_scale": pads[1]})
    # (plan_decode and decode each hold _check_view: patch both modules)
    check = attention._check_view
    attention.plans._check_view = attention.launch_decode._check_view = lambda view: None
    try:
        for sp in (3,):
            kw = {"num_splits": sp, "gluon": True}
            pts = [(f"head_major_sp{sp}", None, kw),
                   (f"head_major_loads_sp{sp}", None, {**kw, "ablate": 1})]  # fmt: skip
            point(hm, 64 * ba.HK, 8192, 16, pts, hq=ba.HQ // ba.HK)
    finally:
        attention.plans._check_view = attention.launch_decode._check_view = check
    rec(tag="sdpa_end", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)


# register caps per dtype (ptxas ``.maxnreg``) that compile without spills or with 8 bytes of
# stack (Triton 3.6, sm_90, offline): nvfp4 140 registers uncapped, 128 none, 120 8 B; mx the
# same; e5m2 138, 128 and 120 none; e4m3 128, 112 none
CAPS = {"nvfp4": (128, 120), "fp4_mx_block16": (128, 120), "fp8_e5m2": (128, 120),
        "fp8_e4m3": (112, 120)}  # fmt: skip


def regs_main():
    """Run 11: register caps on the Gluon kernels, so more one-warp programs share a
    multiprocessor (65,536 registers / (32 x cap): 128 -> 16, 120 -> 17, 112 -> 18; uncapped
    nvfp4 144 -> 14). At B=64/8k a split is 512 programs (3 splits: 11.6 per SM, 4: 15.5), so
    a cap pays only with the split count that fills the room; ``per_sm`` is the planner's
    model. Default first and again last at B=64/8k (drift); other shapes default vs capped."""
    rec(tag="sdpa_start", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)
    rows = 64 * 8192 + 4096
    for dt in ("nvfp4", "fp4_mx_block16", "fp8_e5m2", "fp8_e4m3"):
        v = ba.make_pool(dt, rows)
        pts = [("default", None, {})]
        for cap in CAPS[dt]:
            per = 65536 // (32 * cap)
            for sp in (3, 4):
                pts.append(
                    (f"r{cap}_sp{sp}", None, {"maxnreg": cap, "per_sm": per, "num_splits": sp})
                )
            pts.append((f"r{cap}_plan", None, {"maxnreg": cap, "per_sm": per}))
        if dt == "nvfp4":
            pts += [("loads_only_sp3", None, {"ablate": 1, "num_splits": 3}),
                    ("r128_loads_only_sp4", None, {"ablate": 1, "maxnreg": 128, "per_sm": 16,
                                                  "num_splits": 4})]  # fmt: skip
        pts.append(("default_again", None, {}))
        point(v, 64, 8192, 16, pts)
        cap = CAPS[dt][0]
        capped = {"maxnreg": cap, "per_sm": 65536 // (32 * cap)}
        point(
            v,
            64,
            8192,
            64,
            [("default", None, {}), (f"r{cap}_sp4", None, {**capped, "num_splits": 4})],
        )
        for b, ctx in ((128, 4096), (32, 8192), (16, 8192), (4, 32768), (1, 32768)):
            point(v, b, ctx, 16, [("default", None, {}), (f"r{cap}_plan", None, capped)])
        del v
    rec(tag="sdpa_end", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)


def streams_main():
    """Run 11: how the FP4 kernel's time at B=64/8k moves with the number of concurrent
    programs (512 per split; 1 split: 3.9 per SM, 6: 23 over two waves), full kernel and loads
    only (``ablate=1``), beside a bare read of the same bytes through the same harness."""
    rec(tag="sdpa_start", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)
    v4 = ba.make_pool("nvfp4", 64 * 8192 + 4096)
    kvb = 64 * 8192 * ba.bytes_per_token("nvfp4")
    rec(tag="bare_read", dtype="nvfp4", B=64, ctx=8192, us=ba.bare_read_ms(kvb, 25) * 1e3)
    for page, splits in ((16, (1, 2, 3, 4, 6)), (64, (2, 3))):
        pts = []
        for sp in splits:
            pts += [(f"sp{sp}", None, {"num_splits": sp}),
                    (f"sp{sp}_loads_only", None, {"num_splits": sp, "ablate": 1})]  # fmt: skip
        point(v4, 64, 8192, page, pts)
    rec(tag="sdpa_end", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)


def main():
    if os.environ.get("STREAMS"):
        return streams_main()
    if os.environ.get("REGS"):
        return regs_main()
    if os.environ.get("HEADMAJOR"):
        return headmajor_main()
    if os.environ.get("SMALL"):
        return small_main()
    if os.environ.get("LOADS"):
        return loads_main()
    if os.environ.get("DEPTH"):
        return depth_main()
    rec(tag="sdpa_start", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)
    rows = 64 * 8192 + 4096
    v4 = ba.make_pool("nvfp4", rows)
    g = {"gluon": True}
    if os.environ.get("SWEEP"):  # call 5: ring depth x splits, and a head-major layout emulated
        pts = [("triton", None, {"gluon": False})]
        for st in (0, 3, 4, 6):
            for sp in (3, 4, 6):
                pts.append(("gluon_head_fast", (1, 1), {**g, "num_splits": sp, "stages": st}))
        point(v4, 64, 8192, 16, pts)
        # a head-major page layout ([pages, H, page_size, bytes]: one head's page contiguous),
        # emulated as in probe_loads.per_head: 512 one-head requests
        ph = probe_loads.per_head(v4)
        pts = []
        for st in (0, 4):
            pts.append(("per_head_layout", (1, 1), {**g, "num_splits": 3, "stages": st}))
            pts.append(
                (
                    "per_head_layout_loads_only",
                    (1, 1),
                    {**g, "num_splits": 3, "stages": st, "ablate": 1},
                )
            )
        point(ph, 64 * ba.HK, 8192, 16, pts, hq=ba.HQ // ba.HK)
    # the shipped defaults (plan_decode's choice) against the Triton kernel, and loads only
    pts = [
        ("triton", None, {"gluon": False}),
        ("gluon_default", None, {}),
        ("gluon_loads_only", None, {"ablate": 1, "stages": 3, "num_splits": 3}),
    ]
    point(v4, 64, 8192, 16, pts)
    for b, ctx in ((128, 4096), (16, 8192), (16, 32768), (2, 32768), (1, 32768)):
        pts = [("triton", None, {"gluon": False}), ("gluon_default", None, {"gluon": True})]
        point(v4, b, ctx, 64 if b == 128 else 16, pts)
    del v4
    v8 = ba.make_pool("fp8_e4m3", rows)
    point(v8, 64, 8192, 16, [("gluon_fp8", None, {})])
    del v8
    rec(tag="sdpa_end", B=64, ctx=8192, us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)


if __name__ == "__main__":
    main()
