"""Run 7, call 10: the Gluon decode with a cp.async ring (STAGES) vs register prefetch, same run.

Ran with the kernel of that call copied next to it as ``gk.py`` (now
``triton_kernels/decode_gluon.py``, whose ``decode_kernel`` has the same arguments).
"""
import sys, os, json, itertools, traceback
sys.path.insert(0, os.path.join(os.getcwd(), "benches/attention")); sys.path.insert(0, os.path.dirname(__file__))
import torch
import bench_attention as ba
from kvpool import attention
from kvpool.triton_kernels.decode import merge_kernel
import gk
OUT = os.environ["OUT"]
res = []
def rec(**r):
    res.append(r); print(json.dumps(r), flush=True)
    json.dump(res, open(f"{OUT}/exp6.json", "w"), indent=1)

def run(view, q, pt, sl, out, splits, po, pl, stages):
    b, hq, d = q.shape
    gk.decode_kernel[(b, view.num_kv_heads, splits)](
        q, view.k, view.v, view.k_scale, view.v_scale, pt, sl, out, out, po, pl,
        q.stride(0), q.stride(1), view.k.stride(0), view.v.stride(0), pt.stride(0), out.stride(0), out.stride(1),
        d ** -0.5, 1.0, 0, view.page_size.bit_length() - 1, splits,
        G=hq // view.num_kv_heads, FINAL=splits == 1, PREFETCH=True, E5M2=False, HAS_SOFTCAP=False,
        HAS_WINDOW=False, HAS_SINKS=False, STAGES=stages, num_warps=1)
    if splits > 1:
        merge_kernel[(b, hq)](po, pl, out, view.v_scale, out, out.stride(0), out.stride(1), hq, splits, DV=d,
                              SP=max(16, 1 << (splits - 1).bit_length()), HAS_SCALE=True, FP4_MUL=1.0, HAS_SINKS=False, num_warps=4)
    return out

view = ba.make_pool("fp8_e4m3", 128 * 8192 + 4096)
def setup(b, ctx, page, lens=None):
    gen = torch.Generator().manual_seed(b * 7 + ctx + page)
    pv = ba.with_page(view, page)
    pt = ba.page_table(b, ctx, page, pv.k.shape[0], gen)
    sl = (torch.full((b,), ctx, dtype=torch.int32) if lens is None else torch.tensor(lens, dtype=torch.int32)).cuda()
    q = torch.randn(b, 32, 128, dtype=torch.bfloat16, device="cuda")
    return pv, pt, sl, q
for page, splits, st in itertools.product((1, 16, 64), (1, 3, 7), (3, 4)):
    try:
        lens = [1, 5, 16, 17, 100, 1000, 4093, 64]
        pv, pt, sl, q = setup(len(lens), 4096, page, lens)
        ref_t = attention.decode(pv, q, pt, sl, backend="torch")
        po = torch.empty(len(lens), 32, splits, 128, device="cuda"); pl = torch.empty(len(lens), 32, splits, device="cuda")
        o = run(pv, q, pt, sl, torch.empty_like(ref_t), splits, po, pl, st)
        torch.cuda.synchronize()
        rec(tag="check", page=page, splits=splits, stages=st, maxdiff=float((o.float() - ref_t.float()).abs().max()))
    except Exception:
        rec(tag="check_fail", page=page, splits=splits, stages=st, err=traceback.format_exc()[-1500:])
rec(tag="sdpa", us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)
for b, ctx, cands in ((64, 8192, (3, 4, 6, 8)), (128, 8192, (2, 3, 4)), (32, 8192, (6, 8, 12)), (16, 8192, (12, 16, 24))):
    pv, pt, sl, q = setup(b, ctx, 16)
    out = torch.empty(b, 32, 128, dtype=torch.bfloat16, device="cuda")
    for st, s in itertools.product((0, 3, 4), cands):
        try:
            po = torch.empty(b, 32, s, 128, device="cuda"); pl = torch.empty(b, 32, s, device="cuda")
            ms, _ = ba.time_ms(lambda: run(pv, q, pt, sl, out, s, po, pl, st), 25)
            rec(tag="time", b=b, ctx=ctx, stages=st, splits=s, us=ms * 1e3)
        except Exception:
            rec(tag="time_fail", b=b, stages=st, splits=s, err=traceback.format_exc()[-800:])
rec(tag="sdpa_end", us=ba.bench_sdpa(64, 8192, 25)["ms"] * 1e3)
