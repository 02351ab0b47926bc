"""Planned decode calls replayed from records: the checks and launch arguments made once.

A serving step calls ``decode(view, q, plan=plan)`` once per layer with the same kinds of
arguments every time; only the tensors' addresses change (each layer's ``q``, a new ``out``, a
step's plan). The first call of a kind runs every check and builds the launch (in
:mod:`kvpool.attention.launch_decode`), then records it on the view: the kernels it launched as
:class:`kvpool._launch.Launch` records, under a key of everything those checks and the kernels'
specialization read (see :func:`decode_key`). A later call with the same key replays them with
its own tensors: no argument is checked twice, no Triton dispatch runs on CUDA.

The key holds, for ``q``, ``out``, ``sinks`` and the plan's tensors, dtype, shape, strides,
device and address modulo 16 (:func:`kvpool._launch.tensor_key`); the plan's launch options;
``sm_scale``, ``window``, ``softcap``, ``backend``; and the module switches the launch reads
(``_MERGE_PDL``, the ``_GLUON_*`` tables). A record also keeps the view's fields as they were
(by identity): a view whose buffers were replaced is checked again.

Only calls with a ``plan`` and without ``page_table``/``seq_lens``/``debug`` are recorded; CPU
tensors (the interpreter) still have their batch values checked on every call.
"""

from __future__ import annotations

from operator import attrgetter, is_
from typing import TYPE_CHECKING

from kvpool import _launch
from kvpool._launch import tensor_key
from kvpool._torch import torch
from kvpool.attention import variants
from kvpool.attention.checks import _VIEW_FIELDS
from kvpool.attention.plans import DecodePlan

if TYPE_CHECKING:
    from kvpool.pool import LayerView

_VIEW = attrgetter(*_VIEW_FIELDS)
_PLAN_TENSORS = attrgetter("page_table", "seq_lens", "part_out", "part_lse")
_PLAN_OPTIONS = attrgetter("num_q_heads", "num_splits", "block_n", "num_warps", "num_stages",
                           "use_dot", "prefetch", "asm", "swap", "ablate", "group_pad",
                           "maxnreg", "gluon", "kernel", "knobs")  # fmt: skip


class DecodeRecord:
    """The launches of one kind of planned decode call (see the module docstring)."""

    __slots__ = ("fields", "launches", "shape", "dtype", "device", "check")

    def __init__(self, view, launches, out: torch.Tensor, check: bool):
        self.fields = _VIEW(view)
        self.launches = launches
        self.shape, self.dtype, self.device = tuple(out.shape), out.dtype, out.device
        self.check = check


def _plan_key(plan: DecodePlan) -> tuple:
    """The plan's part of the key, cached on the plan while its fields are the same objects."""
    tensors, options = _PLAN_TENSORS(plan), _PLAN_OPTIONS(plan)
    hit = plan.__dict__.get("_launch_key")
    if hit is not None and all(map(is_, hit[0], tensors)) and hit[1] == options:
        return hit[2]
    key = (type(plan), *map(tensor_key, tensors), *options)
    plan.__dict__["_launch_key"] = (tensors, options, key)
    return key


def decode_key(
    view, q, plan, out, sinks, sm_scale, window, softcap, backend, merge_pdl
) -> tuple | None:
    """The record key of a planned decode call, or None when the call is not recorded.

    ``merge_pdl``: ``launch_decode._MERGE_PDL`` (the caller's module switch).
    """
    if not _launch.RECORD or type(plan) is not DecodePlan or type(q) is not torch.Tensor:
        return None
    if out is not None and type(out) is not torch.Tensor:
        return None
    if sinks is not None and type(sinks) is not torch.Tensor:
        return None
    try:
        key = (
            _plan_key(plan), tensor_key(q), tensor_key(out), tensor_key(sinks),
            sm_scale, window, softcap, backend,
            merge_pdl, variants._GLUON_FP4_OPTIONS, variants._GLUON_FP4_DEC,
            id(variants._GLUON_FP8_OPTIONS),
        )  # fmt: skip
        hash(key)
    except TypeError:  # an unhashable option: the call is checked (and refused) as usual
        return None
    return key


def replay_decode(view: LayerView, key, q, plan, out, sinks, window) -> torch.Tensor | None:
    """The output of the recorded call ``key``, or None when there is no valid record."""
    rec = view.__dict__.get("_launch_records", {}).get(key)
    if rec is None or not all(map(is_, rec.fields, _VIEW(view))):
        return None
    if out is None:
        out = torch.empty(rec.shape, dtype=rec.dtype, device=rec.device)
    if rec.check:  # CPU tensors: the batch values are checked on every call
        from kvpool.attention import launch_decode

        launch_decode._check_batch(view, plan.page_table, plan.seq_lens, window=window)
    pc = (q, out, sinks, plan.page_table, plan.seq_lens, plan.part_out, plan.part_lse)
    for launch in rec.launches:
        launch(*pc)
    return out


def record_decode(view, key, calls: list, q, plan, out, sinks, page_table, seq_lens) -> None:
    """Launch ``calls`` (``(fn, grid, args, kwargs)`` each), recorded under ``key`` if given."""
    if key is None:
        for fn, grid, args, kwargs in calls:
            fn[grid](*args, **kwargs)
        return
    pc = (q, out, sinks, page_table, seq_lens, plan.part_out, plan.part_lse)
    dev = view.k.device
    launches = [_launch.Launch(fn, grid, a, kw, pc, dev) for fn, grid, a, kw in calls]
    for launch in launches:
        launch(*pc)
    _launch.records(view)[key] = DecodeRecord(view, launches, out, dev.type != "cuda")


def recorded(view: LayerView) -> list[DecodeRecord]:
    """The decode records kept on ``view`` (tests and benchmarks look at them)."""
    recs = view.__dict__.get("_launch_records", {}).values()
    return [r for r in recs if isinstance(r, DecodeRecord)]
