"""Turn benchmark JSON (bench_attention.py output) into a markdown summary and a PNG plot.

    python benches/attention/report.py results/run2_h200.json --md RESULTS.md --png decode.png
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16")


def load(paths):
    res, meta = [], {}
    for p in paths:
        d = json.load(open(p))
        meta = {k: v for k, v in d.items() if k != "results"}
        res += d["results"]
    return meta, res


def cfg_of(r):
    keys = ("splits", "block_n", "warps", "stages", "use_dot", "prefetch")
    return {k: r[k] for k in keys if k in r}


def best_grid_tag(res, dtype):
    """The grid configuration with the lowest geometric-mean time for a dtype (one fixed config
    per dtype for the whole grid, not a per-point pick)."""
    by = defaultdict(list)
    for r in res:
        if r["kind"] == "decode" and r["impl"].startswith("grid") and r["dtype"] == dtype:
            by[r["impl"]].append(r)
    if not by:
        return None
    full = max(len(v) for v in by.values())
    return min((k for k in by if len(by[k]) == full),
               key=lambda k: sum(math.log(r["ms"]) for r in by[k]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--md", required=True)
    ap.add_argument("--png", required=True)
    a = ap.parse_args()
    meta, res = load(a.json)
    copy = next((r["Bps"] for r in res if r["kind"] == "copy"), float("nan"))
    sdpa = {(r["B"], r["ctx"]): r for r in res if r["kind"] == "decode" and r["impl"] == "sdpa_bf16_contiguous"}
    lines = [f"Device: {meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}. "
             f"Copy bandwidth (read + write): {copy / 1e12:.2f} TB/s.", ""]

    # key points
    lines += ["## Key points (decode, page 16 and 64, best fixed grid config per dtype)", "",
              "| dtype | B | ctx | page | fused ms | KV TB/s | % copy bw | SDPA bf16 ms | x SDPA | unfused ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    unf = {(r["dtype"], r["B"], r["ctx"]): r for r in res if r["kind"] == "decode" and r["impl"] == "unfused"}
    chosen = {}
    for dt in DTYPES:
        tag = best_grid_tag(res, dt)
        chosen[dt] = tag
        for b, ctx in ((64, 8192), (1, 32768)):
            for page in (16, 64):
                r = next((r for r in res if r["kind"] == "decode" and r["impl"] == tag and r["dtype"] == dt
                          and r["B"] == b and r["ctx"] == ctx and r["page"] == page), None)
                if r is None:
                    continue
                s = sdpa.get((b, ctx))
                u = unf.get((dt, b, ctx))
                lines.append(
                    f"| {dt} | {b} | {ctx} | {page} | {r['ms']:.4f} | {r['kv_TBps']:.2f} | "
                    f"{100 * r['kv_TBps'] * 1e12 / copy:.0f}% | {s['ms']:.4f} | {s['ms'] / r['ms']:.2f} | "
                    f"{u['ms']:.3f} |" if s and u else
                    f"| {dt} | {b} | {ctx} | {page} | {r['ms']:.4f} | {r['kv_TBps']:.2f} | "
                    f"{100 * r['kv_TBps'] * 1e12 / copy:.0f}% | - | - | - |")
    lines += ["", "Grid configuration used per dtype: " + ", ".join(
        f"{dt}: {chosen[dt]} {cfg_of(next(r for r in res if r.get('impl') == chosen[dt] and r['dtype'] == dt and r['B'] == 64))}"
        for dt in DTYPES if chosen[dt]), ""]

    # variants
    var = [r for r in res if r["kind"] == "decode" and r["impl"] == "variant"]
    if var:
        lines += ["## Variants and ablations (page 16)", "",
                  "| dtype | B | ctx | config | ablate | ms | KV TB/s | x SDPA |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in var:
            s = sdpa.get((r["B"], r["ctx"]))
            lines.append(f"| {r['dtype']} | {r['B']} | {r['ctx']} | {cfg_of(r)} | {r['ablate']} | {r['ms']:.4f} | "
                         f"{r['kv_TBps']:.2f} | {s['ms'] / r['ms']:.2f} |" if s else "")
        lines.append("")

    # extend
    ext = [r for r in res if r["kind"] == "extend"]
    if ext:
        base = next((r for r in ext if r["impl"].startswith("sdpa")), None)
        lines += ["## Extend (B=16, 4096 cached + 512 new tokens, page 16)", "",
                  "| impl | dtype | config | ms | TFLOP/s | x SDPA |", "| --- | --- | --- | --- | --- | --- |"]
        for r in ext:
            c = {k: r[k] for k in ("block_t", "block_n", "warps", "stages") if k in r}
            ratio = f"{base['ms'] / r['ms']:.2f}" if base else "-"
            lines.append(f"| {r['impl']} | {r['dtype']} | {c} | {r['ms']:.3f} | {r['TFLOPs']:.0f} | {ratio} |")
        lines.append("")

    # full grid
    lines += ["## Full grid (fused decode, chosen config per dtype; ms, then x SDPA bf16)", "",
              "| dtype | page | " + " | ".join(f"B={b} {c // 1024}k" for b in (1, 16, 64, 128) for c in (1024, 8192, 32768)) + " |",
              "| --- | --- | " + " | ".join("---" for _ in range(12)) + " |"]
    for dt in DTYPES:
        for page in (16, 64):
            cells = []
            for b in (1, 16, 64, 128):
                for c in (1024, 8192, 32768):
                    r = next((r for r in res if r["kind"] == "decode" and r["impl"] == chosen[dt] and r["dtype"] == dt
                              and r["B"] == b and r["ctx"] == c and r["page"] == page), None)
                    s = sdpa.get((b, c))
                    cells.append("-" if r is None else f"{r['ms']:.3f} ({s['ms'] / r['ms']:.2f}x)" if s else f"{r['ms']:.3f}")
            lines.append(f"| {dt} | {page} | " + " | ".join(cells) + " |")
    sd = [f"B={b} {c // 1024}k {sdpa[(b, c)]['ms']:.3f}" for b in (1, 16, 64, 128) for c in (1024, 8192, 32768) if (b, c) in sdpa]
    lines += ["", "SDPA bf16 contiguous (ms): " + ", ".join(sd), ""]
    errs = [r for r in res if r["kind"] == "error"]
    if errs:
        lines += [f"Errors during the run: {len(errs)} (first: {errs[0]['error'][:200]})", ""]
    open(a.md, "w").write("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, page in zip(axes, (16, 64)):
        xs = [(b, c) for b in (1, 16, 64, 128) for c in (1024, 8192, 32768)]
        for dt in DTYPES:
            ys = []
            for b, c in xs:
                r = next((r for r in res if r["kind"] == "decode" and r["impl"] == chosen[dt] and r["dtype"] == dt
                          and r["B"] == b and r["ctx"] == c and r["page"] == page), None)
                s = sdpa.get((b, c))
                ys.append(s["ms"] / r["ms"] if r and s else float("nan"))
            ax.plot(range(len(xs)), ys, marker="o", label=dt)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(xs)), [f"{b}/{c // 1024}k" for b, c in xs], rotation=60, fontsize=8)
        ax.set_ylabel("speed-up vs SDPA bf16 contiguous")
        ax.set_xlabel("B / context")
        ax.set_title(f"paged decode, page {page} ({meta.get('device')})")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
