"""Quantized KV write and the unfused dequantize read.

Launchers for the Triton kernels, with a torch path (``kvpool.formats``) for CPU tensors.

Layouts written (per layer, ``R`` rows = slots, ``H`` KV heads, ``D``/``Dv`` head dims; see
:class:`kvpool.pool.LayerView`):

- data ``[R, H, D]`` (fp8 / 16-bit / fp32) or ``[R, H, D/2]`` uint8 (FP4, element 2i in the low
  nibble); row ``slot`` receives token ``t`` where ``slot = loc[t]``;
- token-linear block scales: nvfp4 ``[R, H, D/16]`` e4m3, fp4_mx_block16 ``[R, H*D/16]`` ue8m0
  (the same bytes as ``[R, H, D/16]``), when the recipe has them;
- page-major block scales (nvfp4 recipes ``page_major`` and ``mixed``)
  ``[R/page_size, H, page_size, D/16]``: K scale of (slot, head h, block j) at
  ``[slot // page_size, h, slot % page_size, j]``; V scales with the 4-token interleave: within one
  (page, head) the ``page_size * D/16`` bytes are ordered ``[page_size/4, D/16, 4]``, i.e. the
  byte of (offset o, block j) sits at ``((o // 4) * (D/16) + j) * 4 + o % 4``
  (:func:`page_major_offsets`), so the scales of 4 consecutive tokens for one block are adjacent;
- the shared FP8 workspace (recipes ``mixed``/``linear_workspace``) is **not** written: it is a
  one-layer scratch that the FP8 prefill path fills from the cache right before it runs, so writing
  it here would cost bandwidth on every layer for data the next layer overwrites.

GPU path: one fused Triton launch per call writes K and V, data and every scale layout; no host
syncs (scales are read from the layer's device buffers inside the kernel). Slots outside
``[0, R)`` are skipped and non-finite values follow the rules in :mod:`kvpool.formats`; pass
``debug=True`` to check both first (that syncs). The torch path always checks and raises.
Slots must be distinct within one call, except padding slots (page 0, ``slot < page_size``),
which absorb padded tokens.
"""

from __future__ import annotations

import os
from operator import attrgetter, is_
from typing import TYPE_CHECKING

from kvpool import _launch, formats
from kvpool._host import as_device_tensor
from kvpool._launch import tensor_key
from kvpool._torch import torch

if TYPE_CHECKING:
    from kvpool.pool import LayerView

MODES = {
    "fp32": 0,
    "bf16": 0,
    "fp16": 0,
    "fp8_e4m3": 1,
    "fp8_e5m2": 2,
    "nvfp4": 3,
    "fp4_mx_block16": 4,
}
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BACKENDS = ("auto", "triton", "torch")


