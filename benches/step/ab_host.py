"""Before/after host microseconds of the per-step calls, for the kvpool tree on PYTHONPATH (CPU).

Issue 22: the same measurements on two trees (e.g. a checkout of the commit before the change
and the branch), with the CUDA path's host side run on CPU tensors: the Triton kernels replaced
by stand-ins whose compiled kernel's launcher is a no-op, the records forced to resolve them as
on CUDA (through a stand-in Triton driver), the CPU path's value checks off (as
``bench_host.py --mode stub``, but patching only names every tree has). Times are process CPU
time (the minimum of ``--repeats`` timings): on a shared machine wall time mostly measures the
neighbours.

Not measured here: the launcher's own cost (argument parsing, the driver call; pointers passed
as ints skip a ``data_ptr`` call and a ``cuPointerGetAttribute`` per pointer argument there),
pinned host memory and the copies themselves (``bench_host.py --mode cuda`` on the GPU).

    PYTHONPATH=<tree>/python python benches/step/ab_host.py --out $OUT/ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import kvpool
import numpy as np
import torch
from kvpool import _launch, attention


def _noop(*args, **kwargs):
    return None


class _Compiled:
    function = 1
    packed_metadata = None
    run = staticmethod(_noop)


class _Stub:
    def __init__(self, fn):
        self.signature = fn.signature

    def warmup(self, *args, grid=None, **kwargs):
        return _Compiled()

    def __getitem__(self, grid):
        return _noop


class _Driver:
    def get_current_stream(self, device=None):
        return 0

    def get_current_device(self):
        return 0


@contextlib.contextmanager
def stubbed():
    """The CUDA path's host side on CPU tensors (see the module docstring)."""
    import kvpool.triton_kernels.decode as dk
    import kvpool.triton_kernels.extend as ek
    import kvpool.triton_kernels.quant_write as qw
    from kvpool import write
    from kvpool.attention import launch_decode, launch_extend
    from triton.runtime import driver

    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    for mod, name in ((dk, "decode_kernel"), (dk, "merge_kernel"), (ek, "extend_kernel"),
                      (qw, "quant_write_kernel")):  # fmt: skip
        patch(mod, name, _Stub(getattr(mod, name)))
    patch(write, "_use_triton", lambda backend, device: True)
    for mod in (launch_decode, launch_extend):
        patch(mod, "_use_triton", lambda backend, q: True)
        patch(mod, "_check_batch", lambda *a, **k: None)
    patch(launch_decode, "_MERGE_PDL", False)
    init = _launch.Launch.__init__

    def resolving_init(self, fn, grid, args, kwargs, per_call, device):
        init(self, fn, grid, args, kwargs, per_call, device)
        if self.launcher is None:  # (a CPU device: resolve as on CUDA)
            self._resolve(list(args), per_call)

    patch(_launch.Launch, "__init__", resolving_init)
    active = driver._active
    driver.set_active(_Driver())
    try:
        yield
    finally:
        driver._active = active
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def best_us(fn, iters: int, repeats: int) -> float:
    """Minimum over ``repeats`` of the process-time microseconds per call of ``iters`` calls."""
    for _ in range(max(3, iters // 10)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(iters):
            fn()
        best = min(best, (time.process_time() - t0) / iters * 1e6)
    return best


def bench(b: int, splits: int | None, args) -> dict[str, float]:
    ps, ctx, hq = 16, 64, 32
    plan = kvpool.size_for("meta-llama/Llama-3.1-8B", "bf16", 0.9, num_tokens=(b * 4 + 1) * ps,
                           page_size=ps, weights=0, gpu="H200")  # fmt: skip
    pool = kvpool.KVPool(plan, device="cpu")
    view = pool.layer(0)
    pages = [np.arange(1 + i * 4, 5 + i * 4, dtype=np.int32) for i in range(b)]
    seq = np.full(b, ctx, dtype=np.int32)
    dt = torch.bfloat16
    q = torch.randn(b, hq, 128).to(dt)
    k, v = torch.randn(b, 8, 128).to(dt), torch.randn(b, 8, 128).to(dt)
    pt_np = kvpool.page_table(pages, 4)
    slots_np = kvpool.decode_slots(pt_np, seq, ps)
    pt, sl, loc = (torch.from_numpy(a) for a in (pt_np, seq, slots_np))
    cu = torch.arange(0, 8 * b + 1, 8, dtype=torch.int32)
    it, rep = args.iters, args.repeats
    r = {"page_table": best_us(lambda: kvpool.page_table(pages, 4), it, rep)}
    with stubbed():
        p = attention.plan_decode(view, hq, pt, sl, max_seq_len=ctx, num_splits=splits)
        layers = pool.layers[:8]

        def write_decode():
            for i in layers:
                pool.write(i, loc, k, v)
                pool.decode(i, q, plan=p)

        r["write_decode"] = best_us(write_decode, max(1, it // 8), rep) / len(layers)
        r["write"] = best_us(lambda: pool.write(0, loc, k, v), it, rep)
        r["decode"] = best_us(lambda: pool.decode(0, q, plan=p), it, rep)
        r["plan_decode"] = best_us(lambda: attention.plan_decode(view, hq, pt, sl, max_seq_len=ctx),
                                   it, rep)  # fmt: skip
        r["plan_extend"] = best_us(lambda: attention.plan_extend(view, hq, cu, pt, sl), it, rep)
        r["splits"] = p.num_splits
    return r


def main() -> None:  # noqa: D103
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 4], help="decode splits")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {f"B={b},splits={s}": bench(b, s, args) for b in args.batch for s in args.splits}
    root = kvpool.__file__.rsplit("/python/", 1)[0]
    print(f"{root} ({args.label}): process-time us per call (min of {args.repeats})")
    keys = [k for k in next(iter(res.values())) if k != "splits"]
    print(f"{'':>18}" + "".join(f"{c:>13}" for c in keys))
    for name, r in res.items():
        print(f"{name:>18}" + "".join(f"{r[c]:>13.1f}" for c in keys))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tree": root, "label": args.label, "unit": "process-time us per call",
                       "results": res}, f, indent=1)  # fmt: skip
            f.write("\n")


if __name__ == "__main__":
    main()
