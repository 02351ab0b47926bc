"""Pure-torch reference quantizers for every KV cache dtype (independent of the Triton kernels).

This module is the executable form of the "KV cache formats and their sources" section of
docs/architecture.md. The Triton write kernels (``kvpool.triton_kernels.quant_write``) must
match :func:`quantize` bit for bit on the GPU; the kernels build bytes with integer arithmetic,
this module with ``torch.frexp`` / ``torch.round`` on an explicit grid, so the two
implementations share no code.

Rules (all formats)
-------------------
- Saturation: values beyond the format's max are clamped to it, never turned into NaN/Inf. No
  plain float -> fp8 cast is trusted for that (its overflow behaviour differs between libraries
  and versions): every value is clamped and rounded onto the format's grid first, and only exactly
  representable values are cast.
- Rounding: nearest, ties to even (fp8 elements, e4m3 block scales of nvfp4, E2M1 elements).
- Signed zero: a negative value that rounds to zero keeps its sign bit (fp8 byte 0x80, E2M1
  nibble 0x8), as the hardware conversions do.

Non-finite inputs (the GPU write path follows the same rules without a host sync; the CPU path
of :func:`kvpool.write.write_kv` and its debug mode raise instead):

=================  ====================================  =====================================
dtype              NaN                                   +-Inf
=================  ====================================  =====================================
fp32/bf16/fp16     kept                                  kept (cast as torch casts)
fp8_e4m3           NaN (byte 0x7F)                       +-448 (saturated, like ``satfinite``)
fp8_e5m2           NaN (byte 0x7F)                       +-57344 (saturated, like ``satfinite``)
nvfp4              0 (E2M1 has no NaN)                   +-FLT_MAX before scaling: the block
                                                         scale saturates (448), the element
                                                         stores +-6
fp4_mx_block16     0                                     +-MX_MAX (= 6 * 2^125) before scaling:
                                                         exponent byte 252, element +-6
=================  ====================================  =====================================

Formats
-------
- ``fp8_e4m3`` / ``fp8_e5m2``: ``q = rne(clamp(x / scale, -max, max))``, max 448 / 57344;
  dequantized ``q * scale``.
- ``nvfp4``: per block of 16 values along the last dim, ``s = rne_e4m3(min(amax / 6 / g, 448))``
  with ``g`` the global scale; elements ``rne_e2m1(clamp(x / (s * g), -6, 6))`` with ``s`` the
  *decoded* e4m3 scale; a block whose ``s`` rounds to 0 stores all-zero nibbles. Dequantized
  ``(e2m1 * s) * g``.
- ``fp4_mx_block16``: inputs are first clamped to +-MX_MAX = 6 * 2^125 (about 2.55e38, the
  largest magnitude whose block still decodes to a finite fp32; so bytes 253 and 254 never occur);
  ``e = ceil(log2(amax / 6))`` (exact, from the float's bits; an amax / 6 that underflows to 0
  counts as the smallest exponent), stored as ``clamp(e + 127, 0, 254)``; an all-zero block
  stores 127; elements
  ``rne_e2m1(clamp(x / 2^(stored - 127), -6, 6))``. Dequantized ``e2m1 * 2^(stored - 127)``.
- FP4 packing: element ``2i`` in the low nibble, ``2i + 1`` in the high nibble; sign in bit 3.
"""

from __future__ import annotations

from kvpool._torch import torch

#: Every KV dtype name :func:`quantize` accepts.
DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16")

#: Largest finite magnitude of each fp8 format (OCP e4m3fn, e5m2).
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: Values per block scale of the FP4 formats (along head_dim).
BLOCK = 16
#: The byte every fp8 NaN is stored as.
FP8_NAN_BYTE = 0x7F
#: fp4_mx_block16 inputs are clamped to this magnitude (6 * 2^125): larger blocks would decode
#: to inf in fp32.
MX_MAX = 6.0 * 2.0**125
#: E2M1 magnitudes by code (bits 0-2); bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# (mantissa bits, smallest normal exponent) of each grid
_GRID = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14), "e2m1": (1, 0)}
_FLT_MAX = torch.finfo(torch.float32).max


def storage_dtype(dtype: str) -> torch.dtype:
    """Return the torch dtype of a cache's data buffer (``uint8`` for the packed FP4 formats)."""
    _check_dtype(dtype)
    if dtype in _FLOAT:
        return _FLOAT[dtype]
    if dtype in _FP8:
        return _FP8[dtype]
    return torch.uint8


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(
            f"`dtype` = {dtype!r} is not a KV dtype; expected one of {', '.join(DTYPES)}"
        )