def _check(
    name: str,
    t: object,
    shape: tuple[int, ...] | None,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
) -> torch.Tensor:
    """Raise ``ValueError`` naming ``name`` unless ``t`` is a tensor of that shape/dtype/device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"`{name}` has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in dtypes:
        raise ValueError(
            f"`{name}` has dtype {t.dtype}, expected one of {', '.join(map(str, dtypes))}"
        )
    if t.device != device:
        raise ValueError(f"`{name}` is on {t.device}, the pool is on {device}")
    return t


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"`backend` = {backend!r}; expected one of {', '.join(_BACKENDS)}")
    if backend == "torch":
        return False
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton":
        if device.type != "cuda" and not interp:
            raise ValueError(
                f"`backend` = 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {device}"
            )
        return True
    return device.type == "cuda"


def page_major_offsets(
    loc: torch.Tensor, num_heads: int, head_dim: int, page_size: int, interleave: bool
) -> torch.Tensor:
    """Compute flat byte offsets of each token's block scales in a page-major buffer.

    Returns ``[T, H*D/16]`` int64 offsets into ``[R/page_size, H, page_size, D/16]``;
    ``interleave`` selects V's 4-token interleave.
    """
    db = head_dim // formats.BLOCK
    slot = loc.to(torch.int64)[:, None]
    b = torch.arange(num_heads * db, device=loc.device)[None, :]
    page, off = slot // page_size, slot % page_size
    h, j = b // db, b % db
    base = (page * num_heads + h) * (page_size * db)
    if interleave:
        inner = ((off // 4) * db + j) * 4 + off % 4
    else:
        inner = off * db + j
    return base + inner


def _check_inputs(
    layer: LayerView, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None
) -> int:
    dev = layer.k.device
    _check("loc", loc, None, (torch.int32, torch.int64), dev)
    if loc.dim() != 1:
        raise ValueError(f"`loc` must be 1-D [T], got shape {tuple(loc.shape)}")
    t = loc.shape[0]
    _check("k", k, (t, layer.num_kv_heads, layer.head_dim), _IN_DTYPES, dev)
    if layer.is_mla:
        if v is not None:
            raise ValueError(f"`v` must be None: layer {layer.layer} is MLA (one latent in `k`)")
    else:
        if v is None:
            raise ValueError(f"`v` is required: layer {layer.layer} stores K and V")
        _check("v", v, (t, layer.num_kv_heads, layer.v_head_dim), _IN_DTYPES, dev)
    return t


def check_values(
    layer: LayerView, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None
) -> None:
    """Run the data-dependent checks (a host sync on the GPU).

    Finite K/V, slots in ``[0, R)``, no slot outside the padding page twice.

    Raises
    ------
    ValueError
        Naming the argument, the token and the value.
    """
    rows = layer.k.shape[0]
    bad = (loc < 0) | (loc >= rows)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"`loc[{i}]` = {int(loc[i])} is outside the pool's slots [0, {rows})")
    real = loc[loc >= layer.page_size]
    if real.numel() != torch.unique(real).numel():
        raise ValueError("`loc` repeats a slot outside the padding page; slots must be distinct")
    for name, x in (("k", k), ("v", v)):
        if x is None:
            continue
        fin = torch.isfinite(x)
        if not bool(fin.all()):
            idx = tuple(int(i) for i in (~fin).nonzero()[0])
            raise ValueError(
                f"`{name}` has a non-finite value {float(x[idx])} at {list(idx)} "
                f"(layer {layer.layer})"
            )


def _scale_of(buf: torch.Tensor | None) -> torch.Tensor | float:
    return 1.0 if buf is None else buf


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _write_torch(layer: LayerView, loc: torch.Tensor, x: torch.Tensor, which: str) -> None:
    data_buf = getattr(layer, which)
    bs_lin = getattr(layer, f"{which}_block_scale")
    bs_pm = getattr(layer, f"{which}_block_scale_page_major")
    data, bs = formats.quantize(x, layer.dtype, _scale_of(getattr(layer, f"{which}_scale")))
    idx = loc.to(torch.int64)
    _u8(data_buf)[idx] = _u8(data)
    if bs is None:
        return
    t = x.shape[0]
    b = _u8(bs).reshape(t, -1)
    if bs_lin is not None:
        _u8(bs_lin).reshape(bs_lin.shape[0], -1)[idx] = b
    if bs_pm is not None:
        off = page_major_offsets(
            loc, layer.num_kv_heads, x.shape[-1], layer.page_size, which == "v"
        )
        _u8(bs_pm).view(-1)[off.reshape(-1)] = b.reshape(-1)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def write_kv(
    layer: LayerView,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    *,
    debug: bool = False,
    backend: str = "auto",
    block_t: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Quantize ``k``/``v`` into one layer's buffers at slots ``loc``.

    Parameters
    ----------
    layer : LayerView
        The layer's buffers (``pool.layer(i)``).
    loc : torch.Tensor or numpy.ndarray
        ``[T]`` int32/int64 slot indices (``page * page_size + offset``), on the pool's device,
        or a numpy int32/int64 array (what :func:`kvpool.extend_slots` / :func:`kvpool.decode_slots`
        return), copied there (pinned, ``non_blocking``: no sync).
    k : torch.Tensor
        ``[T, H, D]`` bf16/fp16/fp32 (any strides), K after rotary embedding (MLA: the latent).
    v : torch.Tensor or None
        ``[T, H, Dv]`` likewise; None for MLA layers.
    debug : bool
        Check slots and finiteness first (host sync) and raise ``ValueError``.
    backend : {"auto", "triton", "torch"}
        ``auto``: Triton for CUDA tensors, torch (always checked) otherwise. ``triton`` also runs
        CPU tensors under ``TRITON_INTERPRET=1``.
    block_t, num_warps : int or None
        Triton tuning: tokens per program (a power of two) and warps per program; None picks
        them from the head size (FP4: one warp per 1,024 values of a token, so a Llama-3.1-8B
        token tensor is one single-warp program; other dtypes: 4,096 values and 4 warps per
        program).

    Raises
    ------
    ValueError
        A shape, dtype or device that does not fit the layer; on the torch path (or with
        ``debug``) also out-of-range/repeated slots and non-finite values.
    """
    # a write of a kind seen before: replay its launch (see _replay_write)
    if not debug and _replay_write(layer, loc, k, v, backend, block_t, num_warps):
        return
    _write_checked(layer, loc, k, v, debug, backend, block_t, num_warps)


