"""Host cost of kvpool's per-step calls, in microseconds of CPU time per call (issue 22).

Times, at batch sizes B (default 1, 64, 256) of a Llama-3.1-8B-geometry pool (8 KV heads,
head_dim 128, 32 query heads, page_size 16, every request ``--ctx`` tokens long):

- ``page_table``: :func:`kvpool.page_table` from B per-request page lists (numpy int32);
- ``decode_slots`` / ``extend_slots``: the Rust batch helpers (extend: the last 8 tokens);
- ``h2d``: page table, seq_lens and slots to the pool's device, one pinned ``non_blocking``
  copy each (as before issue 22's packing); ``h2d_packed``: the same three in one pinned
  buffer and one copy (:func:`kvpool.to_device_packed`: a new device buffer and views each
  call); ``h2d_upload``: the same through :class:`kvpool.PackedUpload` (a ring of device
  buffers whose views are made once, what ``examples/serve.py`` does);
- ``plan_decode`` / ``plan_extend``: the attention plans (``plan_extend`` reads ``cu_seqlens_q``
  once per batch by design);
- ``write_decode``: one ``pool.write`` + one ``pool.decode(plan=...)`` of one layer, repeated
  over ``--layers`` layers and divided by them (per layer host time), with the launches
  recorded and replayed through the C launch under the compiled kernels' launchers
  (``kvpool._launch``, the default); side by side ``write_decode_launcher_wrapper`` (through
  the launchers' Python wrapper, ``_launch.DIRECT = False``), ``write_decode_normal_launch`` (records replayed through Triton's
  normal launch, ``_launch.FAST = False``: the checks made once, Triton's JIT dispatch per
  launch) and ``write_decode_unrecorded`` (``_launch.RECORD = False``: every call checked and
  launched from scratch, as before records);
- ``step_metadata``: page_table + decode_slots + h2d_upload + plan_decode, the per-step total
  (``step_metadata_packed``: with ``h2d_packed``, run 14's figure; ``step_metadata_3_copies``:
  with ``h2d``, the figure of runs 13 and before).
- ``running_step``: the same step's table and slots kept in place instead
  (:class:`kvpool.running.RunningBatch`: ``grow`` (one row in 16 gains a page), ``slots``,
  ``advance``), what ``examples/serve.py --cuda-graph`` does per step before its graph replay;
  ``running_metadata``: running_step + h2d_upload + plan_decode;
- ``graph_fill``: :class:`kvpool.graph.DecodeGraph`'s copy of a step into its bucket's static
  buffers (page table, seq_lens, slots, token ids padded into one pinned buffer, one copy;
  ``graph_fill_per_buffer``: one pinned copy per buffer, as before).

Modes:

- ``cuda``: the real launches on the GPU. Calls are timed back to back with no sync (launches
  are asynchronous, so the time is the host's); contexts are short so that the GPU keeps up with
  the launch queue and its back-pressure does not show up as host time.
- ``stub`` (CPU): the CUDA path's host side with the Triton kernels replaced by stand-ins whose
  compiled kernel's launcher does nothing (records resolve them as on CUDA, through a stand-in
  Triton driver) and the CPU path's value checks (which the CUDA path skips without ``debug``)
  off: argument checks, record lookup and launch argument preparation, without the launcher's
  own cost (argument parsing and the driver call, measured only in ``cuda`` mode). Host to
  device copies are host copies (no pinned memory).

Each figure is the median of ``--repeats`` timings of ``--iters`` calls (``time.perf_counter``).
Writes a JSON record (machine, versions, numbers) to ``--out`` and prints a table.

Usage::

    python benches/step/bench_host.py --mode stub --out benches/step/results/cpu.json
    python benches/step/bench_host.py --mode cuda --out $OUT/host_cuda.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import kvpool
import numpy as np
import torch
from kvpool import _launch, attention
from kvpool._host import PackedUpload, to_device_packed


def _noop(*args, **kwargs) -> None:
    return None


class _Compiled:
    """A compiled kernel's stand-in: its launcher does nothing."""

    function = 1
    packed_metadata = None
    run = staticmethod(_noop)


