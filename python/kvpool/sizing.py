"""``size_for``: how many tokens (and requests) of a model fit in a memory budget, per KV dtype.

The arithmetic is in Rust (``kvpool._core``): one layout both counts and allocates every buffer,
so ``sum(buffer.nbytes) == plan.total_bytes`` holds to the byte. GiB here are 2^30 bytes.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvpool import _core
from kvpool._args import as_index
from kvpool._core import SizingError
from kvpool.config import ModelSpec
from kvpool.gpus import gpu_memory
from kvpool.host_plan import HostPlan, host_plan, host_summary
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

    ``shape`` starts with rows of the buffer's page space (``(num_pages + 1) * page_size``; state
    slots + 1 for linear-attention state) for per-row buffers, with pages for page-major scales;
    per-layer scales have shape ``(1,)``. ``dtype`` is a torch dtype name. ``layer`` is the layer
    index (of the draft model in group ``draft``), None for workspaces. ``tensor`` is ``k``,
    ``v``, ``kv`` (MLA latent), ``conv_state`` or ``ssm_state``; ``role`` is ``data``,
    ``block_scale``, ``block_scale_page_major``, ``scale``, ``workspace`` or ``state``.
    """

    name: str
    layer: int | None
    tensor: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    group: str = "full"
    space: str = "primary"


