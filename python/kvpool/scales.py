"""Per-layer KV scales: fp8 ``k_scale``/``v_scale`` and nvfp4 global scales.

Three sources, one destination: every loader ends in ``pool.set_kv_scales(k, v, source=...)``,
the buffers both the write kernels and the attention kernels read.

- :func:`load_checkpoint_scales`: safetensors checkpoints (a model directory with
  ``model.safetensors.index.json`` and its shards, a single ``.safetensors`` file, or an index
  json). Names recognised, per layer ``N`` (any prefix before ``layers.N.``):
  ``...layers.N.self_attn.k_scale`` / ``v_scale``, the fused projection
  ``...self_attn.qkv_proj.{k,v}_scale`` (llm-compressor), the per-projection
  ``...self_attn.k_proj.k_scale`` / ``...v_proj.v_scale`` (ModelOpt),
  ``...self_attn.attn.{k,v}_scale``
  and the older single ``...kv_scale`` (k = v). ``weight_scale`` / ``input_scale`` are not KV
  scales. Only one of k/v for a layer: it is used for both. A per-head vector is reduced to its
  max (pools are per-tensor) with a :class:`KVScaleWarning`. Zero, negative or non-finite
  scales, conflicting duplicates and layers left without a scale raise ``ValueError`` naming the
  layer.
- :func:`load_json_scales`: ``{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor":
  {"<tp_rank>": {"<layer>": s}}}}``, ``s`` one number (k = v) or ``[k, v]``. A missing rank or
  layer, a dtype that does not match the pool, or a layer given twice with different scales
  (``"1"`` and ``"01"``, or a repeated key) raises (never a silent 1.0 or last-one-wins).
- :class:`Calibrator` / :func:`calibrate`: amax of sample K/V per layer (a stream of batches,
  reduced on the device); fp8 scale = amax / format max (optionally rounded up to a power of
  two), nvfp4 global scale = amax / (6 * 448); :meth:`Calibrator.write_json` writes the JSON
  format above.

A pool whose fp8_e4m3 scales were never set warns once on its first write
(:class:`MissingKVScalesWarning`); e5m2 and nvfp4 only log.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool._args import as_index, is_bool

if TYPE_CHECKING:
    import torch

    from kvpool.pool import KVPool

logger = logging.getLogger("kvpool.scales")

#: KV dtypes that keep per-layer scales (fp8: k/v scale; nvfp4: global scale).
SCALED_DTYPES = ("fp8_e4m3", "fp8_e5m2", "nvfp4")
#: dtype names of the JSON format <-> kvpool dtype names.
JSON_DTYPES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "nvfp4": "nvfp4"}
_FMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "nvfp4": 6.0 * 448.0}

_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn\.|attention\.|attn\.)?"
    r"(?:(qkv_proj|k_proj|v_proj|attn)\.)?(k_scale|v_scale|kv_scale)$"
)


class KVScaleWarning(UserWarning):
    """A scale source was usable but lossy (per-head scales reduced to their max)."""


class MissingKVScalesWarning(UserWarning):
    """An fp8_e4m3 cache runs with k/v scale 1.0 because no scales were provided."""


def _ranges(layers: Iterable[int]) -> str:
    xs = sorted(layers)
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def warn_missing_scales(layer_dtypes: Mapping[int, str]) -> None:
    """Warn (fp8_e4m3) or log (fp8_e5m2, nvfp4) about layers that use scale 1.0.

    ``layer_dtypes`` maps each KV layer to its dtype. Called once per pool, on the first write,
    when no scales were ever set.
    """
    by = {d: [i for i, x in layer_dtypes.items() if x == d] for d in SCALED_DTYPES}
    how = (
        "provide scales with kvpool.scales.load_checkpoint_scales(pool, path), "
        "kvpool.scales.load_json_scales(pool, path, tp_rank), kvpool.scales.calibrate(...), "
        "or pool.set_kv_scales(k_scales, v_scales)"
    )
    if by["fp8_e4m3"]:
        n = len(by["fp8_e4m3"])
        warnings.warn(
            f"{n} of {len(layer_dtypes)} KV layers (layers {_ranges(by['fp8_e4m3'])}) are fp8_e4m3 "
            f"with k/v scale 1.0: values beyond 448 saturate and small ones lose precision; {how}",
            MissingKVScalesWarning,
            stacklevel=4,  # the caller of pool.write
        )
    if by["fp8_e5m2"]:
        logger.info(
            "%d fp8_e5m2 KV layers use k/v scale 1.0 (e5m2's range makes that usable)",
            len(by["fp8_e5m2"]),
        )
    if by["nvfp4"]:
        logger.info("%d nvfp4 KV layers use global scale 1.0; %s", len(by["nvfp4"]), how)


def _check_scale(layer: int, what: str, x: float) -> float:
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"layer {layer}: {what} = {x}; KV scales must be finite and > 0")
    return x


def _show(x: Any, limit: int = 60) -> str:
    """``repr(x)`` for an error message, shortened (a 400-digit int, a whole JSON object)."""
    try:
        r = repr(x)
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        return f"<an int of {x.bit_length()} bits>"
    return r if len(r) <= limit else f"{r[: limit // 2]}...{r[-limit // 4 :]} ({len(r)} chars)"


def _int_arg(name: str, x: Any, hint: str) -> int:
    """``x`` as an int (:func:`kvpool._args.as_index`), else ValueError with ``hint``."""
    try:
        return as_index(x)
    except TypeError:
        raise ValueError(f"`{name}` = {_show(x)}: {hint}") from None


def _real_float(x: Any) -> float:
    """A real-number scalar as a float.

    numbers.Real (numpy floating/integer scalars included), 0-d real numpy arrays and tensors.
    TypeError for anything else (bools, strings, complex, sequences); OverflowError for an int
    too large for a float.
    """
    if is_bool(x) or isinstance(x, (str, bytes)):
        raise TypeError(type(x).__name__)
    if isinstance(x, numbers.Real):
        return float(x)
    import numpy as np

    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iuf":
        return float(x)
    import torch

    if isinstance(x, torch.Tensor) and x.ndim == 0 and not x.dtype.is_complex:
        try:
            return float(x.item())
        except RuntimeError:  # meta tensors hold no value
            raise TypeError("a tensor without a value") from None
    raise TypeError(type(x).__name__)


def _scale_floats(name: str, scales: Any, n: int) -> list[float]:
    """``pool.set_kv_scales``'s per-layer scales as floats (range checks are the pool's).

    Raises
    ------
    ValueError
        Not a sequence, the wrong length, or an entry that is no real number or is too large for
        a float (naming the entry and its layer).
    """
    try:
        vals = list(scales)
    except TypeError:
        raise ValueError(
            f"`{name}` = {_show(scales)}: expected one scale per layer ({n})"
        ) from None
    if len(vals) != n:
        raise ValueError(f"`{name}` has {len(vals)} entries, the model has {n} layers")
    out = []
    for i, x in enumerate(vals):
        try:
            out.append(_real_float(x))
        except TypeError:
            raise ValueError(
                f"`{name}[{i}]` = {_show(x)}: scales are real numbers (layer {i})"
            ) from None
        except OverflowError:
            raise ValueError(
                f"`{name}[{i}]` = {_show(x)}: too large for a float; scales must be finite and "
                f"> 0 in fp32 (layer {i})"
            ) from None
    return out


def _scaled_layers(pool: KVPool) -> dict[int, str]:
    return {i: pool.layer(i).dtype for i in pool.layers if pool.layer(i).dtype in SCALED_DTYPES}


def apply_scales(pool: KVPool, k: Mapping[int, float], v: Mapping[int, float], source: str) -> None:
    """Set ``pool``'s scales from per-layer maps; every layer with a scale buffer must be covered.

    Raises
    ------
    ValueError
        A layer that needs a scale is missing (named), or a layer index beyond the model.
    """
    n = pool.plan.spec.num_layers
    for name, m in (("k", k), ("v", v)):
        extra = sorted(i for i in m if not 0 <= i < n)
        if extra:
            raise ValueError(
                f"{source}: {name} scales for layers {extra}, the model has {n} layers"
            )
    need = _scaled_layers(pool)
    missing = sorted(i for i in need if i not in k or i not in v)
    if missing:
        have = sorted(set(k) | set(v))
        raise ValueError(
            f"{source}: no KV scale for layer(s) {_ranges(missing)} (scales found for layers "
            f"{_ranges(have) or 'none'}); refusing to run those layers at 1.0"
        )
    pool.set_kv_scales(
        [k.get(i, 1.0) for i in range(n)], [v.get(i, 1.0) for i in range(n)], source=source
    )


# --- checkpoints -----------------------------------------------------------------------------


def _checkpoint_files(path: Path) -> list[tuple[Path, list[str] | None]]:
    """List the safetensors files to open, each with the scale names to read from it.

    Names are None where the file's keys must be scanned. With an index, only shards that hold a
    KV scale are opened.
    """
    if path.is_dir():
        idx = path / "model.safetensors.index.json"
        if idx.is_file():
            path = idx
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"`path` {path}: no model.safetensors.index.json or *.safetensors")
            return [(f, None) for f in files]
    if path.name.endswith(".json"):
        try:
            if not path.is_file():
                raise OSError("not a regular file")
            wm = json.loads(path.read_text())["weight_map"]
            items = [(str(n), str(f)) for n, f in wm.items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ValueError(f"`path` {path}: not a safetensors index ({e!r})") from None
        shards: dict[Path, list[str]] = {}
        for name, shard in items:
            if _NAME.search(name):
                shards.setdefault(path.parent / shard, []).append(name)
        return sorted(shards.items())
    if not path.is_file():
        # (a FIFO or device would block or stream forever: regular files only)
        what = "does not exist" if not path.exists() else "is not a regular file"
        raise ValueError(f"`path` {path} {what}")
    return [(path, None)]


def read_checkpoint_scales(path: str | Path) -> tuple[dict[int, float], dict[int, float]]:
    """Read per-layer (k, v) scales from a safetensors checkpoint (see the module docstring).

    Returns
    -------
    k, v : dict of int to float
        Per layer index; a layer with only one of k/v has it in both.

    Raises
    ------
    ValueError
        Unreadable files, bad values or conflicting duplicates (naming the layer and tensor).
    """
    import torch
    from safetensors import safe_open

    found: dict[tuple[int, str], tuple[float, str]] = {}
    for f, names in _checkpoint_files(Path(path)):
        try:
            sf_ctx = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"checkpoint shard {f}: {e}") from None
        with sf_ctx as sf:
            todo = names if names is not None else [n for n in sf.keys() if _NAME.search(n)]
            for name in todo:
                m = _NAME.search(name)
                if m is None:
                    continue
                layer, which = int(m.group(1)), m.group(3)[: -len("_scale")]
                t = sf.get_tensor(name).double().reshape(-1)
                if t.numel() == 0:
                    raise ValueError(f"layer {layer}: `{name}` is empty")
                # One pass over the tensor (10^6 per-head values: no per-element Python).
                bad = ~(torch.isfinite(t) & (t > 0))
                if bool(bad.any()):
                    _check_scale(layer, f"`{name}`", float(t[bad.nonzero()[0, 0]]))
                x, lo = float(t.max()), float(t.min())
                if t.numel() > 1:
                    warnings.warn(
                        f"layer {layer}: `{name}` has {t.numel()} per-head values "
                        f"(min {lo:g}, max {x:g}); kvpool pools keep one scale per tensor, "
                        f"using the max {x:g} (nothing saturates; heads with smaller scales lose "
                        f"some precision)",
                        KVScaleWarning,
                        stacklevel=2,
                    )
                prev = found.get((layer, which))
                if prev is not None and prev[0] != x:
                    raise ValueError(
                        f"layer {layer}: conflicting scales `{prev[1]}` = {prev[0]} and "
                        f"`{name}` = {x}"
                    )
                found[(layer, which)] = (x, name)
    k: dict[int, float] = {}
    v: dict[int, float] = {}
    for layer in sorted({key[0] for key in found}):
        ks, vs, kvs = (found.get((layer, w)) for w in ("k", "v", "kv"))
        kk = ks or kvs or vs
        vv = vs or kvs or ks
        if ks is None and kvs is None:
            logger.info("layer %d: checkpoint has only v_scale; using it for k", layer)
        if vs is None and kvs is None:
            logger.info("layer %d: checkpoint has only k_scale; using it for v", layer)
        k[layer], v[layer] = kk[0], vv[0]  # type: ignore[index]
    return k, v


def load_checkpoint_scales(
    pool: KVPool, path: str | Path
) -> tuple[dict[int, float], dict[int, float]]:
    """Read a checkpoint's KV scales and set them on ``pool`` (source ``checkpoint:<path>``).

    Raises
    ------
    ValueError
        No KV scales in the checkpoint, or a layer of the pool left without one (named), or a
        bad value (see :func:`read_checkpoint_scales`).
    """
    k, v = read_checkpoint_scales(path)
    if not k:
        raise ValueError(
            f"`path` {path}: the checkpoint has no KV scales (*.k_scale, *.v_scale, *.kv_scale)"
        )
    apply_scales(pool, k, v, f"checkpoint:{path}")
    return k, v


# --- JSON scale files -----------------------------------------------------------------------


class _JSONObject(dict):
    """A parsed JSON object; ``pairs`` keeps the raw (key, value) pairs when a key repeats."""

    pairs: list[tuple[str, Any]] | None = None


def _json_object(pairs: list[tuple[str, Any]]) -> _JSONObject:
    d = _JSONObject(pairs)
    if len(d) != len(pairs):
        d.pairs = pairs
    return d


def _json_int(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:  # beyond sys.get_int_max_str_digits(): far too large for any scale
        return float(text)


def _no_conflicting_keys(obj: Any, where: str, what: str) -> None:
    """Refuse a key that a JSON object repeats with different values (json keeps the last)."""
    seen: dict[str, Any] = {}
    for key, val in getattr(obj, "pairs", None) or ():
        if key in seen and seen[key] != val:
            raise ValueError(
                f"scale file {where}: {what} has key {key!r} twice, with different values "
                f"{_show(seen[key])} and {_show(val)}"
            )
        seen[key] = val


def _json_layer(key: Any, where: str) -> int:
    if isinstance(key, str) and re.fullmatch(r"[0-9]+", key):
        try:
            return int(key)
        except ValueError:  # beyond sys.get_int_max_str_digits()
            pass
    else:
        try:
            layer = as_index(key)
        except TypeError:
            pass
        else:
            if layer >= 0:
                return layer
    raise ValueError(
        f"scale file {where}: layer key {_show(key)} is not a layer index (an integer >= 0)"
    )


def _json_scale(where: str, layer: int, what: str, x: Any) -> float:
    try:
        f = float(x)
    except OverflowError:
        raise ValueError(
            f"scale file {where}: layer {layer}: {what} = {_show(x)} is too large for a float; "
            f"KV scales must be finite and > 0"
        ) from None
    return _check_scale(layer, what, f)


def read_json_scales(
    src: str | Path | Mapping[str, Any], tp_rank: int = 0
) -> tuple[str, dict[int, float], dict[int, float]]:
    """Parse a JSON scale file (a path or the parsed dict).

    Returns
    -------
    dtype : str
        The kvpool dtype the file is for (``float8_e4m3fn`` -> ``fp8_e4m3``).
    k, v : dict of int to float

    Raises
    ------
    ValueError
        Malformed file, unknown dtype, missing ``tp_rank`` (the ranks present are listed),
        bad values or layer keys, a layer given twice with different scales (``"1"`` and
        ``"01"``, or a repeated key; naming the layer), a key repeated with different values.
    """
    where = str(src) if not isinstance(src, Mapping) else "<dict>"
    # (an int, so that 0.0 or "0" never stands for rank 0 through its text)
    tp_rank = _int_arg("tp_rank", tp_rank, "the tensor-parallel rank must be an integer")
    if isinstance(src, Mapping):
        doc: Any = src
    else:
        try:
            doc = json.loads(
                Path(src).read_text(), object_pairs_hook=_json_object, parse_int=_json_int
            )
        except (OSError, ValueError, RecursionError) as e:
            # (RecursionError: JSON nested deeper than the parser's stack)
            raise ValueError(f"scale file {where}: {type(e).__name__}: {e}") from None
    try:
        kv = doc["kv_cache"]
        dtype_name = kv["dtype"]
        by_rank = kv["scaling_factor"]
    except (KeyError, TypeError):
        raise ValueError(
            f'scale file {where}: expected {{"kv_cache": {{"dtype": ..., "scaling_factor": '
            f'{{"<tp_rank>": {{"<layer>": s or [k, v]}}}}}}}}'
        ) from None
    _no_conflicting_keys(doc, where, "the top-level object")
    _no_conflicting_keys(kv, where, '"kv_cache"')
    dtype = None
    if isinstance(dtype_name, str):
        dtype = JSON_DTYPES.get(dtype_name, dtype_name if dtype_name in SCALED_DTYPES else None)
    if dtype is None:
        raise ValueError(
            f"scale file {where}: `dtype` = {_show(dtype_name)}; "
            f"expected one of {', '.join(JSON_DTYPES)}"
        )
    if not isinstance(by_rank, Mapping) or str(tp_rank) not in by_rank:
        ranks = sorted(by_rank, key=str) if isinstance(by_rank, Mapping) else []
        raise ValueError(
            f"scale file {where}: no scales for tp rank {tp_rank} (ranks in the file: {ranks})"
        )
    _no_conflicting_keys(by_rank, where, '"scaling_factor"')
    layers = by_rank[str(tp_rank)]
    if not isinstance(layers, Mapping):
        raise ValueError(
            f"scale file {where}: tp rank {tp_rank} holds {_show(layers)}, expected "
            '{"<layer>": s or [k, v]}'
        )
    pairs = getattr(layers, "pairs", None) or list(layers.items())
    k: dict[int, float] = {}
    v: dict[int, float] = {}
    first: dict[int, tuple[Any, Any]] = {}
    for key, s in pairs:
        layer = _json_layer(key, where)
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            ks = vs = _json_scale(where, layer, "scale", s)
        elif (
            isinstance(s, (list, tuple))
            and len(s) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in s)
        ):
            ks = _json_scale(where, layer, "k scale", s[0])
            vs = _json_scale(where, layer, "v scale", s[1])
        else:
            raise ValueError(
                f"scale file {where}: layer {layer}: {_show(s)} is neither a number nor [k, v]"
            )
        if layer in first and (k[layer], v[layer]) != (ks, vs):
            raise ValueError(
                f"scale file {where}: layer {layer}: conflicting scales "
                f"{_show(first[layer][0])}: {_show(first[layer][1])} and {_show(key)}: {_show(s)}"
            )
        first.setdefault(layer, (key, s))
        k[layer], v[layer] = ks, vs
    return dtype, k, v


def load_json_scales(
    pool: KVPool, src: str | Path | Mapping[str, Any], tp_rank: int = 0
) -> tuple[dict[int, float], dict[int, float]]:
    """Read a JSON scale file for ``tp_rank`` and set it on ``pool`` (source ``json:<path>``).

    Raises
    ------
    ValueError
        See :func:`read_json_scales`; also a file dtype that differs from the pool's scaled
        layers, or a layer of the pool missing from the file (named).
    """
    dtype, k, v = read_json_scales(src, tp_rank)
    layers = _scaled_layers(pool)
    wrong = sorted(i for i, d in layers.items() if d != dtype)
    if wrong:
        raise ValueError(
            f"scale file {src if not isinstance(src, Mapping) else '<dict>'} is for {dtype}, but "
            f"layer(s) {_ranges(wrong)} of the pool are {layers[wrong[0]]}"
        )
    if not layers:
        raise ValueError(f"the pool ({pool.plan.dtype}) has no per-layer KV scales to set")
    apply_scales(pool, k, v, f"json:{src if not isinstance(src, Mapping) else '<dict>'}")
    return k, v


# --- calibration ----------------------------------------------------------------------------


def _pow2_ceil(x: float) -> float:
    m, e = math.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


class Calibrator:
    """Running per-layer amax of sample K and V, turned into scales.

    Parameters
    ----------
    num_layers : int
        Layers of the model (indices ``0..num_layers-1``).
    dtype : str
        ``fp8_e4m3``, ``fp8_e5m2`` (scale = amax / 448 or 57344) or ``nvfp4`` (global scale =
        amax / (6 * 448)).

    Examples
    --------
    >>> import torch
    >>> cal = Calibrator(1, "fp8_e4m3")
    >>> cal.observe(0, torch.tensor([[[1000.0]]]), torch.tensor([[[-448.0]]]))
    >>> cal.scales()
    ([2.232142857142857], [1.0])
    """

    def __init__(self, num_layers: int, dtype: str):
        if dtype not in SCALED_DTYPES:
            raise ValueError(
                f"`dtype` = {dtype!r} has no per-layer scales to calibrate; "
                f"expected one of {', '.join(SCALED_DTYPES)}"
            )
        n = _int_arg("num_layers", num_layers, "the layer count must be an int >= 1")
        if n < 1:
            raise ValueError(f"`num_layers` = {n}: the layer count must be an int >= 1")
        self.num_layers = n
        self.dtype = dtype
        self._amax: dict[tuple[int, str], torch.Tensor] = {}

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Fold one batch of layer ``layer``'s K (and V) into the running amax (no host sync)."""
        import torch

        n = self.num_layers
        i = _int_arg("layer", layer, f"a layer index must be an int (the model has {n} layers)")
        if not 0 <= i < n:
            raise ValueError(f"`layer` = {i}, the model has {n} layers")
        new: dict[tuple[int, str], torch.Tensor] = {}  # all checked before any is folded in
        for which, x in (("k", k), ("v", v)):
            if x is None:
                continue
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"layer {i}: `{which}` is a {type(x).__name__}, not a tensor")
            a = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
            prev = self._amax.get((i, which))
            new[(i, which)] = a if prev is None else torch.maximum(prev, a)
        self._amax.update(new)

    def amax(self) -> tuple[dict[int, float], dict[int, float]]:
        """Per-layer amax of K and V seen so far (a layer seen only with K gives V the same)."""
        k = {i: float(t) for (i, w), t in self._amax.items() if w == "k"}
        v = {i: float(t) for (i, w), t in self._amax.items() if w == "v"}
        for i in list(k):
            v.setdefault(i, k[i])
        return k, v

    def scales(self, power_of_two: bool = False) -> tuple[list[float], list[float]]:
        """Turn the amaxes into per-layer (k, v) scales.

        Scale = amax / format max (nvfp4: / (6 * 448)), optionally rounded up to a power of two;
        an all-zero layer gets 1.0.

        Raises
        ------
        ValueError
            A layer never observed, or a non-finite amax (naming the layer).
        """
        ka, va = self.amax()
        missing = [i for i in range(self.num_layers) if i not in ka]
        if missing:
            raise ValueError(f"calibration saw no samples for layer(s) {_ranges(missing)}")
        out: tuple[list[float], list[float]] = ([], [])
        for amaxes, dst in ((ka, out[0]), (va, out[1])):
            for i in range(self.num_layers):
                a = amaxes[i]
                if not math.isfinite(a):
                    raise ValueError(f"layer {i}: calibration amax is {a} (non-finite samples)")
                s = a / _FMAX[self.dtype] if a > 0 else 1.0
                dst.append(_pow2_ceil(s) if power_of_two else s)
        return out

    def to_json(self, tp_rank: int = 0, power_of_two: bool = False) -> dict[str, Any]:
        """Build the JSON scale-file document for these scales (one rank)."""
        k, v = self.scales(power_of_two)
        name = {d: j for j, d in JSON_DTYPES.items()}[self.dtype]
        per_layer = {
            str(i): (k[i] if k[i] == v[i] else [k[i], v[i]]) for i in range(self.num_layers)
        }
        return {"kv_cache": {"dtype": name, "scaling_factor": {str(tp_rank): per_layer}}}

    def write_json(self, path: str | Path, tp_rank: int = 0, power_of_two: bool = False) -> None:
        """Write :meth:`to_json` to ``path``."""
        Path(path).write_text(json.dumps(self.to_json(tp_rank, power_of_two), indent=1) + "\n")

    def apply(self, pool: KVPool, power_of_two: bool = False) -> None:
        """Set these scales on ``pool`` (source ``calibration``)."""
        k, v = self.scales(power_of_two)
        apply_scales(pool, dict(enumerate(k)), dict(enumerate(v)), "calibration")


def calibrate(
    batches: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]],
    num_layers: int,
    dtype: str,
    *,
    power_of_two: bool = False,
    json_path: str | Path | None = None,
    tp_rank: int = 0,
) -> tuple[list[float], list[float]]:
    """Scales from a stream of ``(layer, k, v)`` sample batches; optionally writes the JSON file.

    Returns
    -------
    k_scales, v_scales : list of float
        One per layer (see :meth:`Calibrator.scales`).
    """
    cal = Calibrator(num_layers, dtype)
    for layer, k, v in batches:
        cal.observe(layer, k, v)
    if json_path is not None:
        cal.write_json(json_path, tp_rank, power_of_two)
    return cal.scales(power_of_two)