def _scale_tensor(
    scale: float | torch.Tensor, device: torch.device, name: str = "scale"
) -> torch.Tensor:
    """``scale`` as a 0-d float32 tensor on ``device`` (no host sync for tensors)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"`{name}` must be a float or a 0-d/[1] tensor, got shape {tuple(scale.shape)}"
            )
        return scale.reshape(()).to(device=device, dtype=torch.float32)
    s = float(scale)
    if not (s > 0 and s != float("inf")):
        raise ValueError(f"`{name}` = {s}: scales must be finite and > 0")
    return torch.tensor(s, dtype=torch.float32, device=device)


def _round_to_grid(a: torch.Tensor, grid: str) -> torch.Tensor:
    """Round non-negative finite fp32 ``a`` (<= the grid's max) to the grid, ties to even.

    The quantum is ``2^(max(floor(log2 a), emin) - mbits)``; ``a / quantum``
    is exact (power of two) and ``torch.round`` rounds half to even.
    """
    mbits, emin = _GRID[grid]
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    exp = torch.clamp(e - 1, min=emin)
    quantum = torch.ldexp(torch.ones_like(a), (exp - mbits).to(torch.float32))
    return torch.round(a / quantum) * quantum


def _fp8_quantize(y: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 ``y`` (already divided by the scale) -> fp8 tensor, saturating, RNE, NaN -> 0x7F."""
    vmax = FP8_MAX[dtype]
    nan = torch.isnan(y)
    a = torch.clamp(torch.nan_to_num(y.abs(), nan=0.0), max=vmax)  # +-inf -> max
    q = torch.copysign(_round_to_grid(a, dtype), y)
    out = q.to(_FP8[dtype])  # exact: q is on the grid
    out.view(torch.uint8)[nan] = FP8_NAN_BYTE
    return out


def _e2m1_codes(q: torch.Tensor, sign_from: torch.Tensor) -> torch.Tensor:
    """fp32 ``q`` (already divided by the block scale) -> E2M1 codes 0..15 (uint8)."""
    a = torch.clamp(torch.nan_to_num(q.abs(), nan=0.0), max=E2M1_MAX)
    g = _round_to_grid(a, "e2m1")
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=q.device)
    mag = torch.searchsorted(grid, g.contiguous())  # exact match: g is on the grid
    sign = torch.signbit(sign_from).to(torch.int64)
    return (mag | (sign << 3)).to(torch.uint8)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes -> [..., D/2] bytes: element 2i low nibble, 2i+1 high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """[..., D/2] bytes -> [..., D] codes."""
    lo = data & 0xF
    hi = data >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = grid[(codes & 7).to(torch.int64)]
    return torch.where((codes & 8) != 0, -mag, mag)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    if d % BLOCK:
        raise ValueError(f"`x` last dim is {d}: FP4 dtypes need a multiple of {BLOCK}")
    return x.reshape(*x.shape[:-1], d // BLOCK, BLOCK)


def _sanitize_fp4(xb: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(xb.float(), nan=0.0, posinf=_FLT_MAX, neginf=-_FLT_MAX)


def mx_exponent_bytes(amax: torch.Tensor) -> torch.Tensor:
    """Compute UE8M0 block-scale bytes from block amaxes.

    ``clamp(ceil(log2(amax / 6)) + 127, 0, 254)``, 127 for all-zero blocks; ``ceil(log2)`` is
    exact (from ``frexp``, not ``log2``).
    """
    r = amax.float() / E2M1_MAX
    m, e = torch.frexp(r)  # r = m * 2^e, m in [0.5, 1)
    ceil_log2 = torch.where(m == 0.5, e - 1, e)
    ceil_log2 = torch.where(r == 0, torch.full_like(ceil_log2, -1000), ceil_log2)  # underflow
    stored = torch.clamp(ceil_log2.to(torch.int64) + 127, 0, 254)
    stored = torch.where(amax == 0, torch.full_like(stored, 127), stored)
    return stored.to(torch.uint8)


def quantize(
    x: torch.Tensor, dtype: str, scale: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize ``x`` into a KV dtype's storage (the reference every write path must match).

    Parameters
    ----------
    x : torch.Tensor
        Float tensor ``[..., D]`` (fp32, bf16 or fp16); FP4 dtypes need ``D % 16 == 0``.
    dtype : str
        One of :data:`DTYPES`.
    scale : float or torch.Tensor
        fp8: the per-tensor scale (``x / scale`` is stored); nvfp4: the global scale ``g``;
        ignored by the other dtypes. A float or a 0-d / ``[1]`` float32 tensor.

    Returns
    -------
    data : torch.Tensor
        fp8: ``float8_e4m3fn`` / ``float8_e5m2`` ``[..., D]``; FP4: ``uint8`` ``[..., D/2]``
        (element 2i in the low nibble); 16/32-bit: ``x`` cast.
    block_scale : torch.Tensor or None
        nvfp4: ``float8_e4m3fn`` ``[..., D/16]``; fp4_mx_block16: ``uint8`` ``[..., D/16]``
        (ue8m0, bias 127); else None.

    Raises
    ------
    ValueError
        Unknown ``dtype``, a non-float ``x``, ``D`` not a multiple of 16 for FP4, a bad ``scale``.

    Examples
    --------
    >>> data, _ = quantize(torch.tensor([1000.0, -600.0, 3.0, 0.01]), "fp8_e4m3")
    >>> [hex(b) for b in data.view(torch.uint8).tolist()]
    ['0x7e', '0xfe', '0x44', '0x5']
    """
    _check_dtype(dtype)
    if not x.is_floating_point() or x.dtype in _FP8.values():
        raise ValueError(f"`x` must be fp32/bf16/fp16, got {x.dtype}")
    if dtype in _FLOAT:
        t = _FLOAT[dtype]
        if torch.finfo(t).max < torch.finfo(x.dtype).max:
            # saturate: a finite value beyond the cache dtype's max (fp32 or bf16 into fp16,
            # fp32 into bf16) would round to Inf in the cast; NaN and +-Inf pass unchanged, as
            # the cast keeps them. Clamped in fp32: bf16 rounds fp16's max, 65504, up to 65536.
            m = torch.finfo(t).max
            x = x.float()
            x = torch.where(x.isinf(), x, x.clamp(-m, m))
        return x.to(t), None
    if dtype in _FP8:
        s = _scale_tensor(scale, x.device)
        return _fp8_quantize(x.float() / s, dtype), None
    xb = _sanitize_fp4(_blocks(x))
    amax = xb.abs().amax(dim=-1)
    if dtype == "nvfp4":
        g = _scale_tensor(scale, x.device)
        s_code = _fp8_quantize((amax / E2M1_MAX) / g, "fp8_e4m3")  # saturates at 448
        s_dec = s_code.float()
        denom = (s_dec * g).unsqueeze(-1)
        zero = (s_dec == 0).unsqueeze(-1)
        q = xb / torch.where(zero, torch.ones_like(denom), denom)
        codes = _e2m1_codes(q, xb)
        codes = torch.where(zero, torch.zeros_like(codes), codes)
        block_scale = s_code
    else:
        xb = torch.clamp(xb, -MX_MAX, MX_MAX)
        amax = torch.clamp(amax, max=MX_MAX)
        stored = mx_exponent_bytes(amax)
        inv = torch.ldexp(torch.ones_like(amax), 127.0 - stored.float()).unsqueeze(-1)  # exact
        codes = _e2m1_codes(xb * inv, xb)
        block_scale = stored
    return _pack_nibbles(codes.flatten(-2)), block_scale


def dequantize(
    data: torch.Tensor,
    block_scale: torch.Tensor | None,
    dtype: str,
    scale: float | torch.Tensor = 1.0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: stored values -> ``[..., D]`` in ``out_dtype``.

    Computes in fp32: fp8 ``q * scale``; nvfp4 ``(e2m1 * s) * g``; fp4_mx_block16
    ``e2m1 * 2^(stored - 127)``; then casts to ``out_dtype``.

    Raises
    ------
    ValueError
        Unknown ``dtype``, a ``data``/``block_scale`` dtype or shape that does not fit it.
    """
    _check_dtype(dtype)
    if dtype in _FLOAT:
        return data.to(out_dtype)
    if dtype in _FP8:
        if data.dtype == torch.uint8:
            data = data.view(_FP8[dtype])
        if data.dtype != _FP8[dtype]:
            raise ValueError(f"`data` is {data.dtype}, expected {_FP8[dtype]} for {dtype}")
        s = _scale_tensor(scale, data.device)
        return (data.float() * s).to(out_dtype)
    if data.dtype != torch.uint8:
        raise ValueError(f"`data` is {data.dtype}, expected torch.uint8 (packed E2M1) for {dtype}")
    if block_scale is None:
        raise ValueError(f"`block_scale` is required for {dtype}")
    d = data.shape[-1] * 2
    if block_scale.shape[-1] * BLOCK != d or block_scale.shape[:-1] != data.shape[:-1]:
        raise ValueError(
            f"`block_scale` shape {tuple(block_scale.shape)} does not match `data` shape "
            f"{tuple(data.shape)} (expected [..., {d // BLOCK}])"
        )
    vals = _e2m1_decode(_unpack_nibbles(data))
    vb = vals.reshape(*vals.shape[:-1], d // BLOCK, BLOCK)
    if dtype == "nvfp4":
        if block_scale.dtype == torch.uint8:
            block_scale = block_scale.view(torch.float8_e4m3fn)
        g = _scale_tensor(scale, data.device)
        out = (vb * block_scale.float().unsqueeze(-1)) * g
    else:
        if block_scale.dtype != torch.uint8:
            raise ValueError(f"`block_scale` is {block_scale.dtype}, expected torch.uint8 (ue8m0)")
        s = torch.ldexp(
            torch.ones(block_scale.shape, device=data.device), block_scale.float() - 127.0
        )
        out = vb * s.unsqueeze(-1)
    return out.reshape(vals.shape).to(out_dtype)
