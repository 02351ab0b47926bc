"""Knobs of the Gluon decode kernels (issue 17): ring depth, tiles a stage, KV heads a program.

A :class:`GluonKnobs` picks a Gluon decode variant for :func:`kvpool.attention.plan_decode`
(``gluon_knobs=``; or the environment, :data:`KNOBS_ENV`; or, at head_dim 64, the measured
per-dtype table :data:`HD64_DEFAULTS`, empty until a GPU sweep fills it:
``benches/attention/sweep_hd64.py`` prints the line). Two families:

- ``multi=False``: the measured kernels (``decode_gluon.py``, ``decode_gluon_fp4.py``) with
  their constants overridden: ``stages`` (ring stages; 0 = register prefetch), ``sub`` (FP4:
  16-token tiles a stage, 1 or 2), ``tma`` (FP4: data by TMA boxes), ``rescale`` (lazy softmax
  rescale threshold, log2 units; < 0 eager), ``maxnreg``, ``per_sm`` (the split model).
- ``multi=True``: ``decode_gluon_multi.py``, every Gluon dtype: ``sub`` 1, 2 or 4 tiles a
  stage, ``heads`` 1 or 2 KV heads a program, ``stages`` >= 2, ``tma`` (default on: sm_90+),
  ``ahead`` (page ids 1 or 2 stages before their copies), ``rescale``, ``maxnreg``,
  ``per_sm``. Pages of >= 16 tokens, head_dim 64 or 128.

``None`` fields keep the kernel's default. ``plan.knobs`` holds what a plan runs (None: the
defaults) and ``plan.kernel`` names it (``..._multi`` for the second family).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool import _launch
from kvpool._torch import torch
from kvpool.attention._common import _FP4

if TYPE_CHECKING:
    from kvpool.pool import LayerView

#: Environment override, e.g. ``KVPOOL_GLUON_KNOBS="multi=1,sub=2,heads=2,stages=3"``: applies
#: to every Gluon plan made without ``gluon_knobs`` whose layer it fits (others keep their
#: defaults; ``plan.kernel`` says which ran).
KNOBS_ENV = "KVPOOL_GLUON_KNOBS"

#: Bound on ``rescale`` (exclusive): the lazy rescale keeps ``p <= 2^rescale`` and P is rounded
#: to fp16 (largest finite 65,504 < 2^16) for the ``P V`` products.
RESCALE_MAX = 16.0

# shared memory per block on the H100 / H200, and the 1 KiB the runtime reserves per block
_SMEM = 227 * 1024


@dataclass(frozen=True)
class GluonKnobs:
    """One Gluon decode variant (see the module docstring; None: the kernel's default).

    Attributes
    ----------
    multi : bool
        ``decode_gluon_multi.py`` instead of the measured kernels.
    stages : int or None
        Ring stages (multi: 2..8; measured kernels 0..8, 0 = register prefetch).
    sub : int or None
        16-token tiles a ring stage: multi 1, 2, 4 (default 2); FP4 1, 2; fp8 / 16-bit 1.
    heads : int
        KV heads a program (multi: 1 or 2, a divisor of the KV heads; groups <= 8).
    tma : bool or None
        Data rows by TMA boxes (sm_90+; multi default True, FP4 default True, fp8 none).
    rescale : float or None
        Lazy softmax rescale threshold in log2 units (< 0: rescale every step; finite and
        below :data:`RESCALE_MAX`, 16: P is rounded to fp16).
    ahead : int
        multi: page ids loaded this many stages (1 or 2) before their copies are issued.
    maxnreg : int or None
        Register cap per thread (ptxas), 24..255.
    per_sm : int or None
        Programs per multiprocessor in the split model (1..32), when the split count is not
        given.
    """

    multi: bool = False
    stages: int | None = None
    sub: int | None = None
    heads: int = 1
    tma: bool | None = None
    rescale: float | None = None
    ahead: int = 1
    maxnreg: int | None = None
    per_sm: int | None = None

    def label(self) -> str:
        """A short name: ``multi`` or ``base`` and the fields set, e.g. ``multi-s3-t2-h2``."""
        parts = ["multi" if self.multi else "base"]
        for key, tag in (("stages", "s"), ("sub", "t"), ("rescale", "r"), ("maxnreg", "reg"),
                         ("per_sm", "sm")):  # fmt: skip
            v = getattr(self, key)
            if v is not None:
                parts.append(f"{tag}{v:g}" if isinstance(v, float) else f"{tag}{v}")
        if self.heads != 1:
            parts.append(f"h{self.heads}")
        if self.ahead != 1:
            parts.append(f"a{self.ahead}")
        if self.tma is not None:
            parts.append("tma" if self.tma else "cpasync")
        return "-".join(parts)


_INT_FIELDS = ("stages", "sub", "heads", "ahead", "maxnreg", "per_sm")


def parse_knobs(text: str) -> GluonKnobs:
    """``"multi=1,sub=2,heads=2"`` -> :class:`GluonKnobs` (ValueError naming a bad item)."""
    kw: dict = {}
    names = {f.name for f in dataclasses.fields(GluonKnobs)}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not sep or key not in names:
            raise ValueError(f"gluon knobs {text!r}: bad item {item!r} (keys: {sorted(names)})")
        try:
            if key in ("multi", "tma"):
                if val.lower() not in ("0", "1", "true", "false"):
                    raise ValueError
                kw[key] = val.lower() in ("1", "true")
            elif key == "rescale":
                kw[key] = float(val)
            else:
                kw[key] = int(val)
        except ValueError:
            raise ValueError(f"gluon knobs {text!r}: bad value in {item!r}") from None
    return GluonKnobs(**kw)


def as_knobs(value) -> GluonKnobs | None:
    """``value`` (GluonKnobs, a dict of its fields, a ``parse_knobs`` string, None) as knobs."""
    if value is None or isinstance(value, GluonKnobs):
        return value
    if isinstance(value, str):
        return parse_knobs(value)
    if isinstance(value, dict):
        try:
            return GluonKnobs(**value)
        except TypeError as e:
            raise ValueError(f"`gluon_knobs` = {value!r}: {e}") from None
    raise ValueError(f"`gluon_knobs` = {value!r}: a GluonKnobs, dict, str or None")


#: Measured per-dtype defaults at head_dim 64 with groups <= 8 (gpt-oss), from GPU sweeps
#: (``benches/attention/sweep_hd64.py``); a dtype not listed keeps the measured kernels'
#: defaults. Run 14 (H200, gpt-oss-120b full layer, B=64 x 8k, page 16, the planner's splits,
#: against SDPA bf16 0.257 ms): two KV heads a program, two 16-token tiles a stage, two TMA
#: stages: fp8_e4m3 0.157 ms (1.64x; the old default 0.232 ms), nvfp4 0.124 ms (2.07x; 0.133),
#: bf16 0.264 ms (0.97x; 0.284), fp4_mx_block16 0.150 ms (1.71x; 0.161). fp16 runs bf16's kernel;
#: fp8_e5m2 was not swept (keeps the old default).
_HD64_BEST = GluonKnobs(multi=True, sub=2, heads=2, stages=2)
HD64_DEFAULTS: dict[str, GluonKnobs] = {
    d: _HD64_BEST for d in ("bf16", "fp16", "fp8_e4m3", "nvfp4", "fp4_mx_block16")
}


def _bad_type(k: GluonKnobs) -> str | None:
    for key in _INT_FIELDS:
        v = getattr(k, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            return f"`{key}` = {v!r} (an int)"
    for key in ("multi", "tma"):
        v = getattr(k, key)
        if v is not None and not isinstance(v, bool):
            return f"`{key}` = {v!r} (a bool)"
    r = k.rescale
    if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float))):
        return f"`rescale` = {k.rescale!r} (a float)"
    return None


def knobs_unfit(view: LayerView, group: int, k: GluonKnobs) -> str | None:
    """Why the Gluon decode cannot run ``view`` with knobs ``k`` (a phrase), or None.

    The layer itself must fit the Gluon kernels (``variants._gluon_unfit``, checked by the
    caller); this checks the knobs' ranges and what each family needs (see the module).
    """
    if (bad := _bad_type(k)) is not None:
        return f"knobs with {bad}"
    if k.maxnreg is not None and not 24 <= k.maxnreg <= 255:
        return f"knobs with `maxnreg` = {k.maxnreg} (24..255)"
    if k.per_sm is not None and not 1 <= k.per_sm <= 32:
        return f"knobs with `per_sm` = {k.per_sm} (1..32)"
    if k.rescale is not None and not (math.isfinite(k.rescale) and k.rescale < RESCALE_MAX):
        # (lazy rescale keeps p <= 2^rescale, rounded to fp16 for P V: 2^16 overflows; inf
        # never moves the running max off -inf, so every p is inf)
        return f"knobs with `rescale` = {k.rescale!r} (finite, < {RESCALE_MAX:g}; < 0: eager)"
    fp4 = view.dtype in _FP4
    if not k.multi:
        if k.heads != 1 or k.ahead != 1:
            return "knobs `heads` / `ahead` of the multi kernel without `multi`"
        if k.stages is not None and not 0 <= k.stages <= 8:
            return f"knobs with `stages` = {k.stages} (0..8)"
        if k.sub is not None and k.sub not in ((1, 2) if fp4 else (1,)):
            return f"knobs with `sub` = {k.sub} ({'1 or 2' if fp4 else '1'} for {view.dtype})"
        if not fp4 and k.tma:
            return f"knobs with `tma` for {view.dtype} (the measured fp8 kernel copies by cp.async)"
        if fp4 and k.sub == 2 and k.stages == 0:
            return "knobs with `sub` 2 and `stages` 0 (two tiles a stage need the ring)"
        if fp4 and view.head_dim == 256 and k.stages == 0:
            return "knobs with `stages` 0 for FP4 at head_dim 256 (its ring only)"
        return None
    if k.stages is not None and not 2 <= k.stages <= 8:
        return f"knobs with `stages` = {k.stages} (2..8 for the multi kernel)"
    sub = 2 if k.sub is None else k.sub
    if sub not in (1, 2, 4):
        return f"knobs with `sub` = {sub} (1, 2 or 4 for the multi kernel)"
    if k.heads not in (1, 2) or view.num_kv_heads % k.heads:
        return f"knobs with `heads` = {k.heads} (1 or 2 dividing {view.num_kv_heads} KV heads)"
    if k.heads == 2 and (group > 8 or sub == 4):
        return f"knobs with `heads` 2 at a group of {group} / sub {sub} (groups <= 8, sub 1-2)"
    if k.ahead not in (1, 2):
        return f"knobs with `ahead` = {k.ahead} (1 or 2)"
    if view.head_dim not in (64, 128):
        return f"the multi kernel at head_dim {view.head_dim} (64 or 128)"
    if view.page_size < 16:
        return f"the multi kernel on pages of {view.page_size} tokens (>= 16)"
    if fp4:
        for t in (view.k_block_scale, view.v_block_scale):
            if t.stride(0) % 16 or t.data_ptr() % 16:
                return "the multi kernel on FP4 scale rows not 16-byte aligned (cp.async)"
    if _smem_bytes(view, k) > _SMEM:
        return f"knobs {k.label()}: {_smem_bytes(view, k)} bytes of shared memory (> {_SMEM})"
    tma = k.tma is None or k.tma
    if tma and view.k.is_cuda and _capability(view.k.device) < (9, 0):
        return "the multi kernel's TMA boxes before sm_90 (tma=False copies by cp.async)"
    return None


def _capability(device: torch.device) -> tuple[int, int]:
    from kvpool.attention.variants import _capability as cap

    return cap(device)


def _row_bytes(view: LayerView) -> int:
    d = view.head_dim
    return d // 2 if view.dtype in _FP4 else d * view.k.element_size()


def _smem_bytes(view: LayerView, k: GluonKnobs, stages: int = 3, sub: int = 2) -> int:
    """Shared memory of a program's ring in bytes.

    Its K and V tiles (and FP4 scale rows) and a barrier a stage; ``stages`` / ``sub`` where
    ``k`` leaves them None.
    """
    stages = stages if k.stages is None else k.stages
    sub = sub if k.sub is None else k.sub
    tile = 16 * (_row_bytes(view) + (view.head_dim // 16 if view.dtype in _FP4 else 0))
    return stages * sub * k.heads * 2 * tile + 8 * stages


# registers of the multi kernel per (sub, heads) at head_dim 64, group 8, the most of any
# dtype (sm_90 builds with Triton 3.6, tests/test_gluon_compile.py): they size the split model
_MULTI_REGS = {(1, 1): 96, (2, 1): 112, (4, 1): 120, (1, 2): 144, (2, 2): 168}


def programs_per_sm(view: LayerView, group: int, k: GluonKnobs) -> int:
    """Programs per multiprocessor of a multi plan in the split model.

    What registers (:data:`_MULTI_REGS`, doubled at head_dim 128 and for groups of 9..16) and
    shared memory allow, at most 24; ``k.per_sm`` when given.
    """
    if k.per_sm is not None:
        return k.per_sm
    sub = 2 if k.sub is None else k.sub
    regs = _MULTI_REGS[(sub, k.heads)] * (2 if view.head_dim == 128 or group > 8 else 1)
    if k.maxnreg is not None:
        regs = min(regs, k.maxnreg)
    by_regs = 65536 // (min(-(-regs // 8) * 8, 255) * 32)
    by_smem = (228 * 1024) // (_smem_bytes(view, k) + 1024)
    return max(1, min(24, by_regs, by_smem))


def env_knobs() -> GluonKnobs | None:
    """:data:`KNOBS_ENV` parsed (None when unset or empty)."""
    text = os.environ.get(KNOBS_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_knobs(text)
    except ValueError as e:  # (raised by every Gluon plan: say where the text came from)
        raise ValueError(f"environment {KNOBS_ENV}: {e}") from None


def pick(view: LayerView, group: int, given) -> GluonKnobs | None:
    """The knobs of a Gluon plan (None: the measured kernels' defaults).

    ``given`` (checked: ValueError where they cannot run), else :data:`KNOBS_ENV`'s or
    :data:`HD64_DEFAULTS`'s where they fit the layer.
    """
    k = as_knobs(given)
    if k is not None:
        if (why := knobs_unfit(view, group, k)) is not None:
            raise ValueError(f"`gluon_knobs`: the Gluon decode kernel does not run {why}")
        return k
    for k in (env_knobs(), _table(view, group)):
        if k is not None and knobs_unfit(view, group, k) is None:
            return k
    return None


def _table(view: LayerView, group: int) -> GluonKnobs | None:
    if view.head_dim == 64 and group <= 8:
        return HD64_DEFAULTS.get(view.dtype)
    return None


def plan_fields(view: LayerView, group: int, k: GluonKnobs, stages: int, per_sm: int,
                maxnreg: int | None, block_n: int) -> tuple[int, int, int, int | None]:  # fmt: skip
    """``(stages, block_n, per_sm, maxnreg)`` of a plan with knobs ``k``.

    Over the measured kernel's ``stages``, ``per_sm``, ``maxnreg`` and ``block_n`` (tokens a
    ring stage).
    """
    if k.multi:
        stages = 3 if k.stages is None else k.stages
        block_n = 16 * (2 if k.sub is None else k.sub)
        per_sm = programs_per_sm(view, group, k)
    else:
        stages = stages if k.stages is None else k.stages
        block_n = block_n if k.sub is None else 16 * k.sub
        if stages == 0:
            block_n = 16
        if k.per_sm is not None:
            per_sm = k.per_sm
        elif stages > 0:  # (a deeper ring may fit fewer programs than the model's)
            ring = _smem_bytes(view, k, stages, block_n // 16)
            per_sm = max(1, min(per_sm, (228 * 1024) // (ring + 1024)))
    return stages, block_n, per_sm, maxnreg if k.maxnreg is None else k.maxnreg


def multi_constants(dtype: str, head_dim: int, group: int, k: GluonKnobs, *, stages: int,
                    block_n: int, final: bool, softcap: bool, window: bool, sinks: bool,
                    head_fast: bool = True) -> dict:  # fmt: skip
    """The constexprs :func:`launch_multi` passes ``decode_gluon_multi.decode_kernel``.

    Also what ``tests/test_gluon_compile.py`` builds. ``softcap`` / ``window`` / ``sinks``:
    whether the call has one.
    """
    from kvpool.attention import variants

    fp4 = dtype in _FP4
    dec = (2, 2) if dtype == "fp4_mx_block16" else variants._GLUON_FP4_DEC if fp4 else (1, 1)
    return dict(
        G=group, D=head_dim, FINAL=final, FP4=fp4, E5M2=dtype == "fp8_e5m2",
        WIDE={"fp16": 1, "bf16": 2}.get(dtype, 0), DEC_K=dec[0], DEC_V=dec[1],
        HAS_SOFTCAP=softcap, HAS_WINDOW=window, HAS_SINKS=sinks, STAGES=stages,
        SUB=block_n // 16, HPP=k.heads, RESCALE=8.0 if k.rescale is None else float(k.rescale),
        TMA=k.tma is None or k.tma, HEAD_FAST=head_fast, AHEAD=k.ahead,
    )  # fmt: skip


def launch_multi(view, q, page_table, seq_lens, plan, out, scale, softcap, window, sinks,
                 calls=None) -> None:  # fmt: skip
    """Launch ``decode_gluon_multi.decode_kernel`` for ``plan`` (``plan.knobs.multi``).

    The caller merges the splits. Grid ``(H_kv / heads, B, splits)`` (B past 65,535: B
    first). With ``calls`` (a list) the launch is appended to it (:func:`kvpool._launch.call`).
    """
    from kvpool.attention.launch_decode import _tma_desc
    from kvpool.triton_kernels.decode_gluon_multi import decode_kernel

    k = plan.knobs
    bsz, hq, _ = q.shape
    s = plan.num_splits
    g = hq // view.num_kv_heads
    fp4 = view.dtype in _FP4
    if fp4:
        kbs, vbs = view.k_block_scale.view(torch.uint8), view.v_block_scale.view(torch.uint8)
        mx = view.dtype == "fp4_mx_block16"
        ksc, vsc = (kbs, vbs) if mx else (view.k_scale, view.v_scale)
    else:
        kbs = vbs = out  # (no block scales; 16-bit caches: no scales at all)
        wide = view.dtype in ("bf16", "fp16")
        ksc, vsc = (out, out) if wide else (view.k_scale, view.v_scale)
    hf = bsz <= 65535
    consts = multi_constants(
        view.dtype, view.head_dim, g, k, stages=plan.num_stages, block_n=plan.block_n,
        final=s == 1, softcap=softcap is not None, window=window is not None,
        sinks=sinks is not None, head_fast=hf,
    )  # fmt: skip
    if consts["TMA"]:
        consts.update(
            KD=_tma_desc(view.k.view(torch.uint8)), VD=_tma_desc(view.v.view(torch.uint8))
        )
    hp = view.num_kv_heads // k.heads
    grid = (hp, bsz, s) if hf else (bsz, hp, s)
    _launch.call(
        calls, decode_kernel, grid,
        q, view.k, view.v, kbs, vbs, ksc, vsc, page_table, seq_lens,
        sinks if sinks is not None else out, out,
        plan.part_out if s > 1 else out, plan.part_lse if s > 1 else out,
        q.stride(0), q.stride(1), view.k.stride(0), view.v.stride(0),
        kbs.stride(0) if fp4 else 0, vbs.stride(0) if fp4 else 0,
        page_table.stride(0), out.stride(0), out.stride(1), scale, float(softcap or 1.0),
        int(window or 0), view.page_size.bit_length() - 1, s, g,
        num_warps=1, **consts, **({} if plan.maxnreg is None else {"maxnreg": plan.maxnreg}),
    )  # fmt: skip