def _write_checked(layer, loc, k, v, debug, backend, block_t, num_warps) -> None:
    """:func:`write_kv` past its record lookup.

    Every check, the write, and (on the Triton path, without ``debug``) a record of its launch
    for the next call of its kind.
    """
    key = None if debug else _write_key(layer, loc, k, v, backend, block_t, num_warps)
    loc = as_device_tensor("loc", loc, layer.k.device, (torch.int32, torch.int64))
    t = _check_inputs(layer, loc, k, v)
    triton_path = _use_triton(backend, layer.k.device)
    if debug or not triton_path:
        check_values(layer, loc, k, v)
    if t == 0:
        return
    if not triton_path:
        _write_torch(layer, loc, k, "k")
        if v is not None:
            _write_torch(layer, loc, v, "v")
        return
    fn, grid, args, kwargs, per_call = _write_call(layer, loc, k, v, block_t, num_warps)
    if key is None:
        fn[grid](*args, **kwargs)
        return
    launch = _launch.Launch(fn, grid, args, kwargs, per_call, layer.k.device)
    launch(*per_call)
    rec = (_WRITE_VIEW(layer), launch, MODES[layer.dtype] >= 3, _launch.generation(layer))
    _launch.records(layer)[key] = rec


# The layer fields a write reads (a record is valid while they are the same objects).
_WRITE_VIEW = attrgetter("dtype", "page_size", "num_kv_heads", "head_dim", "v_head_dim", "k",
                         "v", "k_block_scale", "v_block_scale", "k_block_scale_page_major",
                         "v_block_scale_page_major", "k_scale", "v_scale")  # fmt: skip


def _write_key(layer, loc, k, v, backend, block_t, num_warps) -> tuple | None:
    """The record key of a write: everything its checks and the kernel's specialization read.

    ``loc``, ``k``, ``v``: dtype, shape, strides, device, address modulo 16
    (:func:`kvpool._launch.tensor_key`); the options. None (not recorded) for other types.
    """
    if not _launch.RECORD or type(loc) is not torch.Tensor or type(k) is not torch.Tensor:
        return None
    if v is not None and type(v) is not torch.Tensor:
        return None
    try:
        # (v is k: a record made with one tensor for both has one set of argument positions)
        key = ("write", tensor_key(loc), tensor_key(k), tensor_key(v), v is k, backend, block_t,
               num_warps)  # fmt: skip
        hash(key)
    except TypeError:
        return None
    return key


