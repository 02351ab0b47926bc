"""No recompiles across serving steps (issue 22): step-dependent ints are not specialized.

Triton compiles a kernel per specialization of its int arguments (an int equal to 1 becomes a
constant; others carry whether they divide by 16). A serving loop changes the page table's
width, the batch, the token count and the split count from one step to the next; each change
compiled a new kernel (2.2 s of the first run's prefill on the H200, run 14). The kernels list
those arguments in ``do_not_specialize``.

- CPU: the jit functions' ``do_not_specialize`` names hold the step-dependent arguments, and
  the per-model ones (pool strides, ``page_shift``) stay specialized.
- GPU: write / extend / decode / merge / dequantize over steps of other batch sizes, page-table
  widths (15, 16, 17, 33, 1 pages), token counts; each kernel's compile cache does not grow
  after the first step.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kvpool  # noqa: E402
from kvpool import attention  # noqa: E402
from kvpool.config import ModelSpec  # noqa: E402
from kvpool.triton_kernels import decode, dequant, extend, quant_write  # noqa: E402

# (module, kernel name, arguments that must not be specialized, arguments that must be)
KERNELS = [
    (extend, "extend_kernel", {"stride_pt", "window", "blocks_per_req"},
     {"stride_qt", "stride_kr", "stride_vr", "stride_ot", "page_shift"}),
    (decode, "decode_kernel", {"stride_pt", "window", "num_splits"},
     {"stride_qb", "stride_kr", "stride_vr", "stride_ob", "page_shift"}),
    (decode, "merge_kernel", {"num_splits"}, {"stride_ob", "stride_oh", "Hq"}),
    (quant_write, "quant_write_kernel", {"T"}, {"R", "k_st", "kd_row", "v_st", "vd_row"}),
    (dequant, "dequant_kernel", {"N"}, {"R", "data_row_stride"}),
]  # fmt: skip


def _not_specialized(fn) -> set[str]:
    """Names of ``fn``'s arguments in its ``do_not_specialize`` (jit or interpreted function)."""
    params = getattr(fn, "params", None)
    if params is not None:  # JITFunction: one KernelParam per argument
        return {p.name for p in params if p.do_not_specialize}
    names = list(getattr(fn, "arg_names", []))
    dns = (getattr(fn, "kwargs", None) or {}).get("do_not_specialize") or ()
    return {names[a] if isinstance(a, int) else a for a in dns}


def _arg_names(fn) -> list[str]:
    params = getattr(fn, "params", None)
    if params is not None:
        return [p.name for p in params]
    return list(fn.arg_names)


@pytest.mark.parametrize(("mod", "name", "free", "fixed"), KERNELS, ids=[k[1] for k in KERNELS])
def test_step_dependent_ints_are_not_specialized(mod, name, free, fixed):
    fn = getattr(mod, name)
    names = set(_arg_names(fn))
    assert free <= names and fixed <= names, (free | fixed) - names  # (a renamed argument)
    dns = _not_specialized(fn)
    assert free <= dns, f"{name}: {sorted(free - dns)} would compile a kernel per value class"
    assert not fixed & dns, f"{name}: {sorted(fixed & dns)} are fixed per model: keep them"


# ----------------------------------------------------------------------------- GPU

PS = 16
CFG = dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
           num_attention_heads=8, num_key_value_heads=2, head_dim=64,
           vocab_size=100)  # fmt: skip
HQ = 8
# (requests, page-table width in pages, new tokens per request): every int the launches pass
# changes class (1, a multiple of 16, other) from one step to the next
STEPS = [(3, 16, [5, 17, 1]), (1, 15, [1]), (17, 17, [16] * 17), (5, 33, [3, 64, 2, 31, 1]),
         (2, 1, [4, 7]), (16, 16, [1] * 16)]  # fmt: skip


def _compiled(fn) -> int:
    """Compiled variants of ``fn`` on every device (Triton 3.3+: ``device_caches``; older:
    ``cache``); skips when this Triton exposes neither."""
    caches = getattr(fn, "device_caches", None)
    if isinstance(caches, dict):
        return sum(len(c[0]) for c in caches.values())
    cache = getattr(fn, "cache", None)
    if isinstance(cache, dict):
        return sum(len(c) for c in cache.values())
    pytest.skip(f"this Triton exposes no compile cache on {type(fn).__name__}")


def _step(pool, b, width, new, rng, splits):
    """One prefill-like and one decode-like step of ``b`` requests (every kernel launched)."""
    view = pool.layer(0)
    dev = view.k.device
    seq = [min(int(n) + int(rng.integers(0, 20)), width * PS) for n in new]
    new = [min(n, s) for n, s in zip(new, seq, strict=True)]
    pages = [np.arange(1 + i * width, 1 + i * width + -(-s // PS), dtype=np.int32)
             for i, s in enumerate(seq)]  # fmt: skip
    table = kvpool.page_table(pages, width)
    pre = np.asarray(seq, np.int64) - np.asarray(new, np.int64)
    slots = kvpool.extend_slots(table, pre, np.asarray(seq, np.int64), PS)
    cu = np.zeros(b + 1, np.int32)
    cu[1:] = np.cumsum(new)
    t = int(cu[-1])
    pt, sl, cu_t, loc = (torch.from_numpy(np.ascontiguousarray(a)).to(dev)
                         for a in (table, np.asarray(seq, np.int32), cu, slots))  # fmt: skip
    k = torch.randn(t, view.num_kv_heads, view.head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(t, HQ, view.head_dim, device=dev, dtype=torch.bfloat16)
    for layer in pool.layers:
        pool.write(layer, loc, k, v)
        plan = attention.plan_extend(view, HQ, cu_t, pt, sl)
        pool.extend(layer, q, plan=plan)
        pool.extend(layer, q, cu_t, pt, sl)  # (no plan: one program per possible block)
    pool.dequantize(0, loc)
    # decode: one token per request at the end of each sequence
    last = loc[cu_t[1:].long() - 1]
    qd = torch.randn(b, HQ, view.head_dim, device=dev, dtype=torch.bfloat16)
    plan = attention.plan_decode(view, HQ, pt, sl, num_splits=splits, gluon=False)
    for layer in pool.layers:
        pool.write(layer, last, k[:b], v[:b])
        pool.decode(layer, qd, plan=plan)
        pool.decode(layer, qd, pt, sl, plan=plan)  # (unrecorded: Triton's own dispatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("splits", [1, 3])
def test_serving_steps_compile_each_kernel_once(dtype, splits):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec = ModelSpec.from_dict(CFG, name="tiny", dtype="bf16")
    plan = kvpool.size_for(spec, dtype, num_tokens=40 * 33 * PS, page_size=PS)
    pool = kvpool.KVPool(plan, device="cuda")
    pool.set_kv_scales([0.05] * spec.num_layers, [0.04] * spec.num_layers)
    fns = {name: getattr(mod, name) for mod, name, _, _ in KERNELS}
    rng = np.random.default_rng(0)
    _step(pool, *STEPS[0], rng, splits)
    torch.cuda.synchronize()
    first = {name: _compiled(fn) for name, fn in fns.items()}
    assert first["extend_kernel"] >= 1 and first["quant_write_kernel"] >= 1
    for b, width, new in STEPS[1:]:
        _step(pool, b, width, new, rng, splits)
        now = {name: _compiled(fn) for name, fn in fns.items()}
        grew = {n: (first[n], now[n]) for n in fns if now[n] != first[n]}
        assert not grew, f"step (B={b}, {width} pages, T={sum(new)}) compiled again: {grew}"
    torch.cuda.synchronize()
