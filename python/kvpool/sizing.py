"""``size_for``: how many tokens (and requests) of a model fit in a memory budget, per KV dtype.

The arithmetic is in Rust (``kvpool._core``): one layout both counts and allocates every buffer,
so ``sum(buffer.nbytes) == plan.total_bytes`` holds to the byte. GiB here are 2^30 bytes.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvpool import _core
from kvpool._args import as_index
from kvpool._core import SizingError
from kvpool.config import ModelSpec
from kvpool.gpus import gpu_memory
from kvpool.weights import weight_bytes

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

#: The concrete KV dtypes, in report order (``auto`` resolves to the model's dtype).
KV_DTYPES: tuple[str, ...] = tuple(_core.KV_DTYPES)
GIB = 1 << 30


def _int(name: str, v: Any, *, minimum: int = 0, exc: type[Exception] = SizingError) -> int:
    """``v`` as a plain int >= ``minimum``.

    Ints and numpy integers (anything with ``__index__``) pass; bools (Python's, numpy's and
    torch's), floats and strings are refused.
    """
    try:
        v = as_index(v)
    except TypeError:
        raise exc(f"`{name}` must be an integer, got {v!r}") from None
    if v < minimum:
        raise exc(f"`{name}` must be >= {minimum}, got {v}")
    if v >= 1 << 64:
        raise exc(f"`{name}` = {v} does not fit in 64 bits")
    return v


class BufferSpec(NamedTuple):
    """One buffer of the pool.

    ``shape`` starts with rows (``num_tokens + page_size``) for per-token buffers, with pages for
    page-major scales; per-layer scales have shape ``(1,)``. ``dtype`` is a torch dtype name.
    """

    name: str
    layer: int | None
    tensor: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Budget:
    """Where the KV budget came from (bytes): SGLang's ``available - total * (1 - mem_frac)``."""

    total_memory: int
    available_memory: int
    mem_frac: float
    weights: int
    weights_source: str
    budget: int


class Plan:
    """A sized KV pool: every buffer, its bytes, and its capacity.

    Attributes (all bytes unless stated)
    ------------------------------------
    spec : ModelSpec
    dtype : str
        The resolved KV dtype (``auto`` replaced by the model's dtype).
    num_tokens : int
        Usable token slots (a multiple of ``page_size``; the padding page not included).
    num_pages, page_size : int
        Usable pages (ids ``1..num_pages``; page 0 is the padding page) and tokens per page.
    bytes_per_token : int
        Bytes every token slot costs across all buffers (data, block scales, workspace).
    fixed_bytes : int
        Bytes that do not grow with the pool (per-layer fp32 scales).
    total_bytes : int
        ``(num_tokens + page_size) * bytes_per_token + fixed_bytes``; equals
        ``sum(b.nbytes for b in buffers)``.
    k_bytes, v_bytes, scale_bytes, workspace_bytes : int
        K data (MLA: the latent), V data, every scale buffer, the shared FP8 workspace; they add
        up to ``total_bytes``.
    budget : Budget or None
        How the budget was derived (None when the plan was made for a given token count).
    """

    __slots__ = ("_core", "budget", "spec", "tp_size")

    def __init__(self, core: Any, spec: ModelSpec, tp_size: int, budget: Budget | None):
        self._core = core
        self.spec = spec
        self.tp_size = tp_size
        self.budget = budget

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._core, name)

    def __repr__(self) -> str:
        return (
            f"Plan({self.spec.name!r}, dtype={self.dtype!r}, num_tokens={self.num_tokens}, "
            f"page_size={self.page_size}, total_bytes={self.total_bytes})"
        )

    @property
    def buffers(self) -> list[BufferSpec]:
        """Every buffer the pool allocates, in allocation order."""
        return [
            BufferSpec(n, layer, t, r, d, tuple(s), b)
            for n, layer, t, r, d, s, b in self._core.buffers
        ]

    @property
    def budget_bytes(self) -> int:
        """Bytes the pool was sized to fit in."""
        return self._core.budget_bytes

    def request_bytes(self, n: int) -> int:
        """Bytes one request of ``n`` tokens holds across layers.

        Full layers hold ``ceil(n / page_size)`` pages; sliding-window layers are counted as a
        windowed pool holds them: ``min(n, window)`` tokens rounded up to whole pages, plus one
        page when ``page_size > 1``. Linear-attention state is not included (see
        :meth:`linear_state_bytes`). What a windowed pool would hold, not what this pool stores
        per request; :meth:`requests_fit` (the CLI's ``requests``) counts the latter.
        """
        return self._core.request_bytes(_int("n", n))

    def requests_fit(self, context_len: int) -> int:
        """Requests of ``context_len`` tokens this pool holds at once (whole pages each).

        Every layer counts at the full context, as this pool stores sliding-window layers too;
        this is the ``requests`` column of ``kvpool size`` (and ``requests_fit`` of its
        ``--json``). For sliding-window models it is below
        ``budget_bytes // request_bytes(context_len)``, which counts windowed layers.
        """
        pages = -(-_int("context_len", context_len, minimum=1) // self.page_size)
        return self.num_pages // pages

    def linear_state_bytes(self) -> int:
        """Per-request bytes of linear-attention state on one rank (reported, not allocated)."""
        conv, ssm = self._core.linear_state_bytes()
        return conv + ssm

    def sglang_line(self) -> str:
        """SGLang's allocation log line.

        GB there means GiB; #tokens excludes the padding page, K/V sizes include it and each
        tensor's block scales. MLA models have one latent buffer per layer, logged as ``KV size``
        (as SGLang's MLA pool does) instead of ``K size`` / ``V size: 0.00 GB``.
        """
        k = sum(b.nbytes for b in self.buffers if b.tensor in ("k", "kv") and b.role != "workspace")
        v = sum(b.nbytes for b in self.buffers if b.tensor == "v" and b.role != "workspace")
        head = f"KV Cache is allocated. dtype: {self.dtype}, #tokens: {self.num_tokens}, "
        if self.spec.is_mla:
            return head + f"KV size: {k / GIB:.2f} GB"
        return head + f"K size: {k / GIB:.2f} GB, V size: {v / GIB:.2f} GB"

    def to_dict(self) -> dict[str, Any]:
        """Every figure of the plan, in bytes and tokens (JSON-ready)."""
        d = {
            k: getattr(self, k)
            for k in (
                "dtype", "num_tokens", "num_pages", "page_size", "kv_heads_per_rank",
                "bytes_per_token", "fixed_bytes", "total_bytes", "k_bytes", "v_bytes",
                "scale_bytes", "workspace_bytes", "budget_bytes", "nvfp4_recipe",
            )
        }  # fmt: skip
        d["model"] = self.spec.name
        d["tp_size"] = self.tp_size
        d["linear_state_bytes_per_request"] = self.linear_state_bytes()
        if self.budget is not None:
            d["budget"] = self.budget.__dict__
        d["buffers"] = [b._asdict() for b in self.buffers]
        return d


def _str(name: str, v: Any, exc: type[Exception]) -> str:
    """``v`` if it is a string (a dtype or recipe name), else ``exc`` naming ``name``."""
    if not isinstance(v, str):
        raise exc(f"`{name}` must be a string, got {v!r}")
    return v


def _spec(model: ModelSpec | dict | str | os.PathLike[str], model_dtype: str | None) -> ModelSpec:
    if model_dtype is not None:
        _str("model_dtype", model_dtype, _core.ModelConfigError)
    if not isinstance(model, (dict, str, os.PathLike, ModelSpec)):
        raise _core.ModelConfigError(
            f"`model` must be a ModelSpec, a config dict, a path or a hub id, got {model!r}"
        )
    if isinstance(model, dict):
        return ModelSpec.from_dict(model, dtype=model_dtype)
    if isinstance(model, str) and not model.strip():
        from kvpool._core import ModelConfigError

        raise ModelConfigError("`model` is an empty string")
    if isinstance(model, ModelSpec):
        return model if model_dtype is None else model.with_dtype(model_dtype)
    return ModelSpec.from_pretrained(model, dtype=model_dtype)


def _budget(
    spec: ModelSpec,
    mem_frac: float,
    total_memory: int | None,
    available_memory: int | None,
    gpu: str | None,
    weights: int | str | None,
    tp_size: int,
) -> Budget:
    # (numpy floats are Reals: np.float32(0.5) is a fraction like any other)
    if isinstance(mem_frac, bool) or not isinstance(mem_frac, numbers.Real):
        raise SizingError(f"`mem_frac` must be a real number in (0, 1], got {mem_frac!r}")
    if not 0 < mem_frac <= 1:
        raise SizingError(f"`mem_frac` must be in (0, 1], got {mem_frac!r}")
    if gpu is not None and total_memory is not None:
        raise SizingError("give either `gpu` or `total_memory`, not both")
    if available_memory is not None and weights is not None:
        raise SizingError(
            "give either `available_memory` (free after loading weights) or `weights`, not both"
        )
    if total_memory is None and gpu is not None:
        total_memory = gpu_memory(gpu)
    if total_memory is None:
        if available_memory is not None:
            raise SizingError("`available_memory` needs `total_memory` (or `gpu`) beside it")
        total_memory = _measure_free_memory()
    total_memory = _int("total_memory", total_memory, minimum=1)
    src = "given"
    if available_memory is None:
        if weights is None or weights == "auto":
            w, src = weight_bytes(spec)
        else:
            w = _int("weights", weights)
        w = -(-w // tp_size)  # weights are split over the TP ranks
        available_memory = total_memory - w
        if available_memory <= 0:
            raise SizingError(
                f"weights of {w} bytes ({w / GIB:.2f} GiB per rank, {src}) do not fit in "
                f"{total_memory} bytes of device memory; raise `tp_size` or use a larger GPU"
            )
    else:
        available_memory = _int("available_memory", available_memory)
        w = max(total_memory - available_memory, 0)
    b = _core.kv_budget_bytes(total_memory, available_memory, float(mem_frac))
    return Budget(total_memory, available_memory, float(mem_frac), w, src, b)


def _measure_free_memory() -> int:
    """Free memory of the current CUDA device (call before loading weights)."""
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is None or not torch.cuda.is_available():
        raise SizingError(
            "no memory figures given and no CUDA device to measure: pass `gpu=` (e.g. 'H100'), "
            "or `total_memory=` (and `available_memory=` or `weights=`) in bytes"
        )
    return int(torch.cuda.mem_get_info()[0])


def size_for(
    model: ModelSpec | dict | str | os.PathLike[str],
    dtype: str = "auto",
    mem_frac: float = 0.9,
    *,
    total_memory: int | None = None,
    available_memory: int | None = None,
    gpu: str | None = None,
    weights: int | str | None = None,
    page_size: int = 1,
    tp_size: int = 1,
    nvfp4_recipe: str = "linear",
    layer_dtypes: Mapping[int, str] | None = None,
    sliding_dtype: str | None = None,
    model_dtype: str | None = None,
    num_tokens: int | None = None,
) -> Plan:
    """Size a KV pool: the largest page-aligned token count whose every byte fits the budget.

    Budget (bytes), as SGLang computes it: ``available_memory - total_memory * (1 - mem_frac)``,
    where ``total_memory`` is the device memory free before the weights were loaded and
    ``available_memory`` what is free after. Give both; or ``gpu``/``total_memory`` plus
    ``weights`` (``available = total - weights / tp_size``); or nothing, with a CUDA device
    present (its free memory, measured with ``torch.cuda.mem_get_info`` before the weights are
    loaded, is ``total_memory``; weights as below).

    Parameters
    ----------
    model : ModelSpec, dict, str or path
        A spec, a parsed config.json dict, a config.json / model directory / GGUF path, or a
        bundled hub id (see :func:`kvpool.config.bundled_models`).
    dtype : str
        KV dtype: ``auto`` (the model's dtype), ``fp32``, ``bf16``, ``fp16``, ``fp8``/``fp8_e4m3``,
        ``fp8_e5m2``, ``nvfp4``, ``fp4_mx_block16``.
    mem_frac : float
        SGLang's ``--mem-fraction-static``, in (0, 1].
    total_memory, available_memory : int, optional
        Bytes (see above).
    gpu : str, optional
        A GPU from :data:`kvpool.gpus.GPUS` (its total memory is used as ``total_memory``).
    weights : int or "auto", optional
        Weight bytes of the whole model (split over ``tp_size`` ranks); ``auto`` or None (the
        default, unless ``available_memory`` is given) reads the checkpoint index of a model
        directory, else estimates from the config (see :mod:`kvpool.weights`).
    page_size : int
        Tokens per page (>= 1).
    tp_size : int
        Tensor-parallel ranks; the plan is per rank (KV heads per rank =
        ``max(1, num_kv_heads // tp_size)``, valid when one divides the other).
    nvfp4_recipe : str
        ``linear`` (default), ``page_major``, ``mixed`` or ``linear_workspace`` (DESIGN.md).
    layer_dtypes : mapping of int to str, optional
        Per-layer dtype overrides.
    sliding_dtype : str, optional
        Dtype of every sliding-window layer.
    model_dtype : str, optional
        The loaded model's compute dtype (what ``auto`` resolves to), e.g. ``fp32``.
    num_tokens : int, optional
        Skip the budget and make a plan for exactly this many tokens (rounded up to pages).

    Returns
    -------
    Plan

    Raises
    ------
    KvDtypeError
        Unknown dtype.
    ModelConfigError
        Unknown model, malformed config, tp_size that does not fit the KV heads.
    LayoutError
        page_size 0, FP4 with head dims not a multiple of 16, bad recipe.
    SizingError
        mem_frac outside (0, 1], unknown GPU, no memory figures.
    BudgetTooSmallError
        The budget cannot hold one page (the message says how many bytes are missing).
    """
    spec = _spec(model, model_dtype)
    dtype = _str("dtype", dtype, _core.KvDtypeError)
    nvfp4_recipe = _str("nvfp4_recipe", nvfp4_recipe, _core.LayoutError)
    if sliding_dtype is not None:
        sliding_dtype = _str("sliding_dtype", sliding_dtype, _core.KvDtypeError)
    page_size = _int("page_size", page_size, minimum=1, exc=_core.LayoutError)
    tp_size = _int("tp_size", tp_size, minimum=1, exc=_core.ModelConfigError)
    geometry = spec.geometry(tp_size)
    kw: dict[str, Any] = dict(
        model_dtype=spec.dtype,
        page_size=page_size,
        tp_size=tp_size,
        nvfp4_recipe=nvfp4_recipe,
        overrides=[
            (
                _int("layer_dtypes key", k, exc=_core.LayoutError),
                _str(f"layer_dtypes[{k!r}]", v, _core.KvDtypeError),
            )
            for k, v in (layer_dtypes or {}).items()
        ],
        sliding_dtype=sliding_dtype,
    )
    if num_tokens is not None:
        n = _int("num_tokens", num_tokens)
        return Plan(_core.plan(geometry, dtype, num_tokens=n, **kw), spec, tp_size, None)
    budget = _budget(spec, mem_frac, total_memory, available_memory, gpu, weights, tp_size)
    core = _core.plan(geometry, dtype, budget=budget.budget, **kw)
    return Plan(core, spec, tp_size, budget)


def compare(
    model: ModelSpec | str | os.PathLike[str], dtypes: Iterable[str] = KV_DTYPES, **kwargs: Any
) -> list[Plan]:
    """``size_for`` for each dtype under the same budget (same keyword arguments)."""
    spec = _spec(model, kwargs.pop("model_dtype", None))
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    return [size_for(spec, d, **kwargs) for d in dtypes]