def _replay_write(layer, loc, k, v, backend, block_t, num_warps) -> bool:
    """Launch the write recorded for a call like this one with these tensors; False if none.

    A record is made by a write of the same key (:func:`_write_key`, built inline here: this
    is the per-layer hot path) that passed every check (the Triton path only: the torch path
    checks values on every call, so it is never recorded). It applies while the layer is at
    the record's generation (:class:`kvpool._launch.Generation`), or its fields are the same.
    """
    recs = layer.__dict__.get("_launch_records")
    if not recs or not _launch.RECORD:
        return False
    tensor = torch.Tensor
    if type(loc) is not tensor or type(k) is not tensor:
        return False
    lp, kp = loc.data_ptr(), k.data_ptr()
    if v is None:
        vkey = None
    elif type(v) is not tensor:
        return False
    else:
        vp = v.data_ptr()
        vkey = (v.dtype, v.shape, v.stride(), v.get_device(), vp & 15)
    # (= _write_key's, written out)
    key = ("write", (loc.dtype, loc.shape, loc.stride(), loc.get_device(), lp & 15),
           (k.dtype, k.shape, k.stride(), k.get_device(), kp & 15), vkey, v is k,
           backend, block_t, num_warps)  # fmt: skip
    try:
        rec = recs.get(key)
    except TypeError:  # (an unhashable option: checked and refused as usual)
        return False
    if rec is None:
        return False
    gen = layer.__dict__.get("_gen")
    if gen is None or rec[3] != gen:
        if not all(map(is_, rec[0], _WRITE_VIEW(layer))):
            return False
    if rec[2]:  # FP4: the kernel reads element pairs as words (a copy where they straddle)
        k = _words(k)
        kp = k.data_ptr()
        if v is not None:
            v = _words(v)
            vp = v.data_ptr()
    if v is None:
        v, vp = k, kp
    _launch.replay((rec[1],), (loc, k, v), (lp, kp, vp))
    return True


