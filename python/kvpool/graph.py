"""A decode step captured in CUDA graphs: static buffers per batch bucket, replayed each step.

A decode step of a serving loop launches a few kernels per layer (``pool.write``,
``pool.decode``, the model's own); at small batches their launch cost, not the GPU, sets the
step time (issue 22). :class:`DecodeGraph` captures the whole step once per batch size bucket
and replays it: one launch per step.

What makes a step capturable (and what this module holds for it):

- **Static inputs updated in place.** Per bucket ``n``: the page table ``[n, max_pages]``
  int32, ``seq_lens [n]`` int32, ``slots [n]`` int32 and the caller's own inputs (token ids,
  or q/k/v in a test), each at a fixed address: views of one device buffer (each 64-byte
  aligned; inputs of a dtype numpy lacks, such as bf16, have buffers of their own).
  :meth:`DecodeGraph.run` copies the batch in: numpy arrays padded into one pinned staging
  buffer of the same layout, then one ``non_blocking`` copy (no sync; separate pinned copies
  cost ~20 us of host time each).
- **Plans whose device tensors keep their addresses.** The bucket's
  :class:`~kvpool.attention.DecodePlan` is made once over those buffers, for the longest
  request the table can hold (``max_pages * page_size`` tokens), so its split count and
  workspace never change.
- **Padded requests point at page 0**, the pool's padding page: page table rows of 0,
  ``seq_len`` 1 (decode reads one token, whose output is discarded), slot 0 (the write kernel
  lets padding slots repeat).
- **No allocation in the step**: outputs are written into buffers the captured function
  returns; :meth:`run` returns views of their first ``B`` rows (valid until the next ``run``).

Bad input: a batch larger than the largest bucket runs eagerly (the same function on buffers
of its size) and warns once; a page table of another width raises ValueError (never replays
on stale addresses).

Examples
--------
A decode step of a model (``embed``, ``layers``, ``head`` are the caller's; one write and one
decode per layer, as in ``kvpool/llama.py``)::

    graph = DecodeGraph(pool, num_q_heads=32, max_pages=64,
                        inputs={"input_ids": ((), torch.int64)})

    def step(s):  # s: DecodeStatic of one bucket, s.batch rows (padding included)
        x = embed(s.inputs["input_ids"])
        for i, layer in enumerate(layers):
            q, k, v = layer.qkv(x, positions=s.seq_lens - 1)
            pool.write(i, s.slots, k, v)
            x = layer.out(pool.decode(i, q, plan=s.plan))
        return head(x)  # [s.batch, vocab]

    graph.capture(step)  # once: warm-up and capture of every bucket (CUDA)
    for _ in range(steps):  # numpy int32 from kvpool.page_table / decode_slots
        logits = graph.run(step, table, seq_lens, slots, input_ids=ids)  # [B, vocab]

On CPU (or with ``use_graphs=False``) :meth:`run` calls ``step`` eagerly on the same
buffers: the bucketing and padding are the same, so they are tested on CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool import attention
from kvpool._host import pack_layout, packed_views
from kvpool._torch import torch

if TYPE_CHECKING:
    from kvpool.pool import KVPool

#: Default batch buckets (requests): powers of two to 256, as engines capture (SGLang's
#: ``--cuda-graph-max-bs`` default range is of this order).
BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass
class DecodeStatic:
    """The fixed-address inputs of one bucket, handed to the step function.

    Attributes
    ----------
    batch : int
        Rows (requests) of the bucket, padding included.
    page_table : torch.Tensor
        ``[batch, max_pages]`` int32; padded rows are 0 (the padding page).
    seq_lens : torch.Tensor
        ``[batch]`` int32; padded requests 1.
    slots : torch.Tensor
        ``[batch]`` int32, the slot each request's new token is written to; padded 0.
    plan : DecodePlan
        Over ``page_table`` / ``seq_lens``, for ``max_pages * page_size`` tokens.
    inputs : dict of str to torch.Tensor
        The caller's inputs, ``[batch, *shape]`` each (padded rows 0).
    packing : tuple or None
        Where the buffers above live when they are views of one device buffer (made by
        :class:`DecodeGraph`): ``(buffer, specs, offsets, packed input names)`` of
        :func:`kvpool._host.pack_layout`; None copies each buffer on its own.
    """

    batch: int
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor
    plan: attention.DecodePlan
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    packing: tuple | None = field(default=None, repr=False, compare=False)


class DecodeGraph:
    """Decode steps of a pool in CUDA graphs, one per batch bucket (see the module docstring).

    Parameters
    ----------
    pool : KVPool
        The pool the step writes and attends over (its first KV layer sizes the plans).
    num_q_heads : int
        Query heads per rank.
    max_pages : int
        Width of the page table every step passes (pages per request, at most).
    buckets : sequence of int
        Batch sizes captured (requests), each >= 1; a batch runs in the smallest bucket that
        holds it.
    inputs : mapping of str to (shape, torch.dtype)
        The caller's per-request inputs: name -> (trailing shape, dtype), each stored
        ``[bucket, *shape]`` (e.g. ``{"input_ids": ((), torch.int64)}``).
    use_graphs : bool, optional
        Capture and replay CUDA graphs (default: the pool is on CUDA); else run eagerly.
    plan_options : mapping, optional
        Keyword arguments of :func:`kvpool.attention.plan_decode` (``num_splits``, ...).

    Raises
    ------
    ValueError
        Bad ``buckets``, ``max_pages``, input specs, or ``use_graphs`` on a CPU pool.
    """

    def __init__(
        self,
        pool: KVPool,
        num_q_heads: int,
        max_pages: int,
        buckets: Sequence[int] = BUCKETS,
        inputs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        *,
        use_graphs: bool | None = None,
        plan_options: Mapping[str, Any] | None = None,
    ):
        view = pool.layer(pool.layers[0])
        self.device = view.k.device
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        if use_graphs and self.device.type != "cuda":
            raise ValueError(f"`use_graphs=True` needs a CUDA pool, this one is on {self.device}")
        if isinstance(max_pages, bool) or not isinstance(max_pages, int) or max_pages < 1:
            raise ValueError(f"`max_pages` = {max_pages!r}: must be an int >= 1")
        bs = sorted(set(buckets))
        if not bs or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs):
            raise ValueError(f"`buckets` = {list(buckets)!r}: must be ints >= 1")
        self.pool, self.view, self.num_q_heads = pool, view, num_q_heads
        self.max_pages, self.buckets, self.use_graphs = max_pages, tuple(bs), use_graphs
        self.input_specs = {k: (tuple(s), d) for k, (s, d) in (inputs or {}).items()}
        self.plan_options = dict(plan_options or {})
        self.max_seq_len = max_pages * view.page_size
        self.static = {b: self._buffers(b) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}
        self._warned = False

    def _buffers(self, b: int) -> DecodeStatic:
        """Static buffers of ``b`` requests, all padding (page 0, seq_len 1, slot 0).

        The batch metadata and the numpy-typed inputs are views of one device buffer
        (:meth:`_fill` copies a step in with one copy).
        """
        dev = self.device
        packed = [k for k, (_, d) in self.input_specs.items() if _numpy_dtype(d) is not None]
        specs = [((b, self.max_pages), np.int32), ((b,), np.int32), ((b,), np.int32)]
        specs += [((b, *self.input_specs[k][0]), _numpy_dtype(self.input_specs[k][1]))
                  for k in packed]  # fmt: skip
        offs, total = pack_layout(specs)
        buf = torch.zeros(total, dtype=torch.uint8, device=dev)
        views = packed_views(buf, specs, offs)
        pt, sl, slots = views[:3]
        sl.fill_(1)
        plan = attention.plan_decode(
            self.view, self.num_q_heads, pt, sl, max_seq_len=self.max_seq_len,
            **self.plan_options,
        )  # fmt: skip
        inputs = dict(zip(packed, views[3:], strict=True))
        for k, (shp, d) in self.input_specs.items():
            if k not in inputs:
                inputs[k] = torch.zeros((b, *shp), dtype=d, device=dev)
        return DecodeStatic(batch=b, page_table=pt, seq_lens=sl, slots=slots, plan=plan,
                            inputs={k: inputs[k] for k in self.input_specs},
                            packing=(buf, specs, offs, packed))  # fmt: skip

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` requests, or None when none does."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def capture(self, step: Callable[[DecodeStatic], Any], warmup: int = 2) -> None:
        """Warm up and capture ``step`` for every bucket (CUDA graphs; a no-op when eager).

        ``step`` runs on the bucket's all-padding buffers (so it writes only the padding page)
        ``warmup`` times on a side stream (Triton compiles there), then once under capture.
        Its return value (tensors, or a tuple/dict of them) is the graph's output.
        """
        if not self.use_graphs:
            return
        mempool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for s in self.static.values():
                for _ in range(warmup):
                    step(s)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for b in reversed(self.buckets):  # largest first: the others reuse its memory pool
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=mempool):
                self.outputs[b] = step(self.static[b])
            mempool = g.pool()
            self.graphs[b] = g

    def _fill(self, s: DecodeStatic, n: int, page_table, seq_lens, slots, inputs) -> None:
        """Copy a batch of ``n`` requests into ``s`` (rows past ``n``: padding), without a sync.

        Numpy batch arrays and inputs go through one pinned staging buffer of the static
        buffer's layout and one copy; device tensors are copied device to device.
        """
        batch = {"page_table": page_table, "seq_lens": seq_lens, "slots": slots}
        for name, src in batch.items():
            if not isinstance(src, torch.Tensor) and np.asarray(src).dtype != np.int32:
                raise ValueError(f"`{name}` is {np.asarray(src).dtype}, expected int32")
        buf, specs, offs, packed = s.packing or (None, None, None, ())
        srcs = (*batch.values(), *(inputs[k] for k in packed))
        if buf is not None and not any(isinstance(x, torch.Tensor) for x in srcs):
            host = torch.empty(buf.numel(), dtype=torch.uint8, pin_memory=self._pin)
            views = packed_views(host.numpy(), specs, offs)
            for v, src, pad in zip(views, batch.values(), (0, 1, 0), strict=False):
                v[:n] = src
                v[n:] = pad
            for v, name in zip(views[3:], packed, strict=True):
                v[:n] = inputs[name]
                v[n:] = 0
            buf.copy_(host, non_blocking=True)  # (the host buffer is kept until it has run)
            rest = [k for k in s.inputs if k not in packed]
        else:
            pads = {"page_table": 0, "seq_lens": 1, "slots": 0}
            for name, src in batch.items():
                dst = getattr(s, name)
                if isinstance(src, torch.Tensor):  # already on the device: no host round trip
                    dst[:n].copy_(src, non_blocking=True)
                else:
                    dst[:n].copy_(self._pinned(np.ascontiguousarray(src)), non_blocking=True)
                dst[n:].fill_(pads[name])
            rest = list(s.inputs)
        for name in rest:
            t, x = s.inputs[name], inputs[name]
            if isinstance(x, torch.Tensor):
                t[:n].copy_(x, non_blocking=True)
            else:  # (through pinned memory: a copy from pageable memory would block the host)
                t[:n].copy_(self._pinned(np.ascontiguousarray(x)), non_blocking=True)
            t[n:].zero_()

    @property
    def _pin(self) -> bool:
        return self.device.type == "cuda"

    def _pinned(self, host: np.ndarray) -> torch.Tensor:
        src = torch.from_numpy(host)
        if self._pin:
            src = src.pin_memory()  # (the caching host allocator keeps it until the copy ran)
        return src

    def _check(self, page_table, seq_lens, slots, inputs) -> int:
        """The batch size, after checking shapes (ValueError naming the bad argument)."""
        if page_table.ndim != 2 or page_table.shape[1] != self.max_pages:
            raise ValueError(
                f"`page_table` has shape {tuple(page_table.shape)}; this DecodeGraph was "
                f"captured for [B, {self.max_pages}] (max_pages): a table of another width "
                "would replay on buffers of another shape. Pad it to max_pages (page 0) or "
                "make a DecodeGraph for the new width"
            )
        n = page_table.shape[0]
        for name, x in (("seq_lens", seq_lens), ("slots", slots)):
            if tuple(x.shape) != (n,):
                raise ValueError(f"`{name}` has shape {tuple(x.shape)}, expected ({n},)")
        missing = set(self.input_specs) - set(inputs)
        extra = set(inputs) - set(self.input_specs)
        if missing or extra:
            raise ValueError(
                f"inputs {sorted(inputs)} do not match the DecodeGraph's {sorted(self.input_specs)}"
            )
        for name, (shape, _) in self.input_specs.items():
            if tuple(inputs[name].shape) != (n, *shape):
                raise ValueError(
                    f"`{name}` has shape {tuple(inputs[name].shape)}, expected {(n, *shape)}"
                )
        if n < 1:
            raise ValueError("the batch is empty: a decode step needs at least one request")
        return n

    def run(self, step: Callable[[DecodeStatic], Any], page_table, seq_lens, slots, **inputs):
        """Run one decode step of ``B`` requests: fill the bucket's buffers, replay its graph.

        Parameters
        ----------
        step : callable
            The function given to :meth:`capture` (called eagerly when not capturing, or
            for a batch larger than every bucket).
        page_table : numpy.ndarray or torch.Tensor
            ``[B, max_pages]`` int32 (numpy: from :func:`kvpool.page_table`).
        seq_lens, slots : numpy.ndarray or torch.Tensor
            ``[B]`` int32: tokens per request (the new one included) and the new token's slot
            (:func:`kvpool.decode_slots`).
        **inputs
            The caller's inputs named in ``inputs=``, ``[B, *shape]`` each.

        Returns
        -------
        The step's output (a tensor, or a tuple/list/dict of tensors, each with the bucket's
        batch as its first dim) cut to its first ``B`` rows: views of the graph's output
        buffers, valid until the next ``run``.

        Raises
        ------
        ValueError
            A page table of another width than ``max_pages``, other shapes or dtypes, an empty
            batch, or inputs that do not match ``inputs=``.
        RuntimeError
            Graphs are used and :meth:`capture` has not run.
        """
        n = self._check(page_table, seq_lens, slots, inputs)
        b = self.bucket(n)
        if b is None:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"decode batch of {n} requests is larger than the largest captured bucket "
                    f"({self.buckets[-1]}): running it eagerly (said once)",
                    stacklevel=2,
                )
            s = self._buffers(n)
            self._fill(s, n, page_table, seq_lens, slots, inputs)
            return step(s)
        s = self.static[b]
        self._fill(s, n, page_table, seq_lens, slots, inputs)
        if not self.use_graphs:
            return _rows(step(s), n)
        if b not in self.graphs:
            raise RuntimeError("DecodeGraph.run before capture(): call capture(step) first")
        self.graphs[b].replay()
        return _rows(self.outputs[b], n)


def _numpy_dtype(d: torch.dtype) -> np.dtype | None:
    """The numpy dtype of torch dtype ``d`` (None where numpy has none: bf16, fp8)."""
    try:
        return torch.empty(0, dtype=d).numpy().dtype
    except TypeError:
        return None


def _rows(out, n: int):
    """``out`` (a tensor, or a tuple/list/dict of them) cut to its first ``n`` rows."""
    if isinstance(out, torch.Tensor):
        return out[:n]
    if isinstance(out, dict):
        return {k: _rows(v, n) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_rows(v, n) for v in out)
    return out
