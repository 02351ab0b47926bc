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

import itertools
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

    __slots__ = ("fields", "launches", "shape", "dtype", "device", "check", "gen")

    def __init__(self, view, launches, out: torch.Tensor, check: bool):
        self.fields = _VIEW(view)
        self.launches = launches
        self.shape, self.dtype, self.device = tuple(out.shape), out.dtype, out.device
        self.check = check
        self.gen = _launch.generation(view)


def _plan_key(plan: DecodePlan) -> tuple:
    """``(token, tensors)``: the plan's part of the key and its tensors (for their pointers).

    The token is an int, :func:`_token` of the tensors' keys and the plan's launch options.

    Cached on the plan for its generation (:class:`kvpool._launch.Generation`); a plan without
    one (or at another) is keyed again unless its fields are the same objects as when cached.
    The pointers are read on every call (a tensor re-pointed in place, ``set_``, still
    launches on its memory).
    """
    d = plan.__dict__
    hit, gen = d.get("_launch_key"), d.get("_gen")
    if hit is not None:
        if gen is not None and hit[0] == gen:
            return hit[1], hit[2]
        tensors, options = _PLAN_TENSORS(plan), _PLAN_OPTIONS(plan)
        if all(map(is_, hit[2], tensors)) and hit[3] == options:
            d["_launch_key"] = (gen, *hit[1:])
            return hit[1], hit[2]
    else:
        tensors, options = _PLAN_TENSORS(plan), _PLAN_OPTIONS(plan)
    key = _token((type(plan), *map(tensor_key, tensors), *options))
    d["_launch_key"] = (gen, key, tensors, options)
    return key, tensors


# Record keys hold small int tokens for their large static parts (a plan's ~25-field key, the
# option tables), so that a lookup hashes and compares a dozen items, not a hundred: ~1 us of
# host time a decode call (benches/step). Equal parts get the same token; a token is never
# reused (the table is cleared when large, and a cleared part gets a new token: records keyed
# on the old one are simply not found again).
_TOKENS: dict = {}
_NEXT = itertools.count(1)


def _token(part: tuple) -> int:
    """The int standing for ``part`` in record keys (see ``_TOKENS``)."""
    t = _TOKENS.get(part)
    if t is None:
        if len(_TOKENS) >= 4096:
            _TOKENS.clear()
        t = _TOKENS[part] = next(_NEXT)
    return t


# (the tables keyed last, the token of their contents): the tables are held, so their
# identities mean what they say
_OPTIONS: list = [None, None, None, 0]


def _options() -> int:
    """A token of the launch's option tables' contents, made again when one is reassigned.

    The tables: ``variants._GLUON_FP4_OPTIONS``, ``_GLUON_FP4_DEC``, ``_GLUON_FP8_OPTIONS``.

    Contents, not ``id``: a table replaced by another is freed, and CPython gives the next new
    dict its address, so two tables met in turn had one key (the first one's launch replayed).
    """
    o = _OPTIONS
    a, b, d = variants._GLUON_FP4_OPTIONS, variants._GLUON_FP4_DEC, variants._GLUON_FP8_OPTIONS
    if o[0] is not a or o[1] is not b or o[2] is not d:
        o[:] = [a, b, d, _token(("options", a, b, tuple(sorted(d.items()))))]
    return o[3]


def _key(t: torch.Tensor | None) -> tuple[tuple | None, int | None]:
    """``(tensor_key(t), t.data_ptr())`` with one ``data_ptr`` call; ``(None, None)`` for None."""
    if t is None:
        return None, None
    p = t.data_ptr()
    return (t.dtype, t.shape, t.stride(), t.get_device(), p & 15), p


def decode_key(
    view, q, plan, out, sinks, sm_scale, window, softcap, backend, merge_pdl
) -> tuple | None:
    """The record key of a planned decode call, or None when the call is not recorded.

    ``merge_pdl``: ``launch_decode._MERGE_PDL`` (the caller's module switch).
    """
    key = _lookup_key(q, plan, out, sinks, sm_scale, window, softcap, backend, merge_pdl)[0]
    try:
        hash(key)
    except TypeError:  # an unhashable option: the call is checked (and refused) as usual
        return None
    return key


def _lookup_key(q, plan, out, sinks, sm_scale, window, softcap, backend, merge_pdl):
    """``(key, pointers)`` of :func:`decode_key`; ``(None, None)`` when not recorded.

    Pointers: q, out, sinks, then the plan's tensors. (The per-layer hot path: the tensor keys
    are :func:`_key` written out.)
    """
    tensor = torch.Tensor
    if not _launch.RECORD or type(plan) is not DecodePlan or type(q) is not tensor:
        return None, None
    qp = q.data_ptr()
    qk = (q.dtype, q.shape, q.stride(), q.get_device(), qp & 15)
    if out is None:
        ok = op = None
    elif type(out) is not tensor:
        return None, None
    else:
        ok, op = _key(out)
    if sinks is None:
        sk = sp = None
    elif type(sinks) is not tensor:
        return None, None
    else:
        sk, sp = _key(sinks)
    if out is q or (sinks is not None and (sinks is q or sinks is out)):
        # (one object in two per-call places: a record of it would put one pointer in both
        # places when replayed with two tensors; such calls are checked and launched as usual)
        return None, None
    pk, (pt, sl, po, pl) = _plan_key(plan)
    key = (pk, qk, ok, sk, sm_scale, window, softcap, backend, merge_pdl, _options())
    # (not hashed here: the record lookup hashes it, and refuses an unhashable option)
    po = None if po is None else po.data_ptr()
    pl = None if pl is None else pl.data_ptr()
    return key, [qp, op, sp, pt.data_ptr(), sl.data_ptr(), po, pl]


def lookup(view, q, plan, out, sinks, sm_scale, window, softcap, backend, merge_pdl):
    """``(output, key)`` of a planned decode call.

    The output when a valid record replayed it (key None), else None and the key to record
    the call under (None: not recorded). A record applies while the view is at its
    generation, or its fields are the same objects.
    """
    key, ptrs = _lookup_key(q, plan, out, sinks, sm_scale, window, softcap, backend, merge_pdl)
    if key is None:
        return None, None
    d = view.__dict__
    try:
        rec = d.get("_launch_records", _NONE).get(key)
    except TypeError:  # an unhashable option: the call is checked (and refused) as usual
        return None, None
    if rec is None:
        return None, key
    gen = d.get("_gen")
    if (gen is None or rec.gen != gen) and not all(map(is_, rec.fields, _VIEW(view))):
        return None, key
    if out is None:
        out = torch.empty(rec.shape, dtype=rec.dtype, device=rec.device)
        ptrs[1] = out.data_ptr()
    if rec.check:  # CPU tensors: the batch values are checked on every call
        _check_batch()(view, plan.page_table, plan.seq_lens, window=window)
    pc = (q, out, sinks, plan.page_table, plan.seq_lens, plan.part_out, plan.part_lse)
    _launch.replay(rec.launches, pc, ptrs)
    return out, None


_NONE: dict = {}


def _check_batch():
    from kvpool.attention import launch_decode  # (a cycle at import time)

    return launch_decode._check_batch


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