def _launch_write(
    layer: LayerView,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    block_t: int | None,
    num_warps: int | None,
    ablate: int = 0,
) -> None:
    """Launch the fused write.

    ``ablate`` != 0 leaves stages out (benchmarks only, see ``quant_write._quant_fp4``).
    """
    fn, grid, args, kwargs, _ = _write_call(layer, loc, k, v, block_t, num_warps, ablate)
    fn[grid](*args, **kwargs)


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x`` as words of element pairs: FP4 kernels load (2i, 2i+1) as one word.

    int32 for 16-bit values, int64 for fp32; copied first when a pair would straddle its layout.
    """
    if x.stride(2) != 1 or x.stride(0) % 2 or x.stride(1) % 2:
        x = x.contiguous()
    return x.view(torch.int64 if x.dtype == torch.float32 else torch.int32)


def _write_call(
    layer: LayerView,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    block_t: int | None,
    num_warps: int | None,
    ablate: int = 0,
) -> tuple:
    """The fused write's launch: ``(kernel, grid, args, kwargs, per_call)``.

    ``per_call``: the call's ``(loc, k, v)`` as the kernel takes them (FP4: as words; MLA: ``k``
    twice), for :class:`kvpool._launch.Launch`.
    """
    from kvpool.triton_kernels.quant_write import quant_write_kernel

    mode = MODES[layer.dtype]
    t = loc.shape[0]
    rows = layer.k.shape[0]
    h = layer.num_kv_heads

    fp4 = mode >= 3

    per_call = [loc]

    def args(which: str, x: torch.Tensor, d: int) -> list[object]:
        if fp4:
            x = _words(x)
        per_call.append(x)
        data = _u8(getattr(layer, which))
        lin = getattr(layer, f"{which}_block_scale")
        pm = getattr(layer, f"{which}_block_scale_page_major")
        sc = getattr(layer, f"{which}_scale")
        lin_u8 = data if lin is None else _u8(lin)
        pm_u8 = data if pm is None else _u8(pm)
        return [
            x,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            data,
            data.stride(0),
            lin_u8,
            h * d // formats.BLOCK,
            pm_u8,
            data if sc is None else sc,
        ]

    ka = args("k", k, layer.head_dim)
    if v is None:
        va, dv, kinds = ka, layer.head_dim, 1
        per_call.append(per_call[1])
    else:
        va, dv, kinds = args("v", v, layer.v_head_dim), layer.v_head_dim, 2
    bck, bcv = _pow2(h * layer.head_dim), _pow2(h * dv)
    tile = max(bck, bcv)
    if num_warps is None:
        num_warps = min(8, max(1, tile // 1024)) if fp4 else 4
    if block_t is None:
        block_t = max(1, min(64, (1024 * num_warps if fp4 else 4096) // tile))
    if block_t & (block_t - 1):
        raise ValueError(f"`block_t` = {block_t} must be a power of two")
    lin = layer.k_block_scale is not None
    pm = layer.k_block_scale_page_major is not None
    kind = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
    grid = ((t + block_t - 1) // block_t, kinds)
    kwargs = dict(
        H=h,
        DK=layer.head_dim,
        DV=dv,
        PAGE=layer.page_size,
        MODE=mode,
        WRITE_LINEAR=lin,
        WRITE_PM=pm,
        K_KIND=kind[k.dtype],
        V_KIND=kind[(v if v is not None else k).dtype],
        BLOCK_T=block_t,
        BLOCK_CK=bck,
        BLOCK_CV=bcv,
        ABLATE=ablate,
        num_warps=num_warps,
    )
    return quant_write_kernel, grid, (loc, t, rows, *ka, *va), kwargs, tuple(per_call)


def dequantize_kv(
    layer: LayerView,
    loc: torch.Tensor,
    which: str = "k",
    out_dtype: torch.dtype = torch.float32,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Read slots ``loc`` of one layer's K or V back as ``[N, H, D]`` values.

    Parameters
    ----------
    layer : LayerView
    loc : torch.Tensor
        ``[N]`` int32/int64 slots.
    which : {"k", "v"}
    out_dtype : torch.dtype
        fp32, bf16 or fp16 (computed in fp32, then cast).
    backend : {"auto", "triton", "torch"}

    Raises
    ------
    ValueError
        Bad arguments; on the torch path also slots outside ``[0, R)``.
    """
    if which not in ("k", "v") or (which == "v" and layer.is_mla):
        raise ValueError(f"`which` = {which!r}; expected 'k'" + ("" if layer.is_mla else " or 'v'"))
    dev = layer.k.device
    _check("loc", loc, None, (torch.int32, torch.int64), dev)
    if loc.dim() != 1:
        raise ValueError(f"`loc` must be 1-D [N], got shape {tuple(loc.shape)}")
    if out_dtype not in _IN_DTYPES:
        raise ValueError(f"`out_dtype` = {out_dtype}; expected fp32, bf16 or fp16")
    data = getattr(layer, which)
    d = layer.head_dim if which == "k" else layer.v_head_dim
    h, n, rows = layer.num_kv_heads, loc.shape[0], data.shape[0]
    lin = getattr(layer, f"{which}_block_scale")
    pm = getattr(layer, f"{which}_block_scale_page_major")
    sc = getattr(layer, f"{which}_scale")
    use_triton = _use_triton(backend, dev)
    bs: torch.Tensor | None = None  # [N, H*D/16] bytes, gathered by token (device op, no sync)
    if lin is not None and not use_triton:
        bs = _u8(lin).reshape(rows, -1)[loc.to(torch.int64).clamp(0, rows - 1)]
    elif lin is None and pm is not None:  # the kernel reads token-linear scales: gather them
        off = page_major_offsets(loc.clamp(0, rows - 1), h, d, layer.page_size, which == "v")
        bs = _u8(pm).view(-1)[off]
    if not use_triton:
        bad = (loc < 0) | (loc >= rows)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"`loc[{i}]` = {int(loc[i])} is outside the pool's slots [0, {rows})")
        raw = _u8(data)[loc.to(torch.int64)]
        if layer.dtype in formats._FP8:
            raw = raw.view(formats.storage_dtype(layer.dtype))
        b = None if bs is None else bs.reshape(n, h, d // formats.BLOCK)
        if b is not None and layer.dtype == "nvfp4":
            b = b.view(torch.float8_e4m3fn)
        return formats.dequantize(raw, b, layer.dtype, _scale_of(sc), out_dtype)
    from kvpool.triton_kernels.dequant import dequant_kernel

    out = torch.empty((n, h, d), dtype=out_dtype, device=dev)
    if n == 0:
        return out
    block_c = _pow2(h * d)
    block_t = max(1, min(64, 4096 // block_c))
    du8 = _u8(data)
    by_token = lin is None
    bsp = _u8(lin) if lin is not None else (du8 if bs is None else bs.contiguous())
    dequant_kernel[((n + block_t - 1) // block_t,)](
        loc,
        n,
        rows,
        du8,
        du8.stride(0),
        bsp,
        h * d // formats.BLOCK,
        by_token,
        du8 if sc is None else sc,
        out,
        H=h,
        D=d,
        MODE=MODES[layer.dtype],
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        num_warps=4,
    )
    return out
