"""Turn benchmark JSON (bench_attention.py output) into a markdown summary and a PNG plot.

    python benches/attention/report.py --main results/run10_h200/call6_bench/attention.json \
        --extra results/run6_h200/attention.json results/run5_h200/attention.json \
        --md RESULTS.md --png decode_h200.png

(the full command that made ``RESULTS.md`` is in ``benches/attention/README.md``)

``--main``: the run whose grid (``--grid-tag``: the grid configuration that matches the code's
defaults), key points, unfused path and extend baseline are reported. ``--extra``: other runs
whose variants/ablations and extend configurations are listed, each against the SDPA baseline
measured in its own run.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16")
BS, CTXS = (1, 16, 64, 128), (1024, 8192, 32768)
CFG_KEYS = ("splits", "block_n", "warps", "stages", "use_dot", "prefetch", "asm", "swap", "gluon")
EXT_KEYS = ("block_t", "block_n", "warps", "stages", "asm")


def load(path):
    d = json.load(open(path))
    return {k: v for k, v in d.items() if k != "results"}, d["results"]


def sdpa_of(res):
    return {
        (r["B"], r["ctx"]): r
        for r in res
        if r["kind"] == "decode" and r["impl"] == "sdpa_bf16_contiguous"
    }


def find(res, **kw):
    return next((r for r in res if all(r.get(k) == v for k, v in kw.items())), None)


def cfg(r):
    return ", ".join(f"{k}={r[k]}" for k in CFG_KEYS if k in r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--main", required=True)
    ap.add_argument("--grid-tag", default="grid0")
    ap.add_argument("--extra", nargs="*", default=[])
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="dtypes of the main run to report")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument(
        "--plot-with",
        default="",
        help="RUN.json:dtype,...: more default-config curves for the plot",
    )
    ap.add_argument(
        "--optin-grid", default="", help="RUN.json:dtype,dtype: grid of the opt-in configs"
    )
    ap.add_argument("--md", required=True)
    ap.add_argument("--png", required=True)
    a = ap.parse_args()
    meta, res = load(a.main)
    dts = a.dtypes.split(",")
    name = a.main  # as given (relative to benches/attention): several runs share file names
    copy = next(r["Bps"] for r in res if r["kind"] == "copy")
    sdpa = sdpa_of(res)
    tag = a.grid_tag
    L = [
        f"Main run `{name}`: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}; "
        f"measured copy bandwidth (bytes read + written / time) {copy / 1e12:.2f} TB/s. "
        "Llama-3.1-8B geometry (32 q heads, 8 KV heads, head_dim 128), one layer; CUDA graphs, "
        "L2 flushed before every repetition, median of 25.",
        "",
    ]

    L += [
        f"## Decode targets (default configuration; {', '.join(dts)})",
        "",
        "| dtype | B | ctx | page | fused ms | KV TB/s | % of copy bw | SDPA bf16 ms | x SDPA | unfused ms | x unfused |",  # noqa: E501
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for dt in dts:
        for b, ctx in ((64, 8192), (1, 32768)):
            for page in (16, 64):
                r = find(res, kind="decode", impl=tag, dtype=dt, B=b, ctx=ctx, page=page)
                if r is None:
                    continue
                s = sdpa[(b, ctx)]
                u = find(res, kind="decode", impl="unfused", dtype=dt, B=b, ctx=ctx)
                us = f"{u['ms']:.3f} | {u['ms'] / r['ms']:.1f}" if u else "- | -"
                L.append(
                    f"| {dt} | {b} | {ctx // 1024}k | {page} | {r['ms']:.4f} | {r['kv_TBps']:.2f} | "  # noqa: E501
                    f"{100 * r['kv_TBps'] * 1e12 / copy:.0f}% | {s['ms']:.4f} | {s['ms'] / r['ms']:.2f} | {us} |"  # noqa: E501
                )
    L += [
        "",
        "Default configuration: "
        + "; ".join(
            f"{dt}: {cfg(r)}"
            for dt in dts
            if (r := find(res, kind="decode", impl=tag, dtype=dt, B=64, ctx=8192, page=16))
        ),
        "",
    ]

    parts = [r for r in res if r["kind"] == "decode_parts" and r["dtype"] in dts]
    if parts:
        L += [
            "## Small batches: where the decode time goes (page 16, `small` section)",
            "",
            "Each column is its own CUDA graph through the same harness (L2 flushed, median "
            "of 25; the harness alone costs the timing floor of one tiny kernel). `decode`: the "
            "default plan, merge launched as a programmatic dependent (PDL) or plainly, from "
            "the second of two alternating rounds (a pool's first timing can be an outlier). "
            "`75% target`: the time at 75% of the copy bandwidth of a 4 GiB copy (an "
            "asymptotic figure: at the smallest sizes it is below the timing floor). `bare "
            "read`: a Triton kernel that only reads the same number of contiguous bytes (best "
            "of 2, 4, 8 programs per SM), the fair reference at these sizes.",
            "",
            "| dtype | B | ctx | splits | decode us (PDL) | decode us (plain) | split kernel us "
            "| merge us | bare read us | copy us | 75% target us | decode % of copy bw "
            "| bare read % of copy bw | decode / bare read |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in parts:
            m = {k: v * 1e3 for k, v in r["ms"].items()}
            full = m.get("full_pdl_2", m["full_pdl"])
            plain = m.get("full_plain_2", m["full_plain"])
            target = r["kv_bytes"] / (0.75 * copy) * 1e6
            bw = r["kv_bytes"] / copy * 1e6  # us at the copy bandwidth
            L.append(
                f"| {r['dtype']} | {r['B']} | {r['ctx'] // 1024}k | {r['splits']} | {full:.1f} | "
                f"{plain:.1f} | {m.get('split_kernel', float('nan')):.1f} | "
                f"{m.get('merge', float('nan')):.1f} | {m['read_same_bytes']:.1f} | "
                f"{m['copy_same_bytes']:.1f} | {target:.1f} | {100 * bw / full:.0f}% | "
                f"{100 * bw / m['read_same_bytes']:.0f}% | {full / m['read_same_bytes']:.2f} |"
            )
        floor = next((r["ms"] for r in res if r["kind"] == "floor"), None)
        if floor is not None:
            L += ["", f"Timing floor (one tiny kernel, same harness): {floor * 1e3:.1f} us.", ""]
        else:
            L.append("")

    variants = [] if a.no_variants else [a.main, *a.extra]
    L += (
        []
        if a.no_variants
        else [
            "## Variants and ablations (page 16; x SDPA against the SDPA of the same run)",
            "",
            "`ablate`: 1 = no FP4 block-scale multiply, 2 = no dots (row sums instead), 3 = raw loads "  # noqa: E501
            "only (no dequant, no dots), 4 = no split merge (the split kernel alone). Results "
            "with ablate != 0 are not attention outputs. `swap`: transposed dots (KV tile as the "
            "MMA's M side); `asm`: word-level FP4/fp8 decode.",
            "",
            "| run | dtype | B | ctx | config | ablate | ms | KV TB/s | x SDPA |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    )
    for path in variants:
        _, rr = load(path)
        sd = sdpa_of(rr)
        for r in rr:
            if r["kind"] == "decode" and r["impl"] == "variant":
                s = sd.get((r["B"], r["ctx"]))
                L.append(
                    f"| {path} | {r['dtype']} | {r['B']} | {r['ctx'] // 1024}k | {cfg(r)} | "  # noqa: E501
                    f"{r['ablate']} | {r['ms']:.4f} | {r['kv_TBps']:.2f} | "
                    + (f"{s['ms'] / r['ms']:.2f} |" if s else "- |")
                )
    L.append("")

    L += [
        f"## Extend: B=16, 4096 cached + 512 new tokens per request, page 16 ({', '.join(dts)})",
        "",
        "| run | impl | dtype | config | ms | TFLOP/s | x SDPA |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path in [a.main, *a.extra]:
        _, rr = load(path)
        base = next((r for r in rr if r["kind"] == "extend" and r["impl"].startswith("sdpa")), None)
        for r in rr:
            if r["kind"] != "extend" or (
                r["dtype"] not in dts and not r["impl"].startswith("sdpa")
            ):
                continue
            c = ", ".join(f"{k}={r[k]}" for k in EXT_KEYS if k in r)
            ratio = f"{base['ms'] / r['ms']:.2f}" if base else "-"
            L.append(
                f"| {path} | {r['impl']} | {r['dtype']} | {c} | {r['ms']:.3f} | "
                f"{r['TFLOPs']:.0f} | {ratio} |"
            )
    L.append("")

    L += [
        f"## Full grid (default configuration, `{name}`): ms (x SDPA bf16 contiguous)",
        "",
        "| dtype | page | " + " | ".join(f"B={b} {c // 1024}k" for b in BS for c in CTXS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in range(len(BS) * len(CTXS))) + " |",
    ]
    for dt in dts:
        for page in (16, 64):
            cells = []
            for b in BS:
                for c in CTXS:
                    r = find(res, kind="decode", impl=tag, dtype=dt, B=b, ctx=c, page=page)
                    s = sdpa.get((b, c))
                    cells.append(
                        "-"
                        if r is None
                        else f"{r['ms']:.3f} ({s['ms'] / r['ms']:.2f}x)"
                        if s
                        else f"{r['ms']:.3f}"
                    )
            L.append(f"| {dt} | {page} | " + " | ".join(cells) + " |")
    L += [
        "",
        "SDPA bf16 contiguous, same run (ms): "
        + ", ".join(
            f"B={b}/{c // 1024}k {sdpa[(b, c)]['ms']:.4f}"
            for b in BS
            for c in CTXS
            if (b, c) in sdpa
        ),
        "",
    ]
    if a.optin_grid:
        path, odts = a.optin_grid.split(":")
        _, rr = load(path)
        sd = sdpa_of(rr)
        L += [
            f"## Full grid of the opt-in configurations (`{path}`): ms (x SDPA of that run)",  # noqa: E501
            "",
            "| dtype | config | page | "
            + " | ".join(f"B={b} {c // 1024}k" for b in BS for c in CTXS)
            + " |",
            "| --- | --- | --- | " + " | ".join("---" for _ in range(len(BS) * len(CTXS))) + " |",
        ]
        for dt in odts.split(","):
            for page in (16, 64):
                cells, conf = [], ""
                for b in BS:
                    for c in CTXS:
                        r = find(rr, kind="decode", impl=tag, dtype=dt, B=b, ctx=c, page=page)
                        s = sd.get((b, c))
                        if r is not None and b == 64:
                            conf = (
                                f"block_n={r['block_n']}, stages={r['stages']}, asm={r.get('asm')}"
                            )
                        cells.append(
                            "-"
                            if r is None
                            else f"{r['ms']:.3f} ({s['ms'] / r['ms']:.2f}x)"
                            if s
                            else f"{r['ms']:.3f}"
                        )
                L.append(f"| {dt} | {conf} | {page} | " + " | ".join(cells) + " |")
        L.append("")
    open(a.md, "w").write("\n".join(L))

    curves = [(res, dt, tag) for dt in dts]
    if a.plot_with:
        path, more = a.plot_with.split(":")
        _, rr = load(path)
        curves += [(rr, dt, tag) for dt in more.split(",")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    xs = [(b, c) for b in BS for c in CTXS]
    for ax, page in zip(axes, (16, 64), strict=True):
        for rr, dt, tg in sorted(curves, key=lambda c: DTYPES.index(c[1])):
            sd = sdpa_of(rr)
            ys = []
            for b, c in xs:
                r = find(rr, kind="decode", impl=tg, dtype=dt, B=b, ctx=c, page=page)
                s = sd.get((b, c))
                ys.append(s["ms"] / r["ms"] if r and s else float("nan"))
            ax.plot(range(len(xs)), ys, marker="o", label=dt)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(xs)), [f"{b}/{c // 1024}k" for b, c in xs], rotation=60, fontsize=8)
        ax.set_ylabel("speed-up vs SDPA (bf16, contiguous, same run)")
        ax.set_xlabel("batch / context")
        ax.set_title(f"kvpool paged decode, page {page}, {meta['device']}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