class GroupSpec(NamedTuple):
    """One layer group of a plan.

    ``name``: ``full``, ``mla``, ``sliding_<window>``, ``linear_state``, ``shared`` or ``draft``;
    ``kind`` the same without the window. ``layers``: layer indices (of the draft model for
    ``draft``). ``page_space``: the space whose page ids (state slots) the group's buffers use,
    None for ``shared`` (which reads its source layers' pages). ``kv_heads``, ``head_dim``,
    ``v_head_dim``: per rank, as stored (MLA: the latent as ``head_dim``, ``v_head_dim`` 0; 0 for
    state and shared groups). ``bytes_per_row``: bytes per token (per state slot for
    ``linear_state``) over the group's buffers; ``bytes``: the group's bytes in this plan.
    """

    name: str
    kind: str
    layers: tuple[int, ...]
    page_space: str | None
    kv_heads: int
    head_dim: int
    v_head_dim: int
    bytes_per_row: int
    bytes: int


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
        Bytes every token slot of the first page space costs across its buffers (data, block
        scales, workspace); other spaces' in :attr:`page_spaces`.
    fixed_bytes : int
        Bytes that do not grow with the pool (per-layer fp32 scales).
    total_bytes : int
        The sum over page spaces of ``rows * bytes_per_token`` plus ``fixed_bytes`` (one space:
        ``(num_tokens + page_size) * bytes_per_token + fixed_bytes``); equals
        ``sum(b.nbytes for b in buffers)`` and ``sum(g.bytes for g in groups)``.
    k_bytes, v_bytes, scale_bytes, workspace_bytes, state_bytes : int
        K data (MLA: the latent; draft layers included), V data, every scale buffer, the FP8
        workspaces, the linear-attention state slots; they add up to ``total_bytes``.
    budget : Budget or None
        How the budget was derived (None when the plan was made for a given token count).
    num_state_slots : int
        Linear-attention state slots (ids ``1..num_state_slots``; slot 0 is padding), 0 without
        linear layers.
    context_len, chunked_prefill_size, num_draft_tokens : int
        What the split between page spaces was made for (``chunked_prefill_size`` None:
        unchunked prefill).
    draft : ModelSpec or None
        The draft model (the target's own spec for MTP), None without one.

    ``num_pages``/``num_tokens``/``bytes_per_token`` are those of the first page space
    (``primary``: full, MLA and draft layers; a model without full layers has its smallest
    sliding window's space first). See :attr:`groups` and :attr:`page_spaces` for the others.
    """

    __slots__ = ("_core", "budget", "draft", "host", "spec", "tp_size")

    def __init__(
        self,
        core: Any,
        spec: ModelSpec,
        tp_size: int,
        budget: Budget | None,
        draft: ModelSpec | None = None,
    ):
        self._core = core
        self.spec = spec
        self.tp_size = tp_size
        self.budget = budget
        self.draft = draft
        self.host: HostPlan | None = None  # the host tier's pool (size_for's host_memory)

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
            BufferSpec(n, layer, t, r, d, tuple(s), b, g, sp)
            for n, layer, t, r, d, s, b, g, sp in self._core.buffers
        ]

    @property
    def groups(self) -> list[GroupSpec]:
        """Every layer group, in layout order (``full``/``mla``, ``sliding_<w>``, ...)."""
        return [
            GroupSpec(n, k, tuple(layers), sp, h, d, dv, row, b)
            for n, k, layers, sp, h, d, dv, row, b in self._core.groups
        ]

    @property
    def page_spaces(self) -> dict[str, dict[str, Any]]:
        """Page spaces by name (``primary``, ``sliding_<w>``, ``linear_state``).

        Each: ``kind`` (primary/sliding/state), ``page_size`` (tokens per page; 1 for state
        slots), ``num_pages`` (usable pages or slots, ids ``1..num_pages``), ``rows``
        (``(num_pages + 1) * page_size``), ``bytes_per_token`` (per row over its buffers; per
        slot for state), ``bytes``, ``headroom_pages`` (pages kept free for one prefill chunk;
        sliding spaces), ``capped_by_int32`` (the int32 limit on slot ids, not the budget, set
        ``num_pages``) and ``requests`` (requests of ``context_len`` tokens it holds).
        """
        keys = ("kind", "page_size", "num_pages", "rows", "bytes_per_token", "bytes",
                "headroom_pages", "capped_by_int32", "requests")  # fmt: skip
        return {row[0]: dict(zip(keys, row[1:], strict=True)) for row in self._core.page_spaces}

    def allocators(self) -> dict[str, Any]:
        """A fresh allocator per page space, keyed by space name.

        Token spaces get ``PageAllocator(num_pages, page_size)``; the linear-attention state
        pool a :class:`kvpool.StateSlotAllocator` of ``num_state_slots`` under ``linear_state``
        (one slot per running request, slot 0 reserved as padding like page 0). Sliding spaces
        include their ``headroom_pages``: a caller keeps that many free for the prefill chunk in
        flight. These are the allocators ``RadixCache(full, sliding=..., state_slots=...)`` and
        :func:`kvpool.release_window_pages` take.
        """
        return {
            name: _core.StateSlotAllocator(s["num_pages"])
            if s["kind"] == "state"
            else _core.PageAllocator(s["num_pages"], s["page_size"])
            for name, s in self.page_spaces.items()
        }

    @property
    def host_bytes(self) -> int:
        """Bytes of the host tier's pinned pool (0 without one; see :mod:`kvpool.host_plan`)."""
        return 0 if self.host is None else self.host.host_bytes

    @property
    def host_pages(self) -> int:
        """Usable pages of the host tier's pool (ids ``1..host_pages``; 0 without one)."""
        return 0 if self.host is None else self.host.num_pages

    @property
    def budget_bytes(self) -> int:
        """Bytes the pool was sized to fit in."""
        return self._core.budget_bytes

    def request_bytes(self, n: int) -> int:
        """Bytes one request of ``n`` tokens holds across page spaces and its state slot.

        Full, MLA and draft layers hold ``ceil(n / ps)`` pages; a sliding group of window ``w``
        holds ``min(ceil(n / ps), ceil(min(n, w) / ps) + r + ceil(num_draft_tokens / ps))``
        pages (``r`` = 1 when ``ps > 1``: a window rarely starts on a page boundary; the draft
        pages are kept for speculative rollback); linear-attention layers one state slot
        (:meth:`linear_state_bytes`). Workspaces are not per request.
        """
        return self._core.request_bytes(_int("n", n))

    def requests_fit(self, context_len: int) -> int:
        """Requests of ``context_len`` tokens the pool holds at once.

        The least over page spaces of ``(num_pages - headroom_pages) // pages per request`` and
        the state slots, so ``requests_fit(n) * request_bytes(n) <= budget_bytes``. This is the
        ``requests`` column of ``kvpool size`` (at ``--context-len``).
        """
        return self._core.requests_fit(_int("context_len", context_len, minimum=1))

    def linear_state_bytes(self) -> int:
        """Per-request bytes of linear-attention state on one rank (one state slot, allocated)."""
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
        for k in ("num_state_slots", "state_bytes", "context_len", "chunked_prefill_size",
                  "num_draft_tokens"):  # fmt: skip
            d[k] = getattr(self, k)
        d["draft"] = None if self.draft is None else self.draft.name
        d["requests_fit"] = self.requests_fit(self.context_len)
        d["capped_by_int32"] = any(s["capped_by_int32"] for s in self.page_spaces.values())
        d["groups"] = [g._asdict() | {"layers": list(g.layers)} for g in self.groups]
        d["page_spaces"] = self.page_spaces
        if self.budget is not None:
            d["budget"] = self.budget.__dict__
        d["buffers"] = [b._asdict() for b in self.buffers]
        d["host"] = None if self.host is None else host_summary(self.host)
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
    tp_size: int | None = None,
    nvfp4_recipe: str = "linear",
    layer_dtypes: Mapping[int, str] | None = None,
    sliding_dtype: str | None = None,
    model_dtype: str | None = None,
    num_tokens: int | None = None,
    context_len: int = 8192,
    chunked_prefill_size: int | None = 8192,
    draft: ModelSpec | dict | str | os.PathLike[str] | None = None,
    num_draft_tokens: int = 0,
    group: Any = None,
    host_memory: int | None = None,
    host_pages: int | None = None,
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
    tp_size : int, optional
        Tensor-parallel ranks (default 1; with ``group``, the group's size); the plan is per
        rank (KV heads per rank = ``max(1, num_kv_heads // tp_size)``, valid when one divides
        the other).
    nvfp4_recipe : str
        ``linear`` (default), ``page_major``, ``mixed`` or ``linear_workspace``
        (docs/architecture.md, "Buffers of a pool").
    layer_dtypes : mapping of int to str, optional
        Per-layer dtype overrides.
    sliding_dtype : str, optional
        Dtype of every sliding-window layer.
    model_dtype : str, optional
        The loaded model's compute dtype (what ``auto`` resolves to), e.g. ``fp32``.
    num_tokens : int, optional
        Skip the budget and make a plan for exactly this many tokens in the first page space
        (rounded up to pages); the other spaces hold as many ``context_len`` requests (>= 1).
    context_len : int
        Tokens per request at which every page space and the state pool hold the same number
        of requests: how a model with sliding or linear-attention layers splits the budget
        (the first space also gets what is left). Default 8192 (``--context-len``).
    chunked_prefill_size : int or None
        Tokens of one prefill chunk (SGLang's ``--chunked-prefill-size``, default 8192); each
        sliding space keeps that many tokens' pages free (at most what a request of
        ``context_len`` holds beyond its window), since a chunk writes all its tokens before the
        window drops them. None: unchunked prefill (a whole request).
    draft : "mtp", ModelSpec, dict, str or path, optional
        A draft model planned in the same budget, its layers in the primary page space (same
        page ids as the target: the draft runs over the same tokens). ``"mtp"``: the config's
        ``num_nextn_predict_layers`` multi-token-prediction layers (DeepSeek-V3: one MLA layer
        of the target's geometry; Qwen3-Next/3.5 ``mtp_num_hidden_layers``: full attention).
        Anything else: an EAGLE-style draft model, sized with its own geometry in the target's
        KV dtype.
    num_draft_tokens : int
        Draft tokens per speculative step (SGLang's ``--speculative-num-draft-tokens``):
        sliding spaces keep ``ceil(num_draft_tokens / page_size)`` pages more per request for
        rollback.
    group : torch.distributed.ProcessGroup, optional
        Size one plan for every rank of a TP group
        (:func:`kvpool.distributed.agree_plan`): the least memory of any rank sizes it, every
        rank checks it made the same plan, and a mismatch or a rank that cannot fit raises on
        every rank. Every rank of the group must call it.
    host_memory : int, optional
        Bytes of pinned host memory for the host tier (``plan.host``, ``plan.host_bytes``,
        ``plan.host_pages``): as many host pages as fit, each holding a device page's bytes
        (:mod:`kvpool.host_plan`). Not part of the device budget.
    host_pages : int, optional
        A host pool of exactly this many pages instead (not with ``host_memory``).

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
        The budget cannot hold one page, or (several page spaces) one request of
        ``context_len`` tokens in every space (the message says how many bytes are missing).
    """
    if group is not None:  # one plan agreed by every rank of a torch.distributed group
        from kvpool.distributed import agree_plan

        kw = dict(total_memory=total_memory, available_memory=available_memory, gpu=gpu,
                  weights=weights, page_size=page_size, tp_size=tp_size,
                  nvfp4_recipe=nvfp4_recipe, layer_dtypes=layer_dtypes,
                  sliding_dtype=sliding_dtype, model_dtype=model_dtype, num_tokens=num_tokens,
                  context_len=context_len, chunked_prefill_size=chunked_prefill_size,
                  draft=draft, num_draft_tokens=num_draft_tokens,
                  host_memory=host_memory, host_pages=host_pages)  # fmt: skip
        return agree_plan(model, dtype, mem_frac, group=group, **kw).plan
    tp_size = 1 if tp_size is None else tp_size
    spec = _spec(model, model_dtype)
    dtype = _str("dtype", dtype, _core.KvDtypeError)
    nvfp4_recipe = _str("nvfp4_recipe", nvfp4_recipe, _core.LayoutError)
    if sliding_dtype is not None:
        sliding_dtype = _str("sliding_dtype", sliding_dtype, _core.KvDtypeError)
    page_size = _int("page_size", page_size, minimum=1, exc=_core.LayoutError)
    tp_size = _int("tp_size", tp_size, minimum=1, exc=_core.ModelConfigError)
    draft_spec = _draft_spec(spec, draft)
    geometry = _geometry(spec, tp_size, draft_spec)
    kw: dict[str, Any] = dict(
        context_len=_int("context_len", context_len, minimum=1),
        chunked_prefill_size=None
        if chunked_prefill_size is None
        else _int("chunked_prefill_size", chunked_prefill_size, minimum=1),
        num_draft_tokens=_int("num_draft_tokens", num_draft_tokens),
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
        core = _core.plan(geometry, dtype, num_tokens=n, **kw)
        plan = Plan(core, spec, tp_size, None, draft_spec)
    else:
        budget = _budget(spec, mem_frac, total_memory, available_memory, gpu, weights, tp_size)
        core = _core.plan(geometry, dtype, budget=budget.budget, **kw)
        plan = Plan(core, spec, tp_size, budget, draft_spec)

    def make(n: int) -> Plan:  # the one layout at another page count
        return Plan(_core.plan(geometry, dtype, num_tokens=n, **kw), spec, tp_size, None)

    plan.host = host_plan(plan, make, host_memory, host_pages)
    return plan


def _mtp_spec(spec: ModelSpec) -> ModelSpec:
    """The target's MTP layers as a draft spec: its geometry, ``n`` full (or MLA) layers."""
    f = spec.fields
    n = spec.num_nextn_predict_layers
    if n == 0:
        raise _core.ModelConfigError(
            f"draft='mtp' but `{spec.name}` declares no MTP layers: `num_nextn_predict_layers` "
            f"is {f.get('num_nextn_predict_layers', 'missing')!r} (Qwen3-Next/3.5: "
            "`mtp_num_hidden_layers`)"
        )
    return dataclasses.replace(
        spec, name=f"{spec.name} (MTP)", layer_kinds=("full",) * n, sliding_window=None,
        linear_attention={}, kv_shared_sources={}, sliding_head_dim=None,
        sliding_v_head_dim=None, num_nextn_predict_layers=0,
    )  # fmt: skip


def _draft_spec(spec: ModelSpec, draft: Any) -> ModelSpec | None:
    if draft is None:
        return None
    if isinstance(draft, str) and draft.lower() in ("mtp", "nextn"):
        return _mtp_spec(spec)
    return _spec(draft, spec.dtype)


def _geometry(spec: ModelSpec, tp_size: int, draft: ModelSpec | None = None) -> Any:
    """The Rust-side geometry of ``spec`` on one of ``tp_size`` ranks (state shapes sharded).

    Linear-attention state per layer and rank (SGLang's Mamba pool shapes): conv
    ``[conv_dim, conv_kernel - 1]`` in the model dtype with ``conv_dim = (2 * key_heads *
    key_head_dim + value_heads * value_head_dim) / tp``, SSM ``[value_heads / tp,
    key_head_dim, value_head_dim]`` in ``mamba_ssm_dtype``; bytes as
    :meth:`ModelSpec.linear_state_bytes`.
    """
    state = None
    la = spec.linear_attention
    if la and "linear" in spec.layer_kinds:
        spec.linear_state_bytes(tp_size)  # (raises when tp_size does not split the heads)
        kh, vh = la["num_key_heads"], la["num_value_heads"]
        kd, vd = la["key_head_dim"], la["value_head_dim"]
        ssm_dtype = la.get("ssm_dtype") or _SSM_DTYPES.get(
            str(spec.fields.get("mamba_ssm_dtype", "float32")).lower(), "fp32"
        )
        state = ((2 * kh * kd + vh * vd) // tp_size, la["conv_kernel"] - 1, spec.dtype,
                 vh // tp_size, kd, vd, ssm_dtype)  # fmt: skip
    shared = dict(getattr(spec, "kv_shared_sources", None) or {})
    kw: dict[str, Any] = {}
    if draft is not None:
        if "linear" in draft.layer_kinds or "shared" in draft.layer_kinds:
            bad = next(k for k in draft.layer_kinds if k in ("linear", "shared"))
            raise _core.ModelConfigError(
                f"draft model `{draft.name}` has `{bad}` layers; a draft's layers are full or "
                "sliding attention"
            )
        kw["draft"] = _geometry(draft, tp_size)
    return _core.ModelGeometry(
        layer_kinds=list(spec.layer_kinds),
        num_attention_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim,
        sliding_window=spec.sliding_window,
        kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        sliding_head_dim=getattr(spec, "sliding_head_dim", None),
        sliding_v_head_dim=getattr(spec, "sliding_v_head_dim", None),
        kv_shared_sources=shared or None,
        linear_state=state,
        **kw,
    )


_SSM_DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16",
               "float16": "fp16", "fp16": "fp16"}  # fmt: skip


def compare(
    model: ModelSpec | str | os.PathLike[str], dtypes: Iterable[str] = KV_DTYPES, **kwargs: Any
) -> list[Plan]:
    """``size_for`` for each dtype under the same budget (same keyword arguments)."""
    spec = _spec(model, kwargs.pop("model_dtype", None))
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    return [size_for(spec, d, **kwargs) for d in dtypes]
