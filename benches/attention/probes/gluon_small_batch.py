"""Run 8, call 11: Gluon vs Triton decode kernels at small batches (where ``plan_decode`` keeps
the Triton kernel: B x H_kv <= 16 programs per split, or contexts under 2,048 tokens).

For fp8_e4m3, fp8_e5m2 and nvfp4, B in {1, 2, 4} x context in {1k, 2k, 8k, 32k}, page 16:
``gluon=True`` and ``gluon=False`` with the planner's split counts, and SDPA on contiguous bf16,
in one process (bench_attention's harness: CUDA graph, L2 flushed, median of 25).

    OUT=dir python benches/attention/probes/gluon_small_batch.py
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "benches/attention"))
import bench_attention as ba  # noqa: E402
import torch  # noqa: E402

OUT = os.environ.get("OUT", ".")


def main():
    ba.OUT = OUT
    res = []
    shapes = [(b, ctx) for b in (1, 2, 4) for ctx in (1024, 2048, 8192, 32768)]
    dtypes = ("fp8_e4m3", "fp8_e5m2", "nvfp4")
    name = "gluon_small_batch.json"
    if os.environ.get("MX"):  # call 14: fp4_mx_block16's Gluon kernel, B=64/8k and small
        shapes, dtypes, name = (
            [(64, 8192), (16, 8192), (1, 32768), (1, 1024)],
            ("fp4_mx_block16",),
            "gluon_mx.json",
        )
    sdpa = {s: ba.bench_sdpa(*s, 25)["ms"] for s in shapes}
    for dtype in dtypes:
        pool = ba.make_pool(dtype, 64 * 8192 + 4096)
        for b, ctx in shapes:
            for gluon in (False, True):
                r = ba.bench_decode(pool, b, ctx, 16, 25, gluon=gluon)
                r = {k: v for k, v in r.items() if isinstance(v, (int, float, str, bool))}
                r.update(sdpa_ms=sdpa[(b, ctx)], x_sdpa=sdpa[(b, ctx)] / r["ms"])
                res.append(r)
                print(json.dumps(r), flush=True)
                with open(os.path.join(OUT, name), "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "results": res}, f, indent=1)
        del pool


if __name__ == "__main__":
    main()
