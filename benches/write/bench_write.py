"""Quantized KV write throughput on a GPU, beside the device's measured copy bandwidth.

Llama-3.1-8B geometry (8 KV heads, head_dim 128), T = 16,384 new tokens written into one layer
(pages in shuffled order, tokens in order within a page), bf16 K/V in. For each dtype:

- bytes moved = K and V read (bf16) + ``loc`` read + everything written (data, block scales in
  every layout of the recipe; the per-layer scales read are 8 bytes and not counted);
- time = median of CUDA-event timings of single launches, each after a 512 MiB write that
  evicts L2 (50 MiB on an H200), so inputs come from HBM as they do in a model;
- copy bandwidth = ``dst.copy_(src)`` timed the same way, for a copy of the same bytes as the
  write moves (read + write counted) and for a 1 GiB copy.

Also: a sweep of tokens per program / warps, the round-trip error per format on heavy-tailed
K/V (per-vector relative L2 error ``|x^ - x| / |x|`` over each token-head vector: mean and max),
read back with the dequantize kernel, and for the FP4 formats ablations at the best tile (the
kernel's ABLATE constexpr: 1 no block-scale stores, 2 also no element encoding, 3 the short
path without its NaN / range check), which show what each stage costs.

Usage: python benches/write/bench_write.py --out DIR  (writes results.json and results.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial

import kvpool
import torch
from kvpool.config import ModelSpec
from kvpool.write import _launch_write, dequantize_kv, write_kv

CFG = {
    "num_hidden_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "vocab_size": 128256,
}
# (block_t, num_warps) tried per case; None = the launcher's default
SWEEP_FP4 = ((1, 1), (2, 1), (2, 2), (4, 4), (4, 8), (8, 8))
SWEEP = {
    "bf16": ((8, 4), (16, 8)),
    "fp8_e4m3": ((2, 2), (8, 4)),
    "fp8_e5m2": ((2, 2), (8, 4)),
    "nvfp4": SWEEP_FP4,
    "fp4_mx_block16": SWEEP_FP4,
}
ABLATIONS = {1: "no block-scale stores", 2: "no scale stores, no encoding", 3: "no path check"}
CASES = [
    ("bf16", "linear"),
    ("fp8_e4m3", "linear"),
    ("fp8_e5m2", "linear"),
    ("nvfp4", "linear"),
    ("nvfp4", "mixed"),
    ("fp4_mx_block16", "linear"),
]


def heavy_tailed(t: int, h: int, d: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """K/V-like values: per-channel log-normal magnitudes, a few outlier channels, t-ish tails."""
    ch = torch.exp(torch.randn(h, d, generator=gen) * 0.75)
    out_ch = torch.randperm(h * d, generator=gen)[: max(1, h * d // 64)]
    ch.view(-1)[out_ch] *= 20.0
    z = torch.randn(t, h, d, generator=gen)
    chi = torch.distributions.Chi2(torch.tensor(4.0)).sample((t, h, 1))
    x = z / torch.sqrt(chi / 4.0) * ch
    return x.to(device=device, dtype=torch.bfloat16)


def timed(fn, flush: torch.Tensor, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` cold-L2 launches."""
    if flush.device.type == "cpu":  # --dry-run: checks the script, times nothing meaningful
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    times = []
    for _ in range(iters):
        flush.add_(1)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny sizes")
    ap.add_argument("--only", help="comma-separated dtypes (default: all cases)")
    ap.add_argument("--quick", action="store_true", help="FP4 sweep of 3 tiles only")
    a = ap.parse_args()
    dev = "cpu" if a.dry_run else "cuda"
    if a.dry_run:
        a.tokens, a.iters = 64, 1
    t_tok = a.tokens
    gen = torch.Generator().manual_seed(0)
    spec = ModelSpec.from_dict(CFG, name="llama-3.1-8b-1layer")
    page = 64
    flush = torch.zeros((512 << 20) if dev == "cuda" else 1, dtype=torch.uint8, device=dev)
    k = heavy_tailed(t_tok, 8, 128, gen, dev)
    v = heavy_tailed(t_tok, 8, 128, gen, dev)
    n_pages = t_tok // page
    pages = torch.randperm(2 * n_pages, generator=gen)[:n_pages] + 1
    loc = (pages[:, None] * page + torch.arange(page)[None, :]).reshape(-1).to(torch.int32).to(dev)
    in_bytes = k.numel() * 2 * 2 + loc.numel() * 4

    res: dict = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "tokens": t_tok,
        "kv_heads": 8,
        "head_dim": 128,
        "page_size": page,
        "cases": [],
        "sweep": [],
        "ablations": [],
        "roundtrip": [],
    }
    big = torch.empty((1 << 30) if dev == "cuda" else 1 << 20, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    res["copy_1gib_gbps"] = 2 * big.numel() / timed(partial(big2.copy_, big), flush, 20) / 1e9
    big = big2 = None  # free before the cases

    cases = [c for c in CASES if a.only is None or c[0] in a.only.split(",")]
    for dtype, recipe in cases:
        plan = kvpool.size_for(
            spec, dtype, num_tokens=2 * t_tok, page_size=page, nvfp4_recipe=recipe
        )
        pool = kvpool.KVPool(plan, device=dev)
        view = pool.layer(0)
        if dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4"):
            fmax = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "nvfp4": 6 * 448.0}[dtype]
            ks, vs = float(k.float().abs().max()) / fmax, float(v.float().abs().max()) / fmax
            pool.set_kv_scales([ks], [vs], source="bench")
        out_bytes = 0
        for name in (
            "k",
            "v",
            "k_block_scale",
            "v_block_scale",
            "k_block_scale_page_major",
            "v_block_scale_page_major",
        ):
            buf = getattr(view, name)
            if buf is not None:
                out_bytes += buf.numel() * buf.element_size() * t_tok // (plan.num_tokens + page)
        moved = in_bytes + out_bytes
        src = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_s = timed(partial(dst.copy_, src), flush, 2 * a.iters)
        copy_gbps = 2 * src.numel() / copy_s / 1e9
        best = None
        sweep = SWEEP[dtype] if recipe == "linear" else SWEEP_FP4[:4]
        if a.quick and dtype in ("nvfp4", "fp4_mx_block16"):
            sweep = ((1, 1), (2, 2), (4, 4))
        for bt, nw in sweep:
            fn = partial(write_kv, view, loc, k, v, backend="triton", block_t=bt, num_warps=nw)
            fn()
            s = timed(fn, flush, a.iters)
            gbps = moved / s / 1e9
            res["sweep"].append(
                {
                    "dtype": dtype,
                    "recipe": recipe,
                    "block_t": bt,
                    "num_warps": nw,
                    "us": s * 1e6,
                    "gbps": gbps,
                }
            )
            if best is None or s < best[0]:
                best = (s, bt, nw)
        fn = partial(write_kv, view, loc, k, v, backend="triton")  # the default launch
        fn()
        s_def = timed(fn, flush, a.iters)
        if dtype in ("nvfp4", "fp4_mx_block16") and recipe == "linear":
            for abl, what in ABLATIONS.items():
                fa = partial(_launch_write, view, loc, k, v, best[1], best[2], abl)
                fa()
                sa = timed(fa, flush, a.iters)
                res["ablations"].append(
                    {
                        "dtype": dtype,
                        "ablate": abl,
                        "what": what,
                        "block_t": best[1],
                        "num_warps": best[2],
                        "us": sa * 1e6,
                        "full_us": best[0] * 1e6,
                    }
                )
        row = {
            "dtype": dtype,
            "recipe": recipe,
            "bytes_moved": moved,
            "default_us": s_def * 1e6,
            "default_gbps": moved / s_def / 1e9,
            "best_us": best[0] * 1e6,
            "best_gbps": moved / best[0] / 1e9,
            "best_block_t": best[1],
            "best_num_warps": best[2],
            "copy_same_bytes_gbps": copy_gbps,
        }
        row["default_vs_copy"] = row["default_gbps"] / copy_gbps
        row["best_vs_copy"] = row["best_gbps"] / copy_gbps
        row["default_vs_copy_1gib"] = row["default_gbps"] / res["copy_1gib_gbps"]
        res["cases"].append(row)
        # round trip through the dequantize kernel
        kk = dequantize_kv(view, loc, "k", backend="triton").view(-1, 128)
        vv = dequantize_kv(view, loc, "v", backend="triton").view(-1, 128)
        for name, x, xh in (("k", k, kk), ("v", v, vv)):
            xf = x.float().view(-1, 128)
            rel = (xh - xf).norm(dim=1) / xf.norm(dim=1).clamp_min(1e-30)
            res["roundtrip"].append(
                {
                    "dtype": dtype,
                    "recipe": recipe,
                    "tensor": name,
                    "mean_rel_l2": float(rel.mean()),
                    "max_rel_l2": float(rel.max()),
                    "nonfinite": int((~torch.isfinite(xh)).sum()),
                }
            )
        pool = view = src = dst = None
        with open(f"{a.out}/results.json", "w") as f:  # so far (a killed run keeps its cases)
            json.dump(res, f, indent=1)
        if dev == "cuda":
            torch.cuda.empty_cache()
        print(
            f"{dtype:15s} {recipe:7s} default {row['default_us']:7.1f} us "
            f"{row['default_gbps']:6.0f} GB/s "
            f"({row['default_vs_copy']:.0%} of copy {copy_gbps:.0f}); "
            f"best bt={best[1]} nw={best[2]} "
            f"{row['best_gbps']:.0f} GB/s ({row['best_vs_copy']:.0%})",
            flush=True,
        )

    res["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(f"{a.out}/results.json", "w") as f:  # before the tables: a table bug loses nothing
        json.dump(res, f, indent=1)
    lines = [
        f"# Quantized KV write on {res['device']} (torch {res['torch']}, triton {res['triton']})",
        "",
        f"T = {t_tok} tokens, 8 KV heads, head_dim 128, bf16 K/V in, page_size {page}; "
        f"1 GiB copy: {res['copy_1gib_gbps']:.0f} GB/s (read + write).",
        "",
        "| dtype | recipe | bytes moved | default us | GB/s | % of same-size copy "
        "| best GB/s (block_t, warps) | % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["cases"]:
        lines.append(
            f"| {r['dtype']} | {r['recipe']} | {r['bytes_moved']} | {r['default_us']:.1f} | "
            f"{r['default_gbps']:.0f} | {r['default_vs_copy']:.0%} | {r['best_gbps']:.0f} "
            f"({r['best_block_t']}, {r['best_num_warps']}) | {r['best_vs_copy']:.0%} |"
        )
    lines += [
        "",
        "Sweep (us per call):",
        "",
        "| dtype | recipe | " + " | ".join(f"{bt}, {nw}" for bt, nw in SWEEP_FP4) + " |",
        "|---|---|" + "---|" * len(SWEEP_FP4),
    ]
    for dtype, recipe in cases:
        if dtype not in ("nvfp4", "fp4_mx_block16"):
            continue
        us = {
            (r["block_t"], r["num_warps"]): r["us"]
            for r in res["sweep"]
            if r["dtype"] == dtype and r["recipe"] == recipe
        }
        cells = [f"{us[c]:.1f}" if c in us else "" for c in SWEEP_FP4]
        lines.append(f"| {dtype} | {recipe} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Ablations (FP4, at the best tile; the bytes counted stay those of the full write):",
        "",
        "| dtype | left out | block_t, warps | us | full write us |",
        "|---|---|---|---|---|",
    ]
    for r in res["ablations"]:
        lines.append(
            f"| {r['dtype']} | {r['what']} | {r['block_t']}, {r['num_warps']} | "
            f"{r['us']:.1f} | {r['full_us']:.1f} |"
        )
    lines += [
        "",
        "Round trip (per token-head vector, relative L2 error):",
        "",
        "| dtype | recipe | tensor | mean | max |",
        "|---|---|---|---|---|",
    ]
    for r in res["roundtrip"]:
        lines.append(
            f"| {r['dtype']} | {r['recipe']} | {r['tensor']} | {r['mean_rel_l2']:.4f} "
            f"| {r['max_rel_l2']:.4f} |"
        )
    with open(f"{a.out}/results.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
