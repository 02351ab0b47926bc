"""FlashInfer beside the grid of ``bench_grid.py`` (``--flashinfer``), guarded point by point.

What runs (FlashInfer 0.7, PyPI ``flashinfer-python``; its kernels JIT-compile with nvcc on
first use, one module per head_dim / KV dtype / variant, cached under ``~/.cache/flashinfer``):

- GQA layers: ``BatchDecodeWithPagedKVCacheWrapper`` (NHD, CUDA-graph mode, tensor cores for
  query groups > 4 as vLLM chooses) over the *same* paged cache kvpool reads (``[pages, page,
  heads, head_dim]`` views of the layer's K/V), bf16 and fp8_e4m3 KV (``k_scale`` / ``v_scale``
  per tensor), the layer's window (``window_left = window - 1``), soft-cap, and sinks where its
  ``run`` takes them (else without, noted in the record).
- MLA layers: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` on contiguous copies of the
  latent's two parts (``ckv [pages, page, 512]``, ``kpe [pages, page, 64]``), bf16 and fp8
  (``ckv_scale`` / ``kpe_scale``: the latent's per-tensor scale), DeepSeek's softmax scale.

A new JIT module is not started with less than twice its estimated compile time of the
budget left. Timing as kvpool's (CUDA graph replays, L2 flushed, median); where capture fails, eager
launches (``flashinfer_graph: false``). Records go to ``<out>/flashinfer.json``, one per (model,
tp, layer, dtype, page, B, L): ``flashinfer_ms``, ``flashinfer_jit_s`` (first call: JIT and
load), or ``flashinfer_error``. A module whose JIT failed is not retried at the other points;
where flashinfer is missing one record says why. ``grid_report.py`` joins them to models.json.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback

KV_DTYPES = ("bf16", "fp8_e4m3")
_STATE: dict = {}


def setup(bench, store_path: str) -> str | None:
    """Import flashinfer; None when it can run, else the reason (also stored)."""
    _STATE.update(path=store_path, records=[], failed={}, compiled=set())
    if os.path.exists(store_path):
        with open(store_path) as f:
            _STATE["records"] = json.load(f)
    why = None
    if bench.quick:
        why = "flashinfer needs CUDA (--quick runs on the CPU)"
    else:
        try:
            import flashinfer

            _STATE["version"] = flashinfer.__version__
        except Exception as e:  # noqa: BLE001  (missing, or its import fails: say so, go on)
            why = f"import flashinfer failed: {e!r}"[:400]
    _STATE["why"] = why
    if why:
        _save(dict(model="*", error=why))
        print(why, flush=True)
    return why


def _save(rec: dict) -> None:
    _STATE["records"].append(rec)
    tmp = _STATE["path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_STATE["records"], f, indent=1)
    os.replace(tmp, _STATE["path"])


def done_keys() -> set:
    from bench_grid import rec_key

    return {rec_key(r) for r in _STATE.get("records", []) if "B" in r}


def run(bench, lays, dtypes, shapes, args, t0) -> None:
    """FlashInfer at every point of ``lays`` x its KV dtypes x pages x shapes not yet stored."""
    import bench_grid as bg
    import bench_models as bm
    import torch

    if _STATE.get("why"):
        return
    done = done_keys()
    for lay in lays:
        for dtype in [d for d in dtypes if d in KV_DTYPES]:
            todo = [(p, b, n) for p in bg.pages_of(lay) for b, n in shapes
                    if bg.rec_key(dict(model=lay.label, tp=lay.tp, layer=lay.layer, dtype=dtype,
                                       page=p, B=b, L=n)) not in done]  # fmt: skip
            if not todo:
                continue
            rows = max(b * n for b, n in shapes) + 64
            view = bm.random_view(dtype, rows, lay.hk, lay.d, bench.dev, lay.mla)
            for page, b, n in todo:
                if time.time() - t0 > args.budget_s:
                    bm.log(f"budget of {args.budget_s} s spent: stopping FlashInfer")
                    return
                rec = dict(model=lay.label, tp=lay.tp, layer=lay.layer, dtype=dtype, page=page,
                           B=b, L=n, flashinfer_version=_STATE.get("version"))  # fmt: skip
                mod = bg.fi_module(lay, dtype)
                left = args.budget_s - (time.time() - t0)
                if mod not in _STATE["compiled"] and left < 2 * bg.EST_FI_JIT_S:
                    bm.log(f"{left:.0f} s left: no new FlashInfer JIT started (run again)")
                    return
                if mod in _STATE["failed"]:
                    rec["flashinfer_error"] = "same module failed before: " + _STATE["failed"][mod]
                else:
                    try:
                        rec.update(point(bench, view, lay, dtype, page, b, n))
                        _STATE["compiled"].add(mod)
                    except Exception as e:  # noqa: BLE001  (JIT or launch failed: record it)
                        traceback.print_exc()
                        rec["flashinfer_error"] = repr(e)[:400]
                        _STATE["failed"][mod] = repr(e)[:200]
                for r in bg.alias_records(lay, rec):
                    _save(r)
                bm.log(json.dumps(rec))
            del view
            torch.cuda.empty_cache()


def _time(bench, fn) -> tuple[float, bool]:
    try:
        return bench.time_ms(fn), True
    except Exception:  # noqa: BLE001  (capture refused: eager launches)
        import torch

        torch.cuda.synchronize()
        return bench.ba.time_ms(fn, bench.reps, graph=False)[0], False


def point(bench, view, lay, dtype, page, b, n) -> dict:
    """One FlashInfer timing on the layer's cache (see the module docstring)."""
    import bench_models as bm
    import flashinfer
    import torch

    dev = bench.dev
    pages = n // page
    gen = torch.Generator().manual_seed(b * 7 + n)  # the page table kvpool_point draws
    pt = bm.page_table(b, n, page, view.k.shape[0], gen, dev)
    indices = pt.reshape(-1).contiguous()
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * pages
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    kvdt = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
    out = {}
    if lay.mla:
        rank = lay.rank
        qo = torch.arange(b + 1, dtype=torch.int32, device=dev)
        kv_len = torch.full((b,), n, dtype=torch.int32, device=dev)
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            ws, use_cuda_graph=True, qo_indptr=qo, kv_indptr=indptr, kv_indices=indices,
            kv_len_arr=kv_len,
        )  # fmt: skip
        w.plan(qo, indptr, indices, kv_len, lay.hq, rank, lay.d - rank, page, False,
               bm.MLA_SCALE, torch.bfloat16, kvdt)  # fmt: skip
        lat = view.k.view(-1, page, lay.d)
        ckv, kpe = lat[..., :rank].contiguous(), lat[..., rank:].contiguous()
        q_nope = torch.randn(b, lay.hq, rank, device=dev).to(torch.bfloat16)
        q_pe = torch.randn(b, lay.hq, lay.d - rank, device=dev).to(torch.bfloat16)

        # fp8 KV: FlashInfer 0.7.4 requires the per-tensor dequantization scales of both
        # parts (ckv_scale, kpe_scale; one scale for the whole latent row here)
        kw = {} if dtype == "bf16" else dict(ckv_scale=float(view.k_scale),
                                              kpe_scale=float(view.k_scale))  # fmt: skip

        def fn():
            return w.run(q_nope, q_pe, ckv, kpe, **kw)

        flops = 2 * b * lay.hq * n * (lay.d + rank)
    else:
        last = torch.full((b,), page, dtype=torch.int32, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=lay.hq // lay.hk > 4,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last,
        )  # fmt: skip
        win = lay.opts.get("window")
        w.plan(indptr, indices, last, lay.hq, lay.hk, lay.d, page, q_data_type=torch.bfloat16,
               kv_data_type=kvdt, window_left=win - 1 if win else -1,
               logits_soft_cap=lay.opts.get("softcap"), sm_scale=1 / math.sqrt(lay.d))  # fmt: skip
        k = view.k.view(-1, page, lay.hk, lay.d)
        v = view.v.view(-1, page, lay.hk, lay.d)
        q = torch.randn(b, lay.hq, lay.d, device=dev).to(torch.bfloat16)
        kw = {}
        if dtype != "bf16":
            kw = dict(k_scale=float(view.k_scale), v_scale=float(view.v_scale))
        if lay.opts.get("sinks"):
            sinks = torch.randn(lay.hq, device=dev)
            try:
                w.run(q, (k, v), sinks=sinks, **kw)
                kw["sinks"] = sinks
            except Exception as e:  # noqa: BLE001
                out["flashinfer_note"] = f"run(sinks=) refused ({e!r:.120}): timed without sinks"

        def fn():
            return w.run(q, (k, v), **kw)

        flops = None
    t = time.time()
    fn()
    torch.cuda.synchronize()
    out["flashinfer_jit_s"] = round(time.time() - t, 2)
    ms, graph = _time(bench, fn)
    out.update(flashinfer_ms=ms, flashinfer_graph=graph,
               flashinfer_kernel="mla" if lay.mla else ("decode_tc" if lay.hq // lay.hk > 4
                                                         else "decode"))  # fmt: skip
    if flops:
        out["flashinfer_tflops"] = flops / ms / 1e9
    return out