class _StubKernel:
    """Stands in for a Triton kernel: the real signature (so records bind their arguments as
    on CUDA), ``warmup`` gives a :class:`_Compiled`, ``kernel[grid](...)`` does nothing."""

    def __init__(self, fn):
        self.signature = fn.signature

    def warmup(self, *args, grid=None, **kwargs):
        return _Compiled()

    def __getitem__(self, grid):
        return _noop


class _StubDriver:
    """Triton's active driver where the records ask for the stream and device."""

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_device(self) -> int:
        return 0


@contextlib.contextmanager
def stubbed():
    """Run the CUDA path's host side on CPU tensors (see the module docstring)."""
    import kvpool.triton_kernels.decode as dk
    import kvpool.triton_kernels.extend as ek
    import kvpool.triton_kernels.quant_write as qw
    from kvpool import write
    from kvpool.attention import launch_decode, launch_extend
    from triton.runtime import driver

    saved = []

    def patch(mod, name, value):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    for mod, name in (
        (dk, "decode_kernel"),
        (dk, "merge_kernel"),
        (ek, "extend_kernel"),
        (qw, "quant_write_kernel"),
    ):
        patch(mod, name, _StubKernel(getattr(mod, name)))
    patch(write, "_use_triton", lambda backend, device: True)
    for mod in (launch_decode, launch_extend):
        patch(mod, "_use_triton", lambda backend, q: True)
        patch(mod, "_check_batch", lambda *a, **k: None)  # the CUDA path skips it
    patch(launch_decode, "_MERGE_PDL", False)  # (asks the device's capability)
    patch(_launch, "FAST_DEVICE_TYPES", ("cuda", "cpu"))
    active = driver._active  # (None until first use; no CUDA driver here)
    driver.set_active(_StubDriver())
    try:
        yield
    finally:
        driver._active = active
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


def _time(fn, iters: int, repeats: int, sync) -> float:
    """Median over ``repeats`` of the mean microseconds per call of ``iters`` calls."""
    fn()
    sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
        sync()
    return statistics.median(runs)


