"""Compile the MLA kernels (``triton_kernels/mla.py``) for sm_90 on a machine without a GPU and
compare the generated PTX of two checkouts: a refactor of ``@triton.jit`` code that must leave
the generated code unchanged is checked on the CPU.

    PYTHONPATH=python python benches/attention/mla_ptx.py dump A.json   # in checkout A
    PYTHONPATH=python python benches/attention/mla_ptx.py dump B.json   # in checkout B
    python benches/attention/mla_ptx.py compare A.json B.json

``dump`` compiles decode (one split and split-KV) and extend at DeepSeek's latent (512 + 64),
bf16 / fp8_e4m3 / nvfp4 / fp4_mx_block16 caches, 8 warps, through ``triton.compile`` with a
``GPUTarget("cuda", 90, 32)`` (no driver needed). ``compare`` drops the DWARF sections and the
``$L__tmp`` labels of inlined scopes (they change with source lines and helper functions) and
says, per kernel, whether the code is identical.
"""

from __future__ import annotations

import json
import re
import sys


def dump(path: str) -> None:
    import kvpool.triton_kernels.mla as m
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = {  # dtype -> (KV element, FMT, CDT, HAS_SCALE, ASM)
        "bf16": ("bf16", 0, tl.bfloat16, False, 0),
        "fp8_e4m3": ("fp8e4nv", 1, tl.float16, True, 1),
        "nvfp4": ("u8", 2, tl.float16, True, 1),
        "fp4_mx_block16": ("u8", 3, tl.bfloat16, False, 1),
    }
    common = dict(stride_qt="i32", stride_qh="i32", stride_kr="i32", stride_kbr="i32",
                  stride_pt="i32", stride_ot="i32", stride_oh="i32", sm_scale="fp32")  # fmt: skip

    def source(kind, dt, final):
        kv, fmt, cdt, hs, asm = cfg[dt]
        ptrs = dict(Q="*bf16", KV="*" + kv, KBS="*u8", KSC="*fp32", PT="*i32", SEQ="*i32")
        cons = dict(DL=512, DR=64, FMT=fmt, CDT=cdt, IS_F32=False, HAS_SCALE=hs, FP4_MUL=1.0,
                    ASM=asm)  # fmt: skip
        if kind == "decode":
            sig = {**ptrs, "OUT": "*bf16", "PO": "*fp32", "PL": "*fp32",
                   **{k.replace("_ot", "_ob").replace("_qt", "_qb"): v for k, v in common.items()},
                   "page_shift": "i32", "num_splits": "i32", "H": "i32"}  # fmt: skip
            cons.update(BLOCK_H=64, BLOCK_N=64, FINAL=final)
            fn = m.mla_decode_kernel
        else:
            sig = {**ptrs, "CU": "*i32", "WORK": "*i32", "OUT": "*bf16", **common,
                   "blocks_per_req": "i32", "page_shift": "i32", "H": "i32"}  # fmt: skip
            cons.update(BLOCK_H=16, BLOCK_T=4, BLOCK_N=32, USE_WORK=True)
            fn = m.mla_extend_kernel
        names = list(fn.arg_names)
        sig = {n: sig.get(n, "constexpr") for n in names}
        return ASTSource(fn=fn, signature=sig, constexprs=cons)

    out = {}
    for dt in cfg:
        for kind, final in (("decode", True), ("decode", False), ("extend", True)):
            k = triton.compile(
                source(kind, dt, final),
                target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=8, num_stages=2),
            )
            name = f"{kind}-{dt}" + ("" if kind == "extend" else f"-final{int(final)}")
            out[name] = k.asm["ptx"]
            print(name, len(out[name].splitlines()), "PTX lines", flush=True)
    with open(path, "w") as f:
        json.dump(out, f)


def code(ptx: str) -> list[str]:
    body = re.split(r"\.section\s+\.debug", ptx)[0]
    return [
        re.sub(r"mla_(decode|extend)_kernel\w*", "K", ln)
        for ln in body.splitlines()
        if not re.match(r"^\s*\$L__tmp\d+:$", ln) and not ln.strip().startswith((".loc", ".file"))
    ]


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    bad = 0
    for k in a:
        same = k in b and code(a[k]) == code(b[k])
        bad += not same
        print(f"{k}: {'identical code' if same else 'DIFFERENT code'}")
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2])
    else:
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
