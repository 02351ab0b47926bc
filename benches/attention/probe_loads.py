"""What limits the fused decode at B=64/8k: three probes of the load structure (run 7, H200).

Each probe changes one thing in the shipped kernel (``probes/variants.py`` patches
``triton_kernels/decode.py`` at run time; ``probes/tma_decode.py`` is a separate fp8 kernel)
and is timed in the same process as the shipped kernel, with ``bench_attention``'s harness
(CUDA graph, L2 flushed before each of 25 repetitions, median). ``ablate=3`` = raw loads only.

- ``locality``: program order with the KV head fastest (``head_fast``), and a per-head page
  layout emulated without new code: the token-major buffer ``[rows, H, D]`` read as
  ``[rows*H, 1, D]`` with ``B*H`` requests of one KV head each (every page of one head then is
  ``page_size * D`` contiguous bytes, as in a ``[pages, H, page_size, D]`` layout).
- ``tma``: fp8 tiles as TMA boxes (host tensor descriptors; ``BN`` = tile tokens, ``NS`` = stages).
- ``ring``: page ids one tile ahead (``page_ahead``) so ``num_stages`` deepens the cp.async
  ring; 16- and 32-token tiles, splits from the planner or 4.

SDPA on contiguous bf16 is timed at the start and at the end of the run (it moved 10% between
calls of one session; ratios use the end value, after the GPU has been busy).

    python benches/attention/probe_loads.py --out DIR [--probes locality,tma,ring]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "probes"))

import bench_attention as ba  # noqa: E402
import variants  # noqa: E402
from kvpool import attention  # noqa: E402
from kvpool.pool import LayerView  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "kvpool_probe_tma", HERE / "probes" / "tma_decode.py"
)
tma = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tma)

RES: list[dict] = []
OUT = "."


def rec(**r):
    RES.append(r)
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "probe_loads.json"), "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "triton": __import__("triton").__version__,
                "results": RES,
            },
            f,
            indent=1,
        )


def per_head(view: LayerView) -> LayerView:
    """The same bytes read as one KV head per row (see the module docstring)."""
    r = view.k.shape[0] * view.num_kv_heads
    kb, vb = view.k_block_scale, view.v_block_scale
    if kb is not None:
        kb, vb = (
            (kb.reshape(r, -1), vb.reshape(r, -1))
            if kb.dim() == 2
            else (kb.reshape(r, 1, -1), vb.reshape(r, 1, -1))
        )
    return LayerView(
        **{
            **view.__dict__,
            "num_kv_heads": 1,
            "k": view.k.reshape(r, 1, -1),
            "v": view.v.reshape(r, 1, -1),
            "k_block_scale": kb,
            "v_block_scale": vb,
        }
    )


def case(view, b, ctx, page, hq, seed_q=0):
    gen = torch.Generator().manual_seed(b * 7 + ctx)
    pv = ba.with_page(view, page)
    pt = ba.page_table(b, ctx, page, pv.k.shape[0], gen)
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    sl[0] = ctx - 5  # one request ends mid-tile
    g = torch.Generator(device="cuda").manual_seed(seed_q)
    q = torch.randn(b, hq, ba.D, dtype=torch.bfloat16, device="cuda", generator=g)
    return pv, pt, sl, q


def shipped_point(pv, pt, sl, q, ctx, tag, variant="shipped", ref=None, **kw):
    variants.use(variant)
    try:
        plan = attention.plan_decode(pv, q.shape[1], pt, sl, max_seq_len=ctx, **kw)
        out = torch.empty(q.shape[0], q.shape[1], ba.D, dtype=torch.bfloat16, device="cuda")
        attention.decode(pv, q, plan=plan, out=out)
        ms, _ = ba.time_ms(lambda: attention.decode(pv, q, plan=plan, out=out), 25)
        err = None if ref is None else float((out.float() - ref.float()).abs().max())
        rec(
            probe=tag,
            variant=variant,
            dtype=pv.dtype,
            B=q.shape[0],
            ctx=ctx,
            page=pv.page_size,
            kv_heads=pv.num_kv_heads,
            plan=kw,
            splits=plan.num_splits,
            block_n=plan.block_n,
            stages=plan.num_stages,
            us=ms * 1e3,
            maxdiff_vs_shipped=err,
        )
        return out
    finally:
        variants.use("shipped")


def tma_decode(view, q, plan, out, bn, ns, words, ablate=0):
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, hq, d = q.shape
    hk, rows = view.num_kv_heads, view.k.shape[0]
    if words:
        k2 = view.k.view(torch.uint8).view(torch.int32).reshape(rows, hk * d // 4)
        v2 = view.v.view(torch.uint8).view(torch.int32).reshape(rows, hk * d // 4)
        blk = [bn, d // 4]
    else:
        k2, v2, blk = view.k.reshape(rows, hk * d), view.v.reshape(rows, hk * d), [bn, d]
    s = plan.num_splits
    tma.tma_decode_kernel[(b, hk, s)](
        q,
        TensorDescriptor.from_tensor(k2, blk),
        TensorDescriptor.from_tensor(v2, blk),
        view.k,
        view.v,
        view.k_scale,
        view.v_scale,
        plan.page_table,
        plan.seq_lens,
        out,
        plan.part_out if s > 1 else out,
        plan.part_lse if s > 1 else out,
        q.stride(0),
        q.stride(1),
        view.k.stride(0),
        view.v.stride(0),
        plan.page_table.stride(0),
        out.stride(0),
        out.stride(1),
        d**-0.5,
        s,
        PSHIFT=view.page_size.bit_length() - 1,
        G=hq // hk,
        GP=max(4, hq // hk),
        D=d,
        DV=d,
        BN=bn,
        FINAL=s == 1,
        NS=ns,
        ABLATE=ablate,
        WORDS=words,
        num_warps=1,
        num_stages=ns,
    )
    if s > 1:
        variants.shipped.merge_kernel[(b, hq)](
            plan.part_out,
            plan.part_lse,
            out,
            view.v_scale,
            out,
            out.stride(0),
            out.stride(1),
            hq,
            s,
            DV=d,
            SP=max(16, 1 << (s - 1).bit_length()),
            HAS_SCALE=True,
            FP4_MUL=1.0,
            HAS_SINKS=False,
            num_warps=4,
        )
    return out


def probe_locality(rows):
    for dtype in ("fp8_e4m3", "nvfp4", "bf16"):
        view = ba.make_pool(dtype, rows)
        ph = per_head(view)
        for page in (16, 64) if dtype == "fp8_e4m3" else (16,):
            for ablate in (0, 3):
                kw = {"ablate": ablate} if ablate else {}
                pv, pt, sl, q = case(view, 64, 8192, page, 32)
                ref = shipped_point(pv, pt, sl, q, 8192, "locality", **kw)
                shipped_point(
                    pv, pt, sl, q, 8192, "locality", "head_fast", ref=None if ablate else ref, **kw
                )
                pv1, pt1, sl1, q1 = case(ph, 512, 8192, page, 4)
                shipped_point(pv1, pt1, sl1, q1, 8192, "locality_per_head_layout", **kw)
        del view, ph
        torch.cuda.empty_cache()


def probe_tma(rows):
    view = ba.make_pool("fp8_e4m3", rows)
    for (b, ctx), page in (((64, 8192), 16), ((64, 8192), 64), ((16, 8192), 16), ((1, 32768), 16)):
        pv, pt, sl, q = case(view, b, ctx, page, 32)
        ref = shipped_point(pv, pt, sl, q, ctx, "tma")
        plan = attention.plan_decode(pv, 32, pt, sl, max_seq_len=ctx)
        for bn, ns, words in itertools.product((16, 32, 64), (2, 3, 4), (True, False)):
            if bn > page or (not words and ns != 3) or (b != 64 and (bn > 16 or ns == 4)):
                continue
            o = torch.empty_like(ref)
            tma_decode(pv, q, plan, o, bn, ns, words)
            err = float((o.float() - ref.float()).abs().max())
            ms, _ = ba.time_ms(functools.partial(tma_decode, pv, q, plan, o, bn, ns, words), 25)
            rec(
                probe="tma",
                variant="tma",
                dtype="fp8_e4m3",
                B=b,
                ctx=ctx,
                page=page,
                block_n=bn,
                stages=ns,
                words=words,
                splits=plan.num_splits,
                us=ms * 1e3,
                maxdiff_vs_shipped=err,
            )
            if b == 64 and ns == 3 and words:
                run = functools.partial(tma_decode, pv, q, plan, o, bn, ns, words, ablate=3)
                ms, _ = ba.time_ms(run, 25)
                rec(
                    probe="tma",
                    variant="tma",
                    dtype="fp8_e4m3",
                    B=b,
                    ctx=ctx,
                    page=page,
                    block_n=bn,
                    stages=ns,
                    words=words,
                    plan={"ablate": 3},
                    us=ms * 1e3,
                )
    del view
    torch.cuda.empty_cache()


RING = {
    "fp8_e4m3": [
        {"num_stages": 3},
        {"num_stages": 4},
        {"block_n": 16, "num_stages": 3},
        {"block_n": 16, "num_stages": 4},
        {"block_n": 16, "num_stages": 3, "num_splits": 4},
    ],
    "nvfp4": [{"num_stages": 3}, {"num_stages": 4}],
    "fp4_mx_block16": [{"num_stages": 3}],
}


def probe_ring(rows):
    for dtype, cfgs in RING.items():
        view = ba.make_pool(dtype, rows)
        for b, ctx, page in ((64, 8192, 16), (64, 8192, 64), (16, 8192, 16), (1, 32768, 16)):
            if page == 64 and dtype != "fp8_e4m3":
                continue
            pv, pt, sl, q = case(view, b, ctx, page, 32)
            ref = shipped_point(pv, pt, sl, q, ctx, "ring")
            if dtype == "fp8_e4m3" and b > 1:
                shipped_point(pv, pt, sl, q, ctx, "ring", ref=ref, block_n=16)
            for kw in cfgs:
                kw = {k: v for k, v in kw.items() if b == 64 or k != "num_splits"}
                shipped_point(pv, pt, sl, q, ctx, "ring", "page_ahead", ref=ref, **kw)
        del view
        torch.cuda.empty_cache()


def main():
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--probes", default="locality,tma,ring")
    a = ap.parse_args()
    OUT = a.out
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    rec(probe="copy", TBps=ba.copy_bandwidth(20) / 1e12)
    for b, ctx in ((64, 8192), (1, 32768)):
        rec(probe="sdpa_start", B=b, ctx=ctx, us=ba.bench_sdpa(b, ctx, 25)["ms"] * 1e3)
    rows = 64 * 8192 + 64 * 64
    for p in a.probes.split(","):
        {"locality": probe_locality, "tma": probe_tma, "ring": probe_ring}[p](rows)
    for b, ctx in ((64, 8192), (1, 32768)):
        rec(probe="sdpa_end", B=b, ctx=ctx, us=ba.bench_sdpa(b, ctx, 25)["ms"] * 1e3)


if __name__ == "__main__":
    main()
