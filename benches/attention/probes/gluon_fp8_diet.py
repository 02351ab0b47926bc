"""Run 8, call 9: the fp8 Gluon decode with the addressing of the nvfp4 kernel, one device call.

``attention._GLUON_FP8_OPTIONS`` = (PAGED: one page id per 16-aligned tile and 32-bit lane offsets
instead of a page id and a 64-bit row product per token; RESCALE: lazy softmax rescale threshold,
< 0 = every tile; HEAD_FAST: KV head fastest in the grid). ``(False, -1.0, False)`` is the
addressing of run 7 (with rows past the end clamped instead of masked). B=64/8k, page 16,
Llama-3.1-8B geometry, bench_attention's harness (CUDA graph, L2 flushed, median of 25); SDPA on
contiguous bf16 at the start and at the end of the process.

    OUT=dir python benches/attention/probes/gluon_fp8_diet.py
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "benches/attention"))
import bench_attention as ba  # noqa: E402
import torch  # noqa: E402
from kvpool import attention  # noqa: E402

OUT = os.environ.get("OUT", ".")
RES = []
DEFAULT = dict(attention._GLUON_FP8_OPTIONS)


def rec(**r):
    RES.append(r)
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "gluon_fp8_diet.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": RES}, f, indent=1)


def main():
    rec(tag="sdpa_start", us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)
    b, ctx, page = 64, 8192, 16
    for dtype in ("fp8_e4m3", "fp8_e5m2"):
        view = ba.with_page(ba.make_pool(dtype, b * ctx + 4096), page)
        gen = torch.Generator().manual_seed(7)
        pt = ba.page_table(b, ctx, page, view.k.shape[0], gen)
        sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        sl[0] = ctx - 5
        q = torch.randn(b, ba.HQ, ba.D, dtype=torch.bfloat16, device="cuda")
        ref = None
        variants = [
            (False, -1.0, False),
            (True, -1.0, False),
            (True, 8.0, False),
            (True, -1.0, True),
            (True, 8.0, True),
        ]
        for knobs in variants:
            for splits in (3, 4):
                attention.variants._GLUON_FP8_OPTIONS = {**DEFAULT, dtype: knobs}
                try:
                    plan = attention.plan_decode(view, ba.HQ, pt, sl, num_splits=splits, gluon=True)
                    out = torch.empty(b, ba.HQ, ba.D, dtype=torch.bfloat16, device="cuda")
                    attention.decode(view, q, plan=plan, out=out)
                    ms, _ = ba.time_ms(
                        lambda p=plan, o=out, v=view, qq=q: attention.decode(v, qq, plan=p, out=o),
                        25,
                    )
                    ref = out.clone() if ref is None else ref
                    rec(
                        tag="gluon",
                        dtype=dtype,
                        knobs=knobs,
                        splits=splits,
                        us=ms * 1e3,
                        maxdiff=float((out.float() - ref.float()).abs().max()),
                    )
                except Exception as e:  # noqa: BLE001
                    rec(tag="gluon", dtype=dtype, knobs=knobs, splits=splits, error=repr(e)[:300])
        attention.variants._GLUON_FP8_OPTIONS = dict(DEFAULT)
        del view
    rec(tag="sdpa_end", us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)


def defaults():
    """Call 10: ``plan_decode``'s default plans for the Gluon dtypes after run 8's changes, with
    SDPA on contiguous bf16 at each shape (``DEFAULTS=1``)."""
    out_file = os.path.join(OUT, "gluon_defaults.json")
    ba.OUT = OUT  # (bench_decode also appends to OUT/attention.json)
    res = []
    shapes = [(64, 8192, 16), (64, 8192, 64), (128, 4096, 16), (16, 8192, 16), (1, 32768, 16)]
    sdpa = {(b, ctx): ba.bench_sdpa(b, ctx, 25)["ms"] for b, ctx, _ in shapes}
    for dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4"):
        pool = ba.make_pool(dtype, 64 * 8192 + 4096)
        for b, ctx, page in shapes:
            r = ba.bench_decode(pool, b, ctx, page, 25)
            r = {k: r[k] for k in r if isinstance(r[k], (int, float, str, bool))}
            r.update(sdpa_ms=sdpa[(b, ctx)], x_sdpa=sdpa[(b, ctx)] / r["ms"])
            res.append(r)
            print(json.dumps(r), flush=True)
            with open(out_file, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "results": res}, f, indent=1)
        del pool


def e5m2_ring():
    """Call 12: e5m2 with the cp.async ring (3 stages, 137+ registers) against its register
    prefetch, both with 3 splits (``E5M2_RING=1``)."""
    res = []
    pool = ba.make_pool("fp8_e5m2", 64 * 8192 + 4096)
    sdpa = ba.bench_sdpa(64, 8192, 25)["ms"]
    for cfg in ((0, 12, None), (3, 12, None), (0, 12, None)):
        attention._GLUON_CONFIG["fp8_e5m2"] = cfg
        attention.clear_plan_memo()  # (plans made before the edit are not reused)
        r = ba.bench_decode(pool, 64, 8192, 16, 25)
        r = {k: v for k, v in r.items() if isinstance(v, (int, float, str, bool))}
        r.update(config=cfg, sdpa_ms=sdpa, x_sdpa=sdpa / r["ms"])
        res.append(r)
        print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "gluon_e5m2_ring.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": res}, f, indent=1)


if __name__ == "__main__":
    if os.environ.get("E5M2_RING"):
        e5m2_ring()
    elif os.environ.get("DEFAULTS"):
        defaults()
    else:
        main()