def bench(b: int, pool, args, sync) -> dict[str, float]:
    """Per-call microseconds of every timed call at batch size ``b``."""
    view = pool.layer(0)
    dev = view.k.device
    ps, ctx = view.page_size, args.ctx
    npages = -(-ctx // ps)
    pages = [np.arange(1 + i * npages, 1 + (i + 1) * npages, dtype=np.int32) for i in range(b)]
    seq = np.full(b, ctx, dtype=np.int32)
    prefix = seq - 8
    hq = 4 * view.num_kv_heads
    dt = torch.bfloat16
    q = torch.randn(b, hq, view.head_dim, device=dev).to(dt)
    k = torch.randn(b, view.num_kv_heads, view.head_dim, device=dev).to(dt)
    v = torch.randn(b, view.num_kv_heads, view.v_head_dim, device=dev).to(dt)
    out = torch.empty(b, hq, view.v_head_dim, device=dev, dtype=dt)
    pt_np = kvpool.page_table(pages, npages)
    slots_np = kvpool.decode_slots(pt_np, seq, ps)
    pin = dev.type == "cuda"

    def h2d():
        return [  # (stub: a host copy each, as h2d_packed makes one)
            torch.from_numpy(a).pin_memory().to(dev, non_blocking=True) if pin else
            torch.from_numpy(a).clone()
            for a in (pt_np, seq, slots_np)
        ]  # fmt: skip

    packed_out = None if pin else torch.empty(4096 + 16 * pt_np.size, dtype=torch.uint8)

    def h2d_packed():  # (stub: packed into a host buffer, the same Python work)
        return to_device_packed([pt_np, seq, slots_np], dev, out=packed_out)

    upload = PackedUpload(dev)

    def h2d_upload():
        return upload([pt_np, seq, slots_np])

    pt, sl, loc = h2d()
    cu = torch.arange(0, 8 * b + 1, 8, dtype=torch.int32, device=dev)
    plan = attention.plan_decode(view, hq, pt, sl, max_seq_len=ctx)
    layers = pool.layers[: args.layers]

    def write_decode():
        for i in layers:
            pool.write(i, loc, k, v)
            pool.decode(i, q, plan=plan, out=out)

    it, rep = args.iters, args.repeats
    r = {
        "page_table": _time(lambda: kvpool.page_table(pages, npages), it, rep, sync),
        "decode_slots": _time(lambda: kvpool.decode_slots(pt_np, seq, ps), it, rep, sync),
        "extend_slots": _time(lambda: kvpool.extend_slots(pt_np, prefix, seq, ps), it, rep, sync),
        "h2d": _time(h2d, it, rep, sync),
        "h2d_packed": _time(h2d_packed, it, rep, sync),
        "h2d_upload": _time(h2d_upload, it, rep, sync),
        "plan_decode": _time(
            lambda: attention.plan_decode(view, hq, pt, sl, max_seq_len=ctx), it, rep, sync
        ),
        "plan_extend": _time(lambda: attention.plan_extend(view, hq, cu, pt, sl), it, rep, sync),
        "write_decode": _time(write_decode, max(1, it // 10), rep, sync) / len(layers),
    }
    for name, switch in (("launcher_wrapper", "DIRECT"), ("normal_launch", "FAST"),
                         ("unrecorded", "RECORD")):  # fmt: skip
        setattr(_launch, switch, False)
        try:
            r["write_decode_" + name] = (
                _time(write_decode, max(1, it // 10), rep, sync) / len(layers)
            )
        finally:
            setattr(_launch, switch, True)
    if args.numpy_plan:  # the numpy entry (issue 21): plan_decode converts the arrays itself
        r["plan_decode_numpy"] = _time(
            lambda: attention.plan_decode(view, hq, pt_np, seq, max_seq_len=ctx), it, rep, sync
        )
    base = r["page_table"] + r["decode_slots"] + r["plan_decode"]
    r["step_metadata"] = base + r["h2d_upload"]
    r["step_metadata_packed"] = base + r["h2d_packed"]
    r["step_metadata_3_copies"] = base + r["h2d"]
    r["running_step"] = _running_step(b, ps, it, rep, sync)
    r["running_metadata"] = r["running_step"] + r["h2d_upload"] + r["plan_decode"]
    r["graph_fill"], r["graph_fill_per_buffer"] = _graph_fill(pool, hq, pt_np, seq, slots_np,
                                                              it, rep, sync)  # fmt: skip
    return r


def _graph_fill(pool, hq, pt_np, seq, slots_np, it, rep, sync) -> tuple[float, float]:
    """Host us of DecodeGraph's copy of one step into its bucket (packed, per buffer)."""
    import dataclasses

    from kvpool.graph import DecodeGraph

    b, w = pt_np.shape
    g = DecodeGraph(pool, hq, w, [b], inputs={"input_ids": ((), torch.int64)}, use_graphs=False)
    s = g.static[b]
    ids = np.arange(b, dtype=np.int64)
    per_buffer = dataclasses.replace(s, packing=None)
    return (
        _time(lambda: g._fill(s, b, pt_np, seq, slots_np, {"input_ids": ids}), it, rep, sync),
        _time(lambda: g._fill(per_buffer, b, pt_np, seq, slots_np, {"input_ids": ids}), it, rep,
              sync),
    )  # fmt: skip


def _running_step(b: int, ps: int, it: int, rep: int, sync) -> float:
    """Per-step host us of a RunningBatch of ``b`` requests (see the module docstring)."""
    from kvpool.running import RunningBatch

    rb = RunningBatch(b, 4096 // ps, ps)
    for i in range(b):  # lengths spread over a page, so that one row in ps gains a page a step
        rb.add(np.arange(1 + 4 * i, 5 + 4 * i, dtype=np.int32), 3 * ps + i % ps + 1, 0)
    nxt = [10_000]
    ids = np.zeros(b, np.int64)

    def alloc(k):
        nxt[0] += k
        return np.arange(nxt[0] - k, nxt[0], dtype=np.int32)

    def step():
        if rb.seq_lens[0] > rb.max_pages * ps - 2:  # (restart the lengths before the table ends)
            rb.seq_lens[:b] = 3 * ps + np.arange(b) % ps + 1
            rb.num_pages[:b] = 4
        rb.grow(alloc)
        rb.slots()
        rb.advance(ids)

    return _time(step, it, rep, sync)


def main() -> None:  # noqa: D103
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("stub", "cuda"), default=None,
                   help="default: cuda where a GPU is present, else stub")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256], help="batch sizes")
    p.add_argument("--ctx", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--dtype", default="bf16", help="the pool's KV dtype (default bf16)")
    p.add_argument("--layers", type=int, default=8, help="layers per write_decode call")
    p.add_argument("--iters", type=int, default=200, help="calls per timing (write_decode: /10)")
    p.add_argument("--repeats", type=int, default=5, help="timings per figure (median)")
    p.add_argument("--numpy-plan", action="store_true", help="also time plan_decode on numpy")
    p.add_argument("--label", default="", help="free text stored in the record")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args()
    mode = args.mode or ("cuda" if torch.cuda.is_available() else "stub")
    dev = torch.device("cuda" if mode == "cuda" else "cpu")
    sync = torch.cuda.synchronize if mode == "cuda" else (lambda: None)
    torch.manual_seed(0)
    ps = 16
    tokens = (max(args.batch) * -(-args.ctx // ps) + 1) * ps
    plan = kvpool.size_for(
        "meta-llama/Llama-3.1-8B", args.dtype, 0.9, num_tokens=tokens, page_size=ps,
        weights=0, gpu="H200",
    )  # fmt: skip
    pool = kvpool.KVPool(plan, device=dev)
    n = plan.spec.num_layers
    if args.dtype.startswith("fp8"):
        pool.set_kv_scales([1.0] * n, [1.0] * n)
    results = {}
    with stubbed() if mode == "stub" else contextlib.nullcontext():
        for b in args.batch:
            results[str(b)] = {k: round(v, 2) for k, v in bench(b, pool, args, sync).items()}
    gpu = torch.cuda.get_device_name() if mode == "cuda" else None
    record = {
        "bench": "benches/step/bench_host.py",
        "mode": mode,
        "label": args.label,
        "machine": {
            "host": platform.node(),
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "gpu": gpu,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton"),
        },
        "model": "Llama-3.1-8B geometry (8 KV heads, head_dim 128, 32 q heads)",
        "dtype": args.dtype,
        "page_size": ps,
        "ctx": args.ctx,
        "layers_per_write_decode": min(args.layers, len(pool.layers)),
        "unit": "us of host time per call (median of repeats)",
        "targets_at_B256": {"step_metadata": 50, "write_decode": 15},
        "notes": "step_metadata uses h2d_upload (PackedUpload, since run 15); "
        "step_metadata_packed (h2d_packed, run 14) and step_metadata_3_copies (runs <= 13) are "
        "the earlier definitions",
        "results": results,
    }
    keys = list(next(iter(results.values())))
    print(f"mode {mode} ({gpu or record['machine']['cpu']}), dtype {args.dtype}, us per call")
    w = max(map(len, keys)) + 2
    print(f"{'call':>{w}}" + "".join(f"{'B=' + b:>10}" for b in results))
    for key in keys:
        print(f"{key:>{w}}" + "".join(f"{results[b][key]:>10.1f}" for b in results))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
