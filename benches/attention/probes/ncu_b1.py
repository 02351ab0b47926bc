"""One decode call at a small batch for ncu (run 10): ``python ncu_b1.py DTYPE B CTX [SPLITS]``."""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import bench_attention as ba  # noqa: E402
from kvpool import attention  # noqa: E402

dtype, b, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kw = {"num_splits": int(sys.argv[4])} if len(sys.argv) > 4 else {}
view = ba.make_pool(dtype, b * ctx + 64)
pt = ba.page_table(b, ctx, 16, view.k.shape[0], torch.Generator().manual_seed(1))
sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
q = torch.randn(b, ba.HQ, ba.D, dtype=torch.bfloat16, device="cuda")
plan = attention.plan_decode(view, ba.HQ, pt, sl, max_seq_len=ctx, **kw)
for _ in range(3):
    attention.decode(view, q, plan=plan)
torch.cuda.synchronize()
print(dtype, b, ctx, plan.num_splits, plan.block_n, plan.gluon)
