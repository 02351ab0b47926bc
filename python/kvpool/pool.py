"""``KVPool``: the torch buffers a :class:`~kvpool.Plan` describes, and the kernels' layer view.

The pool allocates exactly ``plan.buffers`` (so ``sum(t.nbytes) == plan.total_bytes``) and adds
nothing of its own. Rows are token slots: ``slot = page * page_size + offset``, page 0 is the
reserved padding page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool._args import as_index
from kvpool._launch import Generation
from kvpool._torch import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvpool.sizing import Plan


@dataclass
class LayerView(Generation):
    """One layer's buffers, as the write and attention kernels take them.

    Every attribute set gives the view a new generation (:class:`kvpool._launch.Generation`):
    the launches recorded on it apply while it keeps the one they were made at.

    Shapes (``R`` = rows of the layer's page space, ``(num_pages + 1) * page_size``; ``H`` = KV
    heads per rank, ``D``/``Dv`` = K/V head dims as stored; MLA: ``v`` is None and ``k`` is the
    latent of ``kv_lora_rank + qk_rope_head_dim`` values, ``H`` = 1):

    - ``k``: ``[R, H, D]`` in the cache dtype (fp32/bf16/fp16/float8_e4m3fn/float8_e5m2), or
      ``[R, H, D/2]`` uint8 for FP4 (element 2i in the low nibble).
    - ``v``: ``[R, H, Dv]`` likewise (``[R, H, Dv/2]`` for FP4).
    - ``k_block_scale``/``v_block_scale``: nvfp4 ``[R, H, D/16]`` float8_e4m3fn;
      fp4_mx_block16 ``[R, H*D/16]`` uint8 (ue8m0, bias 127); else None.
    - ``k_block_scale_page_major``/``v_block_scale_page_major``: nvfp4 recipes with page-major
      scales, ``[R/page_size, H, page_size, D/16]`` float8_e4m3fn (V with the 4-token
      interleave); else None.
    - ``k_scale``/``v_scale``: ``[1]`` float32: the per-tensor scale of fp8 caches, the global
      scale of nvfp4 caches (x = e2m1 * block_scale * global_scale); else None.
    - ``workspace_k``/``workspace_v``: the shared one-layer FP8 workspace ``[R, H, D]`` (mixed and
      linear_workspace recipes); else None.
    """

    layer: int
    dtype: str
    page_size: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    k: torch.Tensor
    v: torch.Tensor | None
    k_block_scale: torch.Tensor | None = None
    v_block_scale: torch.Tensor | None = None
    k_block_scale_page_major: torch.Tensor | None = None
    v_block_scale_page_major: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    workspace_k: torch.Tensor | None = None
    workspace_v: torch.Tensor | None = None

    @property
    def is_mla(self) -> bool:
        """Whether the layer stores one MLA latent instead of K and V."""
        return self.v is None


_FIELD = {
    ("data", "k"): "k",
    ("data", "kv"): "k",
    ("data", "v"): "v",
    ("block_scale", "k"): "k_block_scale",
    ("block_scale", "kv"): "k_block_scale",
    ("block_scale", "v"): "v_block_scale",
    ("block_scale_page_major", "k"): "k_block_scale_page_major",
    ("block_scale_page_major", "kv"): "k_block_scale_page_major",
    ("block_scale_page_major", "v"): "v_block_scale_page_major",
    ("scale", "k"): "k_scale",
    ("scale", "kv"): "k_scale",
    ("scale", "v"): "v_scale",
    ("workspace", "k"): "workspace_k",
    ("workspace", "kv"): "workspace_k",
    ("workspace", "v"): "workspace_v",
}


def _scales_f32(name: str, scales: Sequence[float], n: int) -> list[float]:
    """Scales as the fp32 values the buffers will hold, checked before anything is written."""
    vals = list(scales)
    if len(vals) != n:
        raise ValueError(f"`{name}` has {len(vals)} entries, the model has {n} layers")
    out = []
    for i, x in enumerate(vals):
        if isinstance(x, (bool, str)) or not isinstance(x, (int, float)):
            raise ValueError(f"`{name}[{i}]` = {x!r}: scales are numbers (layer {i})")
        f32 = float(torch.tensor(float(x), dtype=torch.float32))
        if not (0 < f32 < float("inf")):
            raise ValueError(
                f"`{name}[{i}]` = {x}: scales must be finite and > 0 in fp32 (layer {i})"
            )
        out.append(f32)
    return out


class KVPool:
    """The KV cache buffers of one rank, allocated exactly as ``plan.buffers`` lists them.

    Parameters
    ----------
    plan : Plan
        From :func:`kvpool.size_for`.
    device : str or torch.device
        Where to allocate (``"cuda"``, ``"cpu"``, ``"meta"`` for a dry run).

    Attributes
    ----------
    buffers : dict of str to torch.Tensor
        Stable names (``layers.3.k``, ``layers.3.k_block_scale``, ``layers.3.k_scale``,
        ``workspace.k``, ``draft.layers.0.k``, ``layers.0.conv_state``, ``layers.0.ssm_state``)
        to tensors. Data and state buffers start uninitialized (slots are only read up to each
        request's length; a request's state slot is written before it is read); per-layer
        scales start at 1.0.
    """

    def __init__(self, plan: Plan, device: str | torch.device = "cuda"):
        self.plan = plan
        self.device = torch.device(device)
        self.page_size = plan.page_size
        self.num_pages = plan.num_pages
        self.buffers: dict[str, torch.Tensor] = {}
        for b in plan.buffers:
            dt = getattr(torch, b.dtype)
            if b.role == "scale":
                t = torch.ones(b.shape, dtype=dt, device=self.device)
            else:
                t = torch.empty(b.shape, dtype=dt, device=self.device)
            self.buffers[b.name] = t
        geo = {g.name: g for g in plan.groups}
        self._views: dict[int, LayerView] = {}
        self._draft_views: dict[int, LayerView] = {}
        fields: dict[tuple[str, int], dict[str, Any]] = {}
        workspaces: dict[str, dict[str, Any]] = {}
        self._states: dict[int, dict[str, torch.Tensor]] = {}
        for b in plan.buffers:
            t = self.buffers[b.name]
            if b.role == "workspace":
                workspaces.setdefault(b.group, {})[_FIELD[(b.role, b.tensor)]] = t
            elif b.role == "state":
                self._states.setdefault(b.layer, {})[b.tensor] = t
            else:
                fields.setdefault((b.group, b.layer), {})[_FIELD[(b.role, b.tensor)]] = t
        draft_dtype = plan.dtype
        for (group, layer), f in fields.items():
            g = geo[group]
            view = LayerView(
                layer=layer,
                dtype=draft_dtype if group == "draft" else plan.layer_dtypes[layer],
                page_size=plan.page_size,
                num_kv_heads=g.kv_heads,
                head_dim=g.head_dim,
                v_head_dim=g.v_head_dim,
                **(f | workspaces.get(group, {}) | {"v": f.get("v")}),
            )
            (self._draft_views if group == "draft" else self._views)[layer] = view
        # a shared-KV layer reads its source layer's pages: the same view
        self._shared = {
            i: src for i, src in enumerate(plan.shared_sources) if src is not None
        }
        # layer index -> view, shared layers included: the per-call lookup of write/decode
        self._by_index = {i: self._views[src] for i, src in self._shared.items()} | self._views
        self.scales_source: str | None = None
        self._scales_checked = False

    @property
    def layers(self) -> list[int]:
        """Indices of the layers that own KV buffers (not linear-attention or shared layers)."""
        return list(self._views)

    def layer(self, layer: int) -> LayerView:
        """The buffers of one layer; a shared-KV layer gets its source layer's view.

        Sliding layers' views have the rows of their own page space
        (``plan.page_spaces["sliding_<window>"]``): their page tables hold that space's page ids.

        Raises
        ------
        KeyError
            ``layer`` is out of range or stores no KV (linear attention).
        """
        if type(layer) is int:  # (the per-call fast path; a bool or float goes the slow way)
            view = self._by_index.get(layer)
            if view is not None:
                return view
        try:
            # (an int or numpy integer; 0.0 would find layer 0 through the dict's hash)
            i = as_index(layer)
            return self._views[self._shared.get(i, i)]
        except (KeyError, TypeError):
            raise KeyError(
                f"layer `{layer}` has no KV buffers (layers with KV: "
                f"0..{self.plan.spec.num_layers - 1} except linear-attention layers)"
            ) from None

    def draft_layer(self, layer: int) -> LayerView:
        """The buffers of draft layer ``layer`` (``draft.layers.<i>.*``), in the primary space.

        Raises
        ------
        KeyError
            The plan has no draft, or no such draft layer.
        """
        try:
            return self._draft_views[as_index(layer)]
        except (KeyError, TypeError):
            raise KeyError(
                f"draft layer `{layer}` does not exist (draft layers: {list(self._draft_views)})"
            ) from None

    def state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv_state, ssm_state)`` of linear-attention layer ``layer``.

        ``conv_state`` ``[num_state_slots + 1, conv_dim, conv_kernel - 1]`` in the model dtype,
        ``ssm_state`` ``[num_state_slots + 1, num_v_heads, k_head_dim, v_head_dim]`` in
        ``mamba_ssm_dtype`` (per rank); row = state slot, slot 0 is padding.

        Raises
        ------
        KeyError
            ``layer`` is not a linear-attention layer.
        """
        try:
            st = self._states[as_index(layer)]
        except (KeyError, TypeError):
            raise KeyError(
                f"layer `{layer}` has no linear-attention state (state layers: "
                f"{list(self._states)})"
            ) from None
        return st["conv_state"], st["ssm_state"]

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer; equals ``plan.total_bytes``."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def set_kv_scales(
        self, k_scales: Sequence[float], v_scales: Sequence[float], *, source: str = "caller"
    ) -> None:
        """Set per-layer scales: fp8 per-tensor ``k_scale``/``v_scale``, nvfp4 global scales.

        One entry per model layer (entries of layers without such a scale are ignored, so pass
        the same list for every dtype). Both the write and the attention paths read them from
        these buffers. Scales are real numbers (floats, ints, numpy scalars, 0-d tensors; not
        bools or strings), finite and positive in fp32; nothing changes on error.

        Raises
        ------
        ValueError
            Wrong length, or a scale that is not a real number, too large, or not finite and
            positive (naming the layer).
        """
        from kvpool.scales import _scale_floats

        n = self.plan.spec.num_layers
        ks, vs = (
            _scales_f32(name, _scale_floats(name, s, n), n)
            for name, s in (("k_scales", k_scales), ("v_scales", v_scales))
        )
        for layer, view in self._views.items():
            if view.k_scale is not None:
                view.k_scale.fill_(ks[layer])
            if view.v_scale is not None:
                view.v_scale.fill_(vs[layer])
        self.scales_source = source

    def read_pages(self, pages) -> torch.Tensor:
        """The bytes of ``pages`` over every per-page buffer: ``[len(pages), page_bytes]`` uint8.

        See :class:`kvpool.page_io.PageLayout` (``read``) for the layout and errors.
        """
        return self.page_layout.read(pages)

    def write_pages(self, pages, data: torch.Tensor) -> None:
        """Write bytes :meth:`read_pages` gave into ``pages`` (uint8 ``[len(pages), page_bytes]``).

        From this pool or one of the same layout; see :class:`kvpool.page_io.PageLayout`
        (``write``) for the errors.
        """
        self.page_layout.write(pages, data)

    @property
    def page_layout(self):
        """The pool's :class:`kvpool.page_io.PageLayout` (made at first use)."""
        if getattr(self, "_page_layout", None) is None:
            from kvpool.page_io import PageLayout

            self._page_layout = PageLayout(self)
        return self._page_layout

    # --- quantized write / dequantize (kvpool.write) and the missing-scales warning ---------

    #: Check slots and finiteness on every write, and seq_lens, cu_seqlens_q and page ids on
    #: every ``decode``/``extend`` (a host sync per call, per layer); CPU tensors are always
    #: checked.
    debug: bool = False

    def write(
        self,
        layer: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None = None,
        *,
        debug: bool | None = None,
    ) -> None:
        """Quantize and store one layer's new K/V at slots ``loc`` (one fused kernel on the GPU).

        ``loc`` ``[T]`` int32/int64, ``k`` ``[T, H, D]``, ``v`` ``[T, H, Dv]`` (None for MLA),
        bf16/fp16/fp32. Layouts, NaN/Inf rules and checks: :func:`kvpool.write.write_kv`.
        The first write of an fp8_e4m3 pool whose scales were never set warns once.

        Raises
        ------
        ValueError
            Bad shapes/dtypes/devices; out-of-range slots or non-finite values on the CPU path
            or with ``debug`` (default: ``pool.debug``).
        KeyError
            ``layer`` stores no KV.
        """
        if not self._scales_checked:
            self._warn_missing_scales_once()
        view = self.layer(layer)
        if debug is None:
            debug = self.debug
        # (write_kv's two halves, called here without its frame: the per-layer path)
        replay, checked = _write_fns()
        if not debug and replay(view, loc, k, v, "auto", None, None):
            return
        checked(view, loc, k, v, debug, "auto", None, None)

    def dequantize(
        self, layer: int, loc: torch.Tensor, out_dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Read slots ``loc`` of one layer back as values: ``(k [N, H, D], v [N, H, Dv] or None)``.

        The unfused reference read path (and what tests compare against); uses the same
        per-layer scales as the write and attention paths.
        """
        from kvpool.write import dequantize_kv

        view = self.layer(layer)
        k = dequantize_kv(view, loc, "k", out_dtype)
        v = None if view.is_mla else dequantize_kv(view, loc, "v", out_dtype)
        return k, v

    def _warn_missing_scales_once(self) -> None:
        """Warn once per pool when fp8_e4m3 layers run at k/v scale 1.0 (never set).

        e5m2 (whose range makes 1.0 usable) and nvfp4 global scales of 1.0 are only logged.
        Scales from a checkpoint, a JSON file, calibration or the caller never warn. The read
        paths (decode/extend) may call this too; it acts once.
        """
        if self._scales_checked:
            return
        self._scales_checked = True
        if self.scales_source is not None:
            return
        from kvpool.scales import warn_missing_scales

        warn_missing_scales({i: v.dtype for i, v in self._views.items()})

    # --- fused attention (kvpool.attention); keep these two methods together at the end -------

    def decode(
        self, layer: int, q: torch.Tensor, page_table=None, seq_lens=None, **kwargs
    ) -> torch.Tensor:
        """Decode attention of one new token per request over ``layer``'s paged cache.

        ``q`` ``[B, H_q, head_dim]``, ``page_table`` ``[B, max_pages]`` int32, ``seq_lens`` ``[B]``
        int32 -> ``[B, H_q, v_head_dim]`` in ``q``'s dtype. Keyword arguments (``sm_scale``,
        ``window``, ``sinks``, ``softcap``, ``backend``, ``plan``, ``out``, ``debug``) as in
        :func:`kvpool.attention.decode`; ``debug`` defaults to ``pool.debug``.
        """
        if not self._scales_checked:
            self._warn_missing_scales_once()
        if "debug" not in kwargs:
            kwargs["debug"] = self.debug
        return _attention().decode(self.layer(layer), q, page_table, seq_lens, **kwargs)

    def extend(
        self,
        layer: int,
        q: torch.Tensor,
        cu_seqlens_q=None,
        page_table=None,
        seq_lens=None,
        **kwargs,
    ) -> torch.Tensor:
        """Extend (prefill with a cached prefix) attention over ``layer``'s paged cache.

        ``q`` ``[T, H_q, head_dim]`` of the new tokens (ragged by ``cu_seqlens_q`` ``[B + 1]``),
        whose K/V were already written; they attend causally to their whole sequence. Keyword
        arguments as in :func:`kvpool.attention.extend`; ``debug`` defaults to ``pool.debug``.
        """
        if not self._scales_checked:
            self._warn_missing_scales_once()
        if "debug" not in kwargs:
            kwargs["debug"] = self.debug
        attend = _attention().extend
        return attend(self.layer(layer), q, cu_seqlens_q, page_table, seq_lens, **kwargs)


# kvpool.write and kvpool.attention, imported at first use (not at ``import kvpool``) and then
# looked up without the import machinery's per-call cost (the per-layer hot path)
_LAZY: dict[str, Any] = {}


def _write_fns():
    """kvpool.write's record replay and checked write (the two halves of ``write_kv``)."""
    fns = _LAZY.get("write")
    if fns is None:
        from kvpool.write import _replay_write, _write_checked

        fns = _LAZY["write"] = (_replay_write, _write_checked)
    return fns


def _attention():
    mod = _LAZY.get("attention")
    if mod is None:
        from kvpool import attention as mod

        _LAZY["attention"] = mod
    return mod
