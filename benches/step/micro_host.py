"""The floor under kvpool's per-call host cost: what one launch and one copy cost on this host.

Microseconds of host time per call (median of 5 timings of N back-to-back calls, no sync inside
a timing) of: an empty Python call; a torch in-place add on a CUDA tensor (torch's own launch);
``torch.empty`` on the device and pinned; a pinned ``non_blocking`` copy (sliced, whole, and
after a fresh pinned allocation); the driver's ``cuMemcpyHtoDAsync`` and ``cuLaunchKernel``
through ctypes; ``torch.cuda.Event`` record and query; the current stream from torch and from
Triton; a no-op Triton kernel of 1 and of 40 arguments through ``kernel[grid](...)`` (JIT
dispatch) and through its compiled launcher (what kvpool's recorded launches call).

Run 15 on the H200 (``benches/e2e/results/run15_h200/launch_micro.json``): a torch add 9.4 us,
the raw driver launch through ctypes 8.6 us, Triton's launcher 7.1 us (40 arguments 8.8), its
JIT dispatch 16.4 (31.9): two launches a layer cost ~15 us before any of kvpool's own work.

    python benches/step/micro_host.py          # writes $OUT/micro.json (default /tmp)
"""

import ctypes
import json
import os
import sys

import torch
import triton
from triton.runtime import driver

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_host import _time  # noqa: E402  (the same timer as the host bench)


def t(f, n=20000, rep=5):
    """Median us per call of ``rep`` timings of ``n`` calls (bench_host's timer)."""
    return round(_time(f, n, rep, torch.cuda.synchronize), 2)


res = {}
x = torch.zeros(16, device="cuda")
res["py_noop"] = t(lambda: None)
res["torch_add_"] = t(lambda: x.add_(1))
res["torch_empty_cuda_64B"] = t(lambda: torch.empty(64, dtype=torch.uint8, device="cuda"))
res["torch_empty_pinned_4KB"] = t(
    lambda: torch.empty(4096, dtype=torch.uint8, pin_memory=True), 5000
)
host = torch.empty(8192, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(8192, dtype=torch.uint8, device="cuda")
res["copy_pinned_nonblocking_4KB"] = t(
    lambda: dst[:4096].copy_(host[:4096], non_blocking=True), 5000
)
res["copy_pinned_nonblocking_4KB_full"] = t(lambda: dst.copy_(host, non_blocking=True), 5000)


def alloc_copy():
    h = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    dst[:4096].copy_(h, non_blocking=True)


res["alloc_pinned_and_copy"] = t(alloc_copy, 5000)
cuda = ctypes.CDLL("libcuda.so.1")
memcpy = cuda.cuMemcpyHtoDAsync_v2
memcpy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
memcpy.restype = ctypes.c_int
s = torch.cuda.current_stream().cuda_stream
dp, hp = dst.data_ptr(), host.data_ptr()
assert memcpy(dp, hp, 4096, s) == 0
res["ctypes_cuMemcpyHtoDAsync_4KB"] = t(lambda: memcpy(dp, hp, 4096, s))
ev = torch.cuda.Event()
res["event_record"] = t(lambda: ev.record())
res["event_query"] = t(lambda: ev.query())
res["current_stream"] = t(lambda: torch.cuda.current_stream().cuda_stream)
gs = driver.active.get_current_stream
res["triton_get_current_stream"] = t(lambda: gs(0))


@triton.jit
def noop1(a):
    pass


@triton.jit
def noop40(
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,
    p8,
    p9,
    i0,
    i1,
    i2,
    i3,
    i4,
    i5,
    i6,
    i7,
    i8,
    i9,
    i10,
    i11,
    i12,
    i13,
    i14,
    i15,
    i16,
    i17,
    i18,
    i19,
    i20,
    i21,
    i22,
    i23,
    i24,
    i25,
    i26,
    i27,
    i28,
    i29,
):
    pass


k1 = noop1.warmup(17, grid=(1,))
res["triton_jit_dispatch_noop1"] = t(lambda: noop1[(1,)](17))
run = k1.run
fn = k1.function
meta = k1.packed_metadata
stream = gs(0)
res["triton_launcher_noop1"] = t(lambda: run(1, 1, 1, stream, fn, meta, None, None, None, 17))
args40 = [dp] * 10 + [17 + i for i in range(30)]
k40 = noop40.warmup(*args40, grid=(1,))
run40, fn40, meta40 = k40.run, k40.function, k40.packed_metadata
res["triton_launcher_noop40"] = t(
    lambda: run40(1, 1, 1, stream, fn40, meta40, None, None, None, *args40)
)
res["triton_jit_dispatch_noop40"] = t(lambda: noop40[(1,)](*args40), 5000)
print(
    "noop1 signature",
    k1.src.signature if hasattr(k1, "src") else None,
    "meta",
    k1.metadata.num_warps,
    k1.metadata.shared,
)
print("launcher type", type(run), getattr(run, "__self__", None))
# raw cuLaunchKernel through ctypes
launch = cuda.cuLaunchKernel
launch.restype = ctypes.c_int
a = ctypes.c_int32(17)
z1 = ctypes.c_uint64(0)
z2 = ctypes.c_uint64(0)
params = (ctypes.c_void_p * 3)(ctypes.addressof(a), ctypes.addressof(z1), ctypes.addressof(z2))
warps = k1.metadata.num_warps
args = (
    ctypes.c_uint64(fn),
    1,
    1,
    1,
    32 * warps,
    1,
    1,
    k1.metadata.shared,
    ctypes.c_void_p(stream),
    params,
    None,
)
launch.argtypes = [
    ctypes.c_uint64,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
]
print(
    "cuLaunchKernel rc",
    launch(fn, 1, 1, 1, 32 * warps, 1, 1, k1.metadata.shared, stream, params, None),
)
torch.cuda.synchronize()
res["ctypes_cuLaunchKernel_noop1"] = t(
    lambda: launch(fn, 1, 1, 1, 32 * warps, 1, 1, k1.metadata.shared, stream, params, None)
)
res["cpu"] = open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0]
print(json.dumps(res, indent=1))
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/micro.json", "w"), indent=1)
