"""The Gluon decode kernels compiled for sm_90 on the CPU (no GPU needed) at every geometry the
planner routes to them (``attention.variants._GLUON_GROUPS``) and every Gluon dtype, with the
constants the launcher passes: registers <= 255 with no spills (no stack, no local memory,
``cuobjdump -res-usage``), shared memory <= 227 KiB, and as many programs per multiprocessor as
the split model assumes (``_gluon_programs_per_sm``). Head_dim 128 with groups of <= 8 is the
measured path, compiled here as a reference (its PTX did not change when head_dim and the
group became constants). Needs a Triton of ``attention.GLUON_TRITON`` (3.6: Triton 3.9
removed the cp.async call of the rings), else skipped; run with such a Triton on the path:
``PYTHONPATH=<triton 3.6>:python pytest tests/test_gluon_compile.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from kvpool.attention import variants  # noqa: E402

_VER = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
pytestmark = pytest.mark.skipif(
    _VER not in variants.GLUON_TRITON,
    reason=f"Triton {triton.__version__}: the Gluon kernels are built with "
    f"{variants.GLUON_TRITON} only",
)

SMEM_MAX = 227 * 1024  # bytes per block on the H100 / H200
PTRS = {
    "Q": "*bf16", "K": "*u8", "V": "*u8", "KSC": "*fp32", "VSC": "*fp32", "PT": "*i32",
    "SEQ": "*i32", "SINKS": "*fp32", "OUT": "*bf16", "PO": "*fp32", "PL": "*fp32",
    "KBS": "*u8", "VBS": "*u8",
}  # fmt: skip
BOOLS = ("FINAL", "PREFETCH", "E5M2", "HAS_SOFTCAP", "HAS_WINDOW", "HAS_SINKS", "PAGED",
         "HEAD_FAST", "TMA")  # fmt: skip


def compile_sm90(module: str, consts: dict):
    """``triton.compile`` of ``module``'s ``decode_kernel`` for sm_90 with constexprs
    ``consts`` (pointers and strides 16-divisible, as a pool's buffers are)."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = importlib.import_module(f"kvpool.triton_kernels.{module}").decode_kernel
    consts = dict(consts)
    for prm in fn.params:  # (constexprs left at their defaults are constants too)
        if prm.is_constexpr and prm.name not in consts:
            consts[prm.name] = prm.default
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in ("KD", "VD"):
            if consts.get("TMA"):
                # the box: 16 rows of a head's bytes (FP4 D / 2, fp8 D, 16-bit 2 D)
                w = (
                    consts["D"] // 2
                    if consts.get("FP4", module.endswith("fp4"))
                    else (consts["D"] * (2 if consts.get("WIDE") else 1))
                )
                sw = w if w >= 64 else 0  # (as launch_decode._tma_desc)
                lay = gl.NVMMASharedLayout(swizzle_byte_width=sw, element_bitwidth=8, rank=2)
                sig[n] = f"tensordesc<u8[16, {w}],{lay!r}>"
            else:
                sig[n], consts[n] = "constexpr", None
        elif n in consts:
            sig[n] = "constexpr"
        elif n in PTRS:
            sig[n], attrs[(i,)] = PTRS[n], [["tt.divisibility", 16]]
        elif n in ("sm_scale", "softcap"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride") and n != "stride_pt":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})


def resources(kernel) -> dict:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of the cubin (``cuobjdump -res-usage``)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def launch_consts(dtype: str, d: int, g: int, options: bool, page: int) -> tuple[str, dict]:
    """The kernel and constants ``_launch_gluon`` passes for a plan of the default shape."""
    common = dict(
        G=g, D=d, FINAL=options, HAS_SOFTCAP=options, HAS_WINDOW=options, HAS_SINKS=options
    )
    paged = page >= 16
    if dtype in ("fp8_e4m3", "fp8_e5m2", "bf16", "fp16"):
        pg, rescale, hf = variants._GLUON_FP8_OPTIONS[dtype]
        stages = variants._gluon_config(dtype)[0]
        return "decode_gluon", dict(
            common, PREFETCH=False, E5M2=dtype == "fp8_e5m2", STAGES=stages,
            PAGED=pg and paged, RESCALE=rescale, HEAD_FAST=hf,
            WIDE={"fp16": 1, "bf16": 2}.get(dtype, 0),
        )  # fmt: skip
    hf, ablate, tma, _ = variants._GLUON_FP4_OPTIONS
    dec = (2, 2) if dtype == "fp4_mx_block16" else variants._GLUON_FP4_DEC
    ring = paged
    return "decode_gluon_fp4", dict(
        common, DEC_K=dec[0], DEC_V=dec[1], PAGED=paged, HEAD_FAST=hf, ABLATE=ablate,
        STAGES=variants._GLUON_CONFIG[dtype][0] if ring else 0, TMA=ring and tma,
        SUB=2 if ring else 1,
    )  # fmt: skip


def _cases():
    for dtype in [*variants._GLUON_CONFIG, *variants._GLUON_16BIT]:
        for d, gmax in variants._GLUON_GROUPS.items():
            if dtype in variants._GLUON_16BIT and d != 64:
                continue
            for g in sorted({1, 8, gmax} if d == 128 else {8, gmax}):
                yield dtype, d, g


class _View:  # what _gluon_programs_per_sm reads
    def __init__(self, dtype, d):
        self.dtype, self.head_dim = dtype, d


@pytest.mark.parametrize("dtype, d, g", list(_cases()), ids=lambda x: str(x))
@pytest.mark.parametrize("options", [False, True], ids=["plain", "sinks-window-softcap"])
def test_compiles_within_resources(dtype, d, g, options):
    for page in (16, 1):
        if page == 1 and d == 256 and dtype in ("nvfp4", "fp4_mx_block16"):
            continue  # (refused by _gluon_unfit: the ring needs pages of >= 16)
        module, consts = launch_consts(dtype, d, g, options, page)
        k = compile_sm90(module, consts)
        res = resources(k)
        assert res["REG"] <= 255 and res["STACK"] == 0 and res["LOCAL"] == 0, (page, res)
        assert k.metadata.shared <= SMEM_MAX, (page, k.metadata.shared)
        # the split model's programs per SM fit the registers and shared memory
        regs = -(-res["REG"] // 8) * 8 * 32
        fit = min(65536 // regs, (228 * 1024) // (k.metadata.shared + 1024))
        assert fit >= variants._gluon_programs_per_sm(_View(dtype, d), g), (page, res, fit)


@pytest.mark.parametrize("dtype", list(variants._GLUON_CONFIG))
def test_head_dim_256_group_16_spills_or_fills(dtype):
    """Why head_dim 256 stops at a group of 8: with 16-wide PV dots the build reaches the
    255-register cap (e5m2 and FP4 spill; e4m3 none left)."""
    module, consts = launch_consts(dtype, 256, 16, False, 16)
    res = resources(compile_sm90(module, consts))
    assert res["REG"] == 255 and (res["STACK"] > 0 or dtype == "fp8_e4m3"), res


# --- knobs (attention/gluon_knobs.py): the sweep's variants and the GPU tests' -------------

_SWEEP = os.path.join(os.path.dirname(__file__), "..", "benches", "attention")


def knob_consts(dtype: str, d: int, g: int, knobs, options: bool) -> tuple[str, dict, int]:
    """The kernel, constants and split-model programs per SM of a plan with ``knobs`` (as
    ``_gluon_plan`` and the launchers derive them); ``options``: sinks, window, soft-cap and one
    split, else sinks only and several splits (the sweep's calls)."""
    from attention_helpers import Cache
    from kvpool.attention import gluon_knobs as gk

    view = Cache(dtype, [40, 3], heads=8, d=d, page=16).view
    assert gk.knobs_unfit(view, g, knobs) is None, knobs
    fp4 = dtype in ("nvfp4", "fp4_mx_block16")
    stages, per_sm, maxnreg = variants._gluon_config(dtype)
    per_sm = variants._gluon_programs_per_sm(view, g)
    block_n = 32 if fp4 and stages > 0 and d != 128 else 16
    stages, block_n, per_sm, maxnreg = gk.plan_fields(
        view, g, knobs, stages, per_sm, maxnreg, block_n
    )
    if knobs.multi:
        consts = gk.multi_constants(
            dtype, d, g, knobs, stages=stages, block_n=block_n, final=options, softcap=options,
            window=options, sinks=True,
        )  # fmt: skip
        return "decode_gluon_multi", consts, per_sm
    module, consts = launch_consts(dtype, d, g, options, 16)
    consts["HAS_SINKS"] = True
    if knobs.rescale is not None:
        consts["RESCALE"] = float(knobs.rescale)
    if fp4:
        ring = stages > 0
        consts.update(STAGES=stages, SUB=block_n // 16 if ring else 1)
        consts["TMA"] = ring and (consts["TMA"] if knobs.tma is None else knobs.tma)
    else:
        consts.update(STAGES=stages, PREFETCH=stages == 0)
    return module, consts, per_sm


def _knob_cases():
    import sys

    from kvpool.attention.gluon_knobs import GluonKnobs

    sys.path.insert(0, _SWEEP)
    import sweep_hd64
    from test_gluon_knobs import GLUON, MULTI

    seen = set()
    for dtype in sweep_hd64.DTYPES:  # the sweep's calls: sinks, several splits
        for _name, kw in sweep_hd64.variants_for(dtype):
            if kw is not None:
                seen.add((dtype, 64, 8, GluonKnobs(**kw), False))
    for dtype in GLUON:  # the GPU tests': every option, one split
        for k in MULTI:
            seen.add((dtype, 64, 8, k, True))
        for text in ("stages=2", "stages=5", "stages=3,rescale=8", "stages=4,rescale=-1",
                     "stages=0"):  # fmt: skip
            seen.add((dtype, 64, 8, GluonKnobs(**_kv(text)), True))
        if dtype in ("nvfp4", "fp4_mx_block16"):
            for text in ("sub=1,stages=3", "sub=2,stages=3,tma=0", "sub=1,stages=4,tma=1"):
                seen.add((dtype, 64, 8, GluonKnobs(**_kv(text)), True))
    for dtype in ("fp8_e4m3", "bf16", "nvfp4", "fp4_mx_block16"):  # their other geometries
        seen.add((dtype, 64, 4, GluonKnobs(multi=True, sub=2, heads=2), True))
        seen.add((dtype, 64, 16, GluonKnobs(multi=True, sub=4, stages=2), True))
        if dtype != "bf16":
            seen.add((dtype, 128, 4, GluonKnobs(multi=True, sub=2, heads=2), True))
            seen.add((dtype, 128, 4, GluonKnobs(multi=True, sub=1, stages=4, tma=False), True))
    return sorted(seen, key=repr)


def _kv(text):
    from kvpool.attention.gluon_knobs import parse_knobs

    k = parse_knobs(text)
    return {f: getattr(k, f) for f in ("stages", "sub", "tma", "rescale")}


@pytest.mark.parametrize(
    "dtype, d, g, knobs, options",
    _knob_cases() if _VER in variants.GLUON_TRITON else [],
    ids=lambda x: x.label() if hasattr(x, "label") else str(x),
)
def test_knob_variants_compile(dtype, d, g, knobs, options):
    """Every knob variant the sweep times and the GPU tests run builds for sm_90 within the
    resources the split model assumes (as ``test_compiles_within_resources``)."""
    module, consts, per_sm = knob_consts(dtype, d, g, knobs, options)
    k = compile_sm90(module, consts)
    res = resources(k)
    assert res["REG"] <= 255 and res["STACK"] == 0 and res["LOCAL"] == 0, res
    assert k.metadata.shared <= SMEM_MAX, k.metadata.shared
    regs = -(-res["REG"] // 8) * 8 * 32
    fit = min(65536 // regs, (228 * 1024) // (k.metadata.shared + 1024))
    assert fit >= per_sm, (res, k.metadata.shared, fit, per_sm)
