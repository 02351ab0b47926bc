"""The decode side of examples/serve.py's ``GraphEngine``: CUDA graphs over a batch kept in place.

``python examples/serve.py --cuda-graph`` (the default on a CUDA ``--device``) serves with
``GraphEngine = GraphDecode + Engine``: admission, prefill (eager, ``ModelRunner``), the radix
cache and releases are the ``Engine``'s; the decode steps are this file's:

- the running requests' page table, ``seq_lens`` and next tokens are a
  :class:`kvpool.running.RunningBatch`, written only where they change (a row when a request
  starts or stops decoding, one entry when a request's next token starts a page);
- each step replays the :class:`kvpool.graph.DecodeGraph` bucket of its batch size, the whole
  forward of ``Llama.graph_step`` (write + decode per layer) captured once per bucket;
- per request and step the only Python is the sampling's: the token appended, the stop checked.

Also here: :func:`warm_up`, what ``Engine.warmup()`` / ``GraphEngine.warmup()`` run (synthetic
steps over the padding page that compile every kernel a serving run launches, before it is
timed).

Kept apart from serve.py (which imports it) so that the example's main file stays readable.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch


def warm_up(engine: Any, *, max_seq_len: int | None = None, prefill_tokens: int | None = None,
            decode: bool = True) -> dict[str, Any]:  # fmt: skip
    """Compile what a serving run of ``engine`` launches, with synthetic steps (issue 22).

    Triton compiles a kernel the first time it meets a new variant; in a timed run that is
    seconds (run 14 on the H200: 2.2 s of the first run's prefill). The steps here touch only
    the padding page (page 0: every page-table entry, every slot; the write kernel lets padding
    slots repeat and nothing reads page 0's contents as data) and no engine state (queue,
    radix cache, allocator, stats), so a warmed engine serves exactly as a cold one.

    - **Prefill**: one step of ``prefill_tokens`` new tokens (default: the engine's
      ``max_prefill_tokens``, at most 2,048: the kernels do not depend on the size) in requests
      of at most 512 tokens, the first one after a cached prefix of one page: the write kernel
      and the extend kernel with and without a prefix (one variant each: their int arguments
      are not specialized and the extend plan's tiles depend on the geometry only).
    - **Decode** (``decode=True``): one step per distinct decode kernel variant of batches
      1 .. ``max_running`` and page tables up to ``max_seq_len`` tokens
      (:func:`kvpool.warmup.decode_shapes`). ``max_seq_len`` defaults to the longest queued
      request (prompt + ``max_new_tokens``), else the pool's capacity capped at 4,096 tokens.

    Returns ``{"prefill_tokens", "prefill_requests", "decode_shapes", "seconds"}``. Ends with a
    device sync (the compiles and the GPU work are done when it returns).
    """
    from kvpool.warmup import decode_shapes, geometric

    t0 = time.perf_counter()
    ps, dev = engine.ps, engine.model.device
    total = int(prefill_tokens or min(engine.max_prefill_tokens, 2048))
    if total < 2:
        raise ValueError(f"`prefill_tokens` = {prefill_tokens}: a warm-up prefill needs >= 2")
    chunk = min(512, total - 1)
    new = [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
    cached = [ps] + [0] * (len(new) - 1)  # (request 0 extends a cached page)
    pages = [np.zeros(-(-(c + n) // ps), np.int32) for c, n in zip(cached, new, strict=True)]
    _forward(engine, pages, cached, new)
    shapes: list[tuple[int, int]] = []
    if decode:
        if max_seq_len is None:
            need = [len(r.prompt) + r.max_new_tokens for r in engine.waiting]
            max_seq_len = max(need) if need else min(engine.capacity_tokens, 4096)
        max_pages = max(1, -(-int(max_seq_len) // ps))
        view = engine.pool.layer(engine.pool.layers[0])
        shapes = decode_shapes(view, engine.model.hq, geometric(engine.max_running), max_pages)
        for b, w in shapes:  # (seq_len 1: each request reads one token of page 0)
            _forward(engine, [np.zeros(w, np.int32)] * b, [0] * b, [1] * b)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"prefill_tokens": total, "prefill_requests": len(new), "decode_shapes": shapes,
            "seconds": time.perf_counter() - t0}  # fmt: skip


def _forward(engine: Any, pages: list[np.ndarray], cached: list[int], new: list[int]) -> None:
    """One synthetic step over the padding page through the engine's ModelRunner (token ids 0,
    outputs dropped). Built here, not by ``Step.build``: its slot helper refuses page 0 (a real
    request's tokens never go there)."""
    from kvpool.llama import Step

    ps = engine.ps
    pre, ext = np.asarray(cached, np.int64), np.asarray(new, np.int64)
    cu = np.zeros(len(new) + 1, np.int32)
    cu[1:] = np.cumsum(ext)
    positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - pre, ext)
    w = max(len(p) for p in pages)
    step = Step(positions=torch.from_numpy(positions),
                out_loc=torch.from_numpy(positions % ps),  # (slots of page 0)
                page_table=torch.zeros(len(pages), w, dtype=torch.int32),
                seq_lens=torch.from_numpy((pre + ext).astype(np.int32)),
                cu_seqlens_q=torch.from_numpy(cu))  # fmt: skip
    ids = torch.zeros(int(cu[-1]), dtype=torch.int64, device=engine.model.device)
    engine.runner.run(ids, engine.runner.upload(step))


class gpu_timer:
    """Adds a decode forward's GPU time to ``stats.decode_gpu_s`` and counts the step.

    CUDA events around the forward, read at the next step (no sync of its own: the step's
    sampling syncs anyway). Under CUDA graphs the window is the replay (and its input copies):
    about the GPU's busy time. Eagerly it also holds the GPU's waits for the host's launches.
    """

    def __init__(self, stats: Any, device: torch.device):
        self.stats, self.cuda = stats, device.type == "cuda"

    def __enter__(self):
        self.stats.decode_steps += 1
        if self.cuda:
            self.t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.t[0].record()

    def __exit__(self, *exc):
        if self.cuda:
            self.t[1].record()
            prev, self.stats._pending = getattr(self.stats, "_pending", None), self.t
            if prev is not None:  # (the previous step's events completed at its sampling)
                self.stats.decode_gpu_s += prev[0].elapsed_time(prev[1]) / 1e3

    @staticmethod
    def flush(stats: Any) -> None:
        """Add the last step's GPU time (call after the loop, once the GPU is done)."""
        prev, stats._pending = getattr(stats, "_pending", None), None
        if prev is not None:
            prev[1].synchronize()
            stats.decode_gpu_s += prev[0].elapsed_time(prev[1]) / 1e3


class GraphDecode:
    """The decode side of examples/serve.py's ``GraphEngine`` (``--cuda-graph``), mixed into its
    ``Engine`` (whose admission, prefill, caching and release it keeps).

    The running requests' page table, lengths and next tokens live in a
    :class:`kvpool.running.RunningBatch` updated in place: a request brings its row when it
    starts decoding and takes it away when it ends; a step only appends the pages of rows whose
    next token starts one (one Rust call), computes the slots (one call) and replays the
    :class:`kvpool.graph.DecodeGraph` bucket of its batch size (``Llama.graph_step``: write and
    decode per layer on the bucket's static buffers). Per request and step, the only Python is
    the sampling's: its token appended, the stop checked. ``use_graphs=False`` (CPU) runs the
    same steps eagerly on the same buffers. Prefill stays eager (``ModelRunner``).

    ``max_seq_len``: the page table's width in tokens (a request that could grow past it is
    rejected at submit); the buckets: :data:`kvpool.graph.BUCKETS` below ``max_running``, and
    ``max_running``. ``warmup`` (default: on a CUDA model): run :meth:`warmup` at the end of
    the constructor, after the graphs' capture (which compiles the decode steps), so that the
    first run pays no compile.
    """

    def __init__(self, model: Any, pool: Any, *, max_seq_len: int = 4096,
                 use_graphs: bool | None = None, warmup: bool | None = None,
                 **kw):  # fmt: skip
        from kvpool.graph import BUCKETS, DecodeGraph
        from kvpool.running import RunningBatch

        super().__init__(model, pool, warmup=False, **kw)  # (its own, after the capture)
        self.max_pages = -(-min(self.capacity_tokens, max_seq_len) // self.ps)
        self.batch = RunningBatch(self.max_running, self.max_pages, self.ps)
        self.rows: list[Any] = []  # rows[i] decodes in the batch's row i
        buckets = sorted({b for b in BUCKETS if b < self.max_running} | {self.max_running})
        self.graph = DecodeGraph(pool, model.hq, self.max_pages, buckets,
                                 inputs={"input_ids": ((), torch.int64)},
                                 use_graphs=use_graphs)  # fmt: skip
        self.step_fn = model.graph_step(pool)
        self.graph.capture(self.step_fn)  # every bucket, before any request (page 0 only)
        if warmup or (warmup is None and model.device.type == "cuda"):
            self.warmup()

    def warmup(self, *, prefill_tokens: int | None = None, **_: Any) -> dict[str, Any]:
        """:func:`warm_up` of the prefill; the decode steps are the graphs' buckets: captured
        already (:meth:`kvpool.graph.DecodeGraph.capture` runs each before capturing it), or,
        without graphs, run here once each on their all-padding buffers."""
        info = warm_up(self, prefill_tokens=prefill_tokens, decode=False)
        if not self.graph.use_graphs:
            for s in self.graph.static.values():
                self.step_fn(s)
            info["decode_shapes"] = [(b, self.max_pages) for b in self.graph.static]
        return info

    def submit(self, prompt: list[int], max_new_tokens: int, *, arrival: int = 0) -> Any:
        req = super().submit(prompt, max_new_tokens, arrival=arrival)
        limit = self.max_pages * self.ps
        if req.status == "waiting" and len(req.prompt) + req.max_new_tokens > limit:
            self.waiting.remove(req)
            req.status = "rejected"
            req.error = (
                f"prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new tokens is "
                f"longer than the decode graphs' page table ({limit} tokens, --graph-max-len)"
            )
        return req

    def step(self) -> None:
        t0 = time.perf_counter()
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
        t1 = time.perf_counter()
        if self.batch.n:
            self._decode_rows()
        for r in admitted:  # join the batch for the next step (as Engine decodes them)
            if r.status == "running":
                r.row = self.batch.add(r.pages, r.computed + 1, r.output[-1])
                self.rows.append(r)
        self.stats.prefill_s += t1 - t0
        self.stats.decode_s += time.perf_counter() - t1
        self.now += 1
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - t0

    def _decode_rows(self) -> None:
        b = self.batch
        while True:  # pages for the rows whose next token starts one, all in one allocation
            try:
                rows, pages = b.grow(self._alloc)
                break
            except MemoryError:
                self._retract_youngest()  # (its row leaves the batch) then try again
                if not b.n:
                    return
        for i, p in zip(rows.tolist(), pages.tolist(), strict=True):  # one in page_size steps
            r = self.rows[i]
            r.own_pages = np.append(r.own_pages, np.int32(p))
        n = b.n
        with gpu_timer(self.stats, self.model.device):
            logits = self.graph.run(self.step_fn, b.table[:n], b.seq_lens[:n], b.slots(),
                                    input_ids=b.next_ids[:n])  # fmt: skip
        toks = logits.argmax(-1).cpu().numpy()  # sampling (greedy): the step's one sync
        b.advance(toks)
        self.stats.decode_tokens += n
        self.stats.generated += n
        done = []
        for r, tok in zip(self.rows, toks.tolist(), strict=True):
            r.output.append(tok)
            r.computed += 1
            if len(r.output) >= r.max_new_tokens or tok == self.eos_id:
                done.append(r)
        for r in done:
            self.running.remove(r)
            self._release(r, cache=True)
            r.status = "finished"

    def _release(self, r: Any, *, cache: bool) -> None:
        if r.row is not None:  # the last row moves into its row
            moved = self.batch.remove(r.row)
            last = self.rows.pop()
            if moved is not None:
                self.rows[r.row] = last
                last.row = r.row
            r.row = None
        super()._release(r, cache=cache)
