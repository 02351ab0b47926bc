"""The benchmark grid of issue 17: decode attention for one layer of every bundled model, per rank.

Grid (``GRID``): every model of ``python/kvpool/models`` at the TP size it is usually served
with (``USUAL_TP``; DeepSeek-V3/R1 also at TP 1 = 128 heads, Kimi-K2 at TP 1 = 64 and TP 8 = 8
heads), the per-rank geometry read from the bundled config (``ModelSpec``: query heads / TP, KV
heads per rank, head_dim; gemma-2's soft-capping, gpt-oss' sinks; the sliding layers of gemma-2
and gpt-oss as a second layer with their window). Models whose per-rank layer is the same (e.g.
Llama-3.1-8B and its Instruct, DeepSeek-V3 and R1) are timed once: their records are copies
with ``measured_as`` naming the timed one. Page 16 (MLA also 64), B x L in {1 x 32k, 16 x 8k,
64 x 8k, 128 x 4k}, every KV dtype the pool stores but fp32.

Harness: ``bench_models`` (CUDA graphs, L2 flushed before each of >= 25 replays, median;
baselines in the same process: SDPA on contiguous bf16 K/V, and for MLA the absorbed attention
as contiguous bf16 bmm -> fp32 softmax -> bmm). ``--flashinfer`` adds FlashInfer beside it
(``grid_flashinfer.py``: paged decode with bf16 and fp8 KV, its MLA decode), guarded: where
FlashInfer is missing or its JIT fails the record says why and the grid goes on.

Output ``<out>/models.json``: a list of records, one per (model, tp, layer, dtype, page, B, L),
rewritten after each point (a cut run keeps its points); a second run with the same ``--out``
skips the points already there (``--retry-errors`` redoes failed ones). Points whose buffers do
not fit ``--mem-gib`` (120) are recorded as ``skipped`` with the bytes they need.

    python bench_grid.py --out DIR --dry-run [--shard 0/2]   # the cases, estimated seconds
    python bench_grid.py --out DIR --shard 0/2 --budget-s 480  # device call 1 (call 2: 1/2)
    python bench_grid.py --out DIR --models deepseek-v3,kimi-k2 --dtypes bf16 --shapes 64x8192
    python bench_grid.py --out DIR --quick                     # CPU, tiny shapes, end to end
    python grid_report.py DIR                                  # RESULTS.md table + plot

Shards (``--shard i/n``) split the timed geometries so their estimated seconds balance; together
they cover the grid once. ``--models`` takes grid labels (``python bench_grid.py --list``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: hub id -> (grid label, usual TP sizes). The TP a model is usually served with on 8 x H200:
#: one GPU where the weights fit (<= 70 GB of bf16 or the shipped quantized weights), else the
#: serving recipes' sizes (Llama-3.1-70B: 8, Mixtral-8x7B: 2, Qwen3-Next-80B: 4 as in its model
#: card); DeepSeek and Kimi at TP 8 (one node) and TP 1 (all heads on one GPU).
USUAL_TP = {
    "deepseek-ai/DeepSeek-V3": ("deepseek-v3", (1, 8)),
    "deepseek-ai/DeepSeek-R1": ("deepseek-r1", (1, 8)),
    "moonshotai/Kimi-K2-Instruct": ("kimi-k2", (1, 8)),
    "openai/gpt-oss-120b": ("gpt-oss-120b", (1,)),
    "openai/gpt-oss-20b": ("gpt-oss-20b", (1,)),
    "google/gemma-2-9b-it": ("gemma-2-9b", (1,)),
    "Qwen/Qwen3.5-27B": ("qwen3.5-27b", (1,)),
    "Qwen/Qwen3.5-35B-A3B": ("qwen3.5-35b-a3b", (1,)),
    "Qwen/Qwen3-Next-80B-A3B-Thinking": ("qwen3-next-80b", (4,)),
    "meta-llama/Llama-3.1-8B": ("llama-3.1-8b", (1,)),
    "meta-llama/Llama-3.1-8B-Instruct": ("llama-3.1-8b-instruct", (1,)),
    "meta-llama/Llama-3.1-70B": ("llama-3.1-70b", (8,)),
    "meta-llama/Llama-3.1-70B-Instruct": ("llama-3.1-70b-instruct", (8,)),
    "Qwen/Qwen3-8B": ("qwen3-8b", (1,)),
    "Qwen/Qwen3-30B-A3B": ("qwen3-30b-a3b", (1,)),
    "Qwen/Qwen3-30B-A3B-FP8": ("qwen3-30b-a3b-fp8", (1,)),
    "Qwen/Qwen2.5-VL-7B-Instruct": ("qwen2.5-vl-7b", (1,)),
    "mistralai/Mixtral-8x7B-v0.1": ("mixtral-8x7b", (2,)),
}
DTYPES = ("bf16", "fp8_e4m3", "nvfp4", "fp8_e5m2", "fp4_mx_block16", "fp16")
SHAPES = ((1, 32768), (16, 8192), (64, 8192), (128, 4096))
QUICK_SHAPES = ((2, 128), (3, 64))
GIB = 1 << 30

# estimated seconds (H200 host; guesses checked against the wall_s the records carry)
EST_VIEW_S = 0.5  # random cache of one (geometry, dtype)
EST_COMPILE_S = 4.0  # kernels of one (geometry, dtype): split kernel(s) and merge
EST_POINT_S = 0.4  # plan, graph capture, 26 replays with flushes
EST_BASE_S = 0.4  # one baseline point
EST_FI_JIT_S = 45.0  # one FlashInfer JIT module (nvcc, 16 host cores)
EST_FI_POINT_S = 0.5


@dataclass
class Layer:
    """One timed layer geometry and the models (grid labels) that share it."""

    label: str  # grid label of the first model, plus "-tpN" past its first TP, "-sliding"
    tp: int
    layer: str  # "full", "sliding" or "mla"
    hq: int
    hk: int  # 0 for MLA
    d: int  # head_dim; MLA: kv_lora_rank + qk_rope_head_dim
    rank: int  # MLA kv_lora_rank (0 otherwise)
    opts: dict = field(default_factory=dict)
    models: list = field(default_factory=list)  # [(hub id, grid label)] sharing it

    @property
    def mla(self) -> bool:
        return self.hk == 0

    def key(self) -> tuple:
        return (self.hq, self.hk, self.d, self.rank, tuple(sorted(self.opts.items())))


def grid() -> list[Layer]:
    """The timed geometries, from the bundled configs (first model of a geometry names it)."""
    from kvpool.config import ModelSpec, bundled_models

    layers: dict[tuple, Layer] = {}
    missing = set(bundled_models()) ^ set(USUAL_TP)
    if missing:
        raise SystemExit(f"USUAL_TP and the bundled models differ: {sorted(missing)}")
    for hub, (name, tps) in USUAL_TP.items():
        s = ModelSpec.from_pretrained(hub)
        text = s.config.get("text_config", s.config)
        for tp in tps:
            hq = s.num_attention_heads // tp
            label = name if tp == tps[0] else f"{name}-tp{tp}"  # deepseek-v3, deepseek-v3-tp8
            if s.is_mla:
                kinds = [("mla", 0, s.kv_lora_rank + s.qk_rope_head_dim, s.kv_lora_rank, {})]
            else:
                hk = s.geometry(tp).kv_heads_per_rank(tp)
                opts = {}
                if text.get("attn_logit_softcapping"):
                    opts["softcap"] = float(text["attn_logit_softcapping"])
                if text.get("model_type") == "gpt_oss":
                    opts["sinks"] = True
                kinds = [("full", hk, s.head_dim, 0, opts)]
                if "sliding" in s.layer_kinds:
                    kinds.append(
                        ("sliding", hk, s.head_dim, 0, {**opts, "window": s.sliding_window})
                    )
            for kind, hk, d, rank, opts in kinds:
                lab = label + ("-sliding" if kind == "sliding" else "")
                lay = Layer(lab, tp, kind, hq, hk, d, rank, opts)
                lay = layers.setdefault(lay.key() + (tp,), lay)
                lay.models.append((hub, lab))
    return list(layers.values())


def quick_layer(lay: Layer) -> Layer:
    """Tiny stand-in for ``--quick``: heads / 8 (>= 1 KV head, group kept), head_dim 32, MLA
    latent 32 + 16, window 16."""
    if lay.mla:
        return Layer(lay.label, lay.tp, lay.layer, max(2, lay.hq // 8), 0, 48, 32, {}, lay.models)
    g = lay.hq // lay.hk
    hk = max(1, lay.hk // 8)
    opts = {**lay.opts, **({"window": 16} if "window" in lay.opts else {})}
    return Layer(lay.label, lay.tp, lay.layer, hk * g, hk, 32, 0, opts, lay.models)


# ----------------------------------------------------------------------------- cases and budget


def pages_of(lay: Layer) -> tuple:
    return (16, 64) if lay.mla else (16,)


def bytes_per_token(lay: Layer, dtype: str) -> int:
    """Cache bytes per token of the layer (data + block scales), as ``bench_models`` sizes it."""
    vals = lay.d * (1 if lay.mla else 2 * lay.hk)
    if dtype in ("nvfp4", "fp4_mx_block16"):
        return vals // 2 + vals // 16
    return vals * (1 if dtype.startswith("fp8") else 2)


def need_bytes(lay: Layer, dtype: str, shapes) -> int:
    """GPU bytes of one (geometry, dtype): the paged cache sized for the largest B x L, the bf16
    contiguous baseline K/V (or latent) and query of the largest point, the L2 flush buffer."""
    rows = max(b * n for b, n in shapes) + 64
    b, n = max(shapes, key=lambda s: s[0] * s[1])
    base = b * n * lay.d * 2 * (1 if lay.mla else 2 * lay.hk)
    return rows * bytes_per_token(lay, dtype) + base + 256 * (1 << 20)


def fi_module(lay: Layer, dtype: str) -> tuple:
    """What FlashInfer JIT-compiles one module for (its URI's fields): head_dim, KV dtype, the
    tensor-core (prefill) path for groups > 4 as vLLM picks it, window, soft-cap; MLA: dtype."""
    if lay.mla:
        return ("mla", dtype)
    return (lay.d, dtype, lay.hq // lay.hk > 4, "window" in lay.opts, "softcap" in lay.opts)


def estimate_s(lays, dtypes, shapes, flashinfer: bool) -> float:
    t = 0.0
    modules = set()
    for lay in lays:
        t += len(shapes) * EST_BASE_S
        t += len(dtypes) * (EST_VIEW_S + EST_COMPILE_S)
        t += len(dtypes) * len(pages_of(lay)) * len(shapes) * EST_POINT_S
        if flashinfer:
            fi_dtypes = [d for d in dtypes if d in ("bf16", "fp8_e4m3")]
            modules |= {fi_module(lay, d) for d in fi_dtypes}
            t += len(fi_dtypes) * len(pages_of(lay)) * len(shapes) * EST_FI_POINT_S
    return t + len(modules) * EST_FI_JIT_S


def shard(lays, i: int, n: int, dtypes, shapes, flashinfer) -> list[Layer]:
    """Greedy split of the geometries into ``n`` shards of balanced estimated time; shard ``i``."""
    loads = [0.0] * n
    mine = [[] for _ in range(n)]
    est = {id(lay): estimate_s([lay], dtypes, shapes, flashinfer) for lay in lays}
    for lay in sorted(lays, key=lambda x: -est[id(x)]):
        j = loads.index(min(loads))
        loads[j] += est[id(lay)]
        mine[j].append(lay)
    order = {id(lay): k for k, lay in enumerate(lays)}
    return sorted(mine[i], key=lambda x: order[id(x)])


def rec_key(r: dict) -> tuple:
    return (r["model"], r["tp"], r.get("layer", "full"), r["dtype"], r.get("page", 16), r.get("B"),
            r.get("L"))  # fmt: skip


# ----------------------------------------------------------------------------- records


class Store:
    """``models.json``: loaded on start, rewritten (atomically) after every record."""

    def __init__(self, out: str, retry_errors: bool):
        self.path = os.path.join(out, "models.json")
        self.records = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.records = json.load(f)
        if retry_errors:
            self.records = [r for r in self.records if "error" not in r]
        self.done = {rec_key(r) for r in self.records}

    def add(self, rec: dict) -> None:
        self.records.append(rec)
        self.done.add(rec_key(rec))
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.records, f, indent=1)
        os.replace(tmp, self.path)


def alias_records(lay: Layer, rec: dict) -> list[dict]:
    """The record once per model sharing the geometry (``measured_as``: the timed label)."""
    out = []
    for hub, lab in lay.models:
        r = dict(rec, model=lab, hub_id=hub)
        if lab != lay.label:
            r["measured_as"] = lay.label
        out.append(r)
    return out


# ----------------------------------------------------------------------------- driver


def run_layer(bench, store, lay, dtypes, shapes, args, t0) -> bool:
    """Every point of one geometry; False once the budget is spent."""
    import bench_models as bm
    import torch

    todo = [
        (dtype, page, b, n)
        for dtype in dtypes
        for page in pages_of(lay)
        for b, n in shapes
        if any(
            rec_key(dict(model=lab, tp=lay.tp, layer=lay.layer, dtype=dtype, page=page, B=b, L=n))
            not in store.done
            for _, lab in lay.models
        )  # fmt: skip
    ]
    if not todo:
        return True
    base: dict = {}
    common = dict(tp=lay.tp, layer=lay.layer, q_heads=lay.hq, kv_heads=lay.hk, head_dim=lay.d)
    for dtype in dict.fromkeys(d for d, *_ in todo):
        need = need_bytes(lay, dtype, shapes)
        if need > args.mem_gib * GIB:
            for _, page, b, n in [t for t in todo if t[0] == dtype]:
                why = f"needs {need / GIB:.1f} GiB > --mem-gib {args.mem_gib}"
                for r in alias_records(lay, dict(common, dtype=dtype, page=page, B=b, L=n,
                                                 skipped=why)):  # fmt: skip
                    store.add(r)
                bm.log(f"skip {lay.label} {dtype} {b}x{n}: {why}")
            continue
        rows = max(b * n for b, n in shapes) + 64
        try:
            view = bm.random_view(dtype, rows, lay.hk, lay.d, bench.dev, lay.mla)
        except Exception as e:  # noqa: BLE001  (out of memory: record and go on)
            for _, page, b, n in [t for t in todo if t[0] == dtype]:
                for r in alias_records(lay, dict(common, dtype=dtype, page=page, B=b, L=n,
                                                 error=repr(e)[:300])):  # fmt: skip
                    store.add(r)
            continue
        for _, page, b, n in [t for t in todo if t[0] == dtype]:
            if time.time() - t0 > args.budget_s:
                bm.log(f"budget of {args.budget_s} s spent: stopping (run again to resume)")
                return False
            t1 = time.time()
            rec = dict(common, dtype=dtype, page=page, B=b, L=n)
            try:
                if (b, n) not in base:
                    base[(b, n)] = bm.baseline_ms(bench, lay.hq, lay.hk, lay.d, b, n, lay.mla)
                r = bm.kvpool_point(bench, view, lay.label, lay.tp, lay.hq, lay.opts, b, n, page)
                rec.update({k: r[k] for k in ("time_ms", "kv_bytes", "kv_TBps", "kernel",
                                              "splits", "tflops", "block_h", "block_n", "warps")
                            if k in r})  # fmt: skip
                rec.update(baseline_ms=base[(b, n)], ratio=base[(b, n)] / r["time_ms"],
                           baseline="torch_mla_bf16" if lay.mla else "sdpa_bf16",
                           options=sorted(lay.opts))  # fmt: skip
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rec["error"] = repr(e)[:300]
            rec["wall_s"] = round(time.time() - t1, 2)
            for r in alias_records(lay, rec):
                store.add(r)
            bm.log(json.dumps(rec))
        del view
        if not bench.quick:
            torch.cuda.empty_cache()
    return True


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--models", default="", help="grid labels (default: all; see --list)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES))
    ap.add_argument("--shard", default="0/1", help="i/n: the i-th of n balanced shards")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no point after")
    ap.add_argument("--mem-gib", type=float, default=120.0, help="skip points needing more")
    ap.add_argument("--flashinfer", action="store_true", help="FlashInfer beside kvpool")
    ap.add_argument("--retry-errors", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the cases and estimates only")
    ap.add_argument("--list", action="store_true", help="print the grid's geometries")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run at tiny sizes")
    args = ap.parse_args(argv)
    lays = grid()
    if args.models:
        want = set(args.models.split(","))
        unknown = want - {lab for lay in lays for _, lab in lay.models} - {x.label for x in lays}
        if unknown:
            raise SystemExit(f"unknown --models {sorted(unknown)} (see --list)")
        lays = [x for x in lays if x.label in want or any(lab in want for _, lab in x.models)]
    dtypes = args.dtypes.split(",")
    shapes = QUICK_SHAPES if args.quick else [tuple(map(int, s.split("x"))) for s in
                                              args.shapes.split(",")]  # fmt: skip
    i, n = map(int, args.shard.split("/"))
    lays = shard(lays, i, n, dtypes, shapes, args.flashinfer)
    if args.list or args.dry_run:
        return describe(lays, dtypes, shapes, args)
    if args.quick:
        lays = [quick_layer(x) for x in lays]
    os.makedirs(args.out, exist_ok=True)
    import bench_models as bm

    bench = bm.Bench(args.out, 3 if args.quick else max(args.reps, 25), args.quick)
    store = Store(args.out, args.retry_errors)
    bm.log(f"{len(lays)} geometries, {len(store.records)} records already in {store.path}; "
           f"estimated {estimate_s(lays, dtypes, shapes, args.flashinfer):.0f} s")  # fmt: skip
    t0 = time.time()
    ok = True
    for lay in lays:
        if not run_layer(bench, store, lay, dtypes, shapes, args, t0):
            ok = False
            break
    if args.flashinfer and ok:  # after kvpool's points: a cut run keeps those first
        import grid_flashinfer as fi

        fi.setup(bench, store_path=os.path.join(args.out, "flashinfer.json"))
        fi.run(bench, lays, dtypes, shapes, args, t0)
    left = sum(1 for lay in lays for d in dtypes for p in pages_of(lay) for b, n in shapes
               if rec_key(dict(model=lay.label, tp=lay.tp, layer=lay.layer, dtype=d, page=p,
                               B=b, L=n)) not in store.done)  # fmt: skip
    bm.log(f"done in {time.time() - t0:.0f} s: {len(store.records)} records, {left} points left")
    return store.records


def describe(lays, dtypes, shapes, args) -> list[dict]:
    """``--list`` / ``--dry-run``: the geometries, their points, memory and estimated seconds."""
    total_pts = 0
    for lay in lays:
        pts = len(dtypes) * len(pages_of(lay)) * len(shapes)
        total_pts += pts
        big = [d for d in dtypes if need_bytes(lay, d, shapes) > args.mem_gib * GIB]
        print(f"{lay.label:28s} tp {lay.tp} {lay.layer:7s} {lay.hq:3d}/{lay.hk or 'MLA':>3} x "
              f"{lay.d:3d} {json.dumps(lay.opts):34s} {pts:3d} points, "
              f"{max(need_bytes(lay, d, shapes) for d in dtypes) / GIB:5.1f} GiB, "
              f"~{estimate_s([lay], dtypes, shapes, args.flashinfer):4.0f} s"
              + (f"; skips {big} (> {args.mem_gib} GiB)" if big else "")
              + f"; models {', '.join(lab for _, lab in lay.models)}")  # fmt: skip
    est = estimate_s(lays, dtypes, shapes, args.flashinfer)
    print(
        f"shard {args.shard}: {len(lays)} geometries, {total_pts} timed points, "
        f"~{est:.0f} s estimated (budget {args.budget_s:.0f} s)"
    )
    return [dict(label=x.label, tp=x.tp, layer=x.layer, points=len(dtypes) * len(pages_of(x))
                 * len(shapes), models=[lab for _, lab in x.models]) for x in lays]  # fmt: skip


if __name__ == "__main__":
    main()
