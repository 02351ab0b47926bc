"""Compile the write kernel for sm_90 on any machine (no GPU needed) and summarize its SASS.

Usage: python benches/write/sass.py [--mode 3] [--block-t 4] [--warps 4] [--dump FILE]

Prints registers, spills, and the static count of global loads/stores by width plus the total
instruction count of the kernel. Argument values mirror the benchmark launch (bf16 K/V,
8 heads x 128, page_size 64), with Triton's usual specializations (ints divisible by 16, pointers
16-byte aligned, ints equal to 1 as constants).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def compile_write(
    mode: int, block_t: int, warps: int, pm: bool, extra: dict | None = None, maxnreg=None
):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "triton_kernels", "quant_write.py")
    spec = importlib.util.spec_from_file_location("quant_write_sass", path)
    qw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qw)

    fn = qw.quant_write_kernel
    h, d, page, t = 8, 128, 64, 16384
    fp4 = mode >= 3
    ptr_in = "*i32" if fp4 else "*bf16"
    out = "*u8" if mode else "*bf16"
    st = (h * d // 2, d // 2, 1) if fp4 else (h * d, d, 1)
    row = h * d // 2 if fp4 else h * d
    vals = {
        "loc_ptr": ("*i32", None),
        "T": ("i32", t),
        "R": ("i32", 2 * t + page),
        "k_ptr": (ptr_in, None),
        "k_st": ("i32", st[0]),
        "k_sh": ("i32", st[1]),
        "k_sd": ("i32", st[2]),
        "kd_ptr": (out, None),
        "kd_row": ("i32", row),
        "kbs_ptr": ("*u8", None),
        "kbs_row": ("i32", h * d // 16),
        "kpm_ptr": ("*u8", None),
        "ks_ptr": ("*fp32", None),
    }
    for k in list(vals):
        if k != "loc_ptr" and k not in ("T", "R"):
            vals["v" + k[1:]] = vals[k]
    consts = dict(
        H=h,
        DK=d,
        DV=d,
        PAGE=page,
        MODE=mode,
        WRITE_LINEAR=True,
        WRITE_PM=pm,
        K_KIND=0,
        V_KIND=0,
        BLOCK_T=block_t,
        BLOCK_CK=h * d,
        BLOCK_CV=h * d,
        ABLATE=0,
    )
    consts.update(extra or {})
    sig, cexp, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            cexp[name] = consts[name]
            continue
        ty, v = vals[name]
        if ty.startswith("*"):
            sig[name] = ty
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif v == 1:
            sig[name] = "constexpr"
            cexp[name] = 1
        else:
            sig[name] = ty
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, cexp, attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})},
    )


def sass_of(k) -> tuple[str, str]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    return sass, " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", res))


def summarize(sass: str) -> dict:
    ops = collections.Counter()
    n = 0
    exits = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            n += 1
            ops[m.group(1)] += 1
            if m.group(1) == "EXIT" and not line.strip().split(None, 1)[1].startswith("@"):
                exits.append(n)
    mem = {k: v for k, v in ops.items() if k.startswith(("LDG", "STG", "LDS", "STS", "BAR"))}
    segs = [b - a for a, b in zip([0] + exits[:-1], exits, strict=True)]
    return {"total": n, "segments": segs, "mem": mem, "ops": ops}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", type=int, default=3)
    ap.add_argument("--block-t", type=int, default=4)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--pm", action="store_true")
    ap.add_argument("--ablate", type=int, default=0)
    ap.add_argument("--maxnreg", type=int)
    ap.add_argument("--dump")
    ap.add_argument("--ptx")
    a = ap.parse_args()
    k = compile_write(a.mode, a.block_t, a.warps, a.pm, {"ABLATE": a.ablate}, a.maxnreg)
    sass, res = sass_of(k)
    if a.dump:
        open(a.dump, "w").write(sass)
    if a.ptx:
        open(a.ptx, "w").write(k.asm["ptx"])
    s = summarize(sass)
    print(
        f"mode {a.mode} bt {a.block_t} nw {a.warps}: {res} instr {s['total']}; "
        f"straight-line segments ending in EXIT: {s['segments']}"
    )
    print(" ", dict(sorted(s["mem"].items())))
    print(" ", s["ops"].most_common(25))


if __name__ == "__main__":
    main()
