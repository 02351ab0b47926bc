"""Where a serving run's time goes: prefill vs decode wall time, and the GPU kernels of each.

Runs ``bench_vs_transformers``'s kvpool workload (serve.py's ``GraphEngine``) twice in one
process (the second run shows what the first spent compiling: nothing since the engines warm up
in their constructor, ``init_s``; ``--no-warmup`` shows the cold first run), then a third time
under ``torch.profiler`` and prints the kernels by GPU time, split into prefill and decode steps.

    python benches/e2e/profile_serve.py --model SmolLM2-135M --out $OUT/profile_smol.json
    python benches/e2e/profile_serve.py --tiny --device cpu --out /tmp/p.json   # CPU check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_transformers as bvt  # noqa: E402
import serve  # noqa: E402  (examples/serve.py, put on sys.path by bench_vs_transformers)


def one_run(llama, pool, prompts, new, dev, max_prefill, warmup=None):
    longest = max(len(p) for p in prompts) + new
    t_init = time.perf_counter()
    # (the constructor captures the decode graphs and, on CUDA, warms up the prefill)
    eng = serve.GraphEngine(llama, pool, max_running=len(prompts), max_prefill_tokens=max_prefill,
                            max_seq_len=longest, use_graphs=dev.startswith("cuda"),
                            warmup=warmup)  # fmt: skip
    init_s = time.perf_counter() - t_init
    for p in prompts:
        eng.submit(p, new)
    bvt._sync(dev)
    t0 = time.perf_counter()
    eng.run()
    bvt._sync(dev)
    wall = time.perf_counter() - t0
    s = eng.stats
    gen = sum(len(r.output) for r in eng.requests)
    return eng, {"wall_s": wall, "tokens_per_s": gen / wall, "prefill_s": s.prefill_s,
                 "decode_s": s.decode_s, "decode_steps": s.decode_steps, "steps": s.steps,
                 "prefill_tokens": s.prefill_tokens, "init_s": init_s}  # fmt: skip


def main() -> int:  # noqa: D103
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--requests", type=int, default=0, help="default: the bench's (192 / 64)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="engines without their warm-up (run1 then shows the compiles)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = args.requests or (192 if args.model == "SmolLM2-135M" else 64)
    if args.tiny:
        n = 6
    hf, llama = bvt.build(args.model, args.device, tiny=args.tiny)
    del hf
    vocab = (bvt.TINY if args.tiny else bvt.CONFIGS[args.model])["vocab_size"]
    prompts, new = bvt.workload(args.model, n, vocab, tiny=args.tiny)
    need = sum(len(p) + new for p in prompts) + 64 * 16
    pool = serve.make_pool(llama, args.dtype, need, 16)
    rec: dict = {"model": args.model, "dtype": args.dtype, "requests": n, "new_tokens": new}
    for k in ("run1", "run2"):
        eng, rec[k] = one_run(llama, pool, prompts, new, args.device, args.max_prefill_tokens,
                              False if args.no_warmup else None)  # fmt: skip
        del eng
        print(k, json.dumps(rec[k]), flush=True)
    if args.device.startswith("cuda"):
        from torch.profiler import ProfilerActivity, profile, record_function

        # label each step's phase: wrap the engine's prefill and decode
        orig_p, orig_d = serve.GraphEngine._prefill, serve.GraphEngine._decode_rows

        def pre(self, reqs):
            with record_function("phase:prefill"):
                return orig_p(self, reqs)

        def dec(self):
            with record_function("phase:decode"):
                return orig_d(self)

        serve.GraphEngine._prefill, serve.GraphEngine._decode_rows = pre, dec
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eng, rec["run3_profiled"] = one_run(llama, pool, prompts, new, args.device,
                                                args.max_prefill_tokens)  # fmt: skip
        serve.GraphEngine._prefill, serve.GraphEngine._decode_rows = orig_p, orig_d
        events = prof.events()
        phases = [(e.name, e.time_range.start, e.time_range.end) for e in events
                  if e.name.startswith("phase:")]  # fmt: skip
        kernels = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
        cpu_ops = defaultdict(lambda: [0, 0.0])
        for e in events:
            dt = getattr(e, "device_type", None)
            if dt is not None and str(dt).endswith("CUDA"):
                # a kernel's phase: the CPU phase range that holds its launch (correlation)
                t = e.time_range.start
                ph = "other"
                for name, a, b in phases:
                    if a <= t <= b + 50_000:  # (kernels run up to ms after the launch)
                        ph = name
                        break
                k = kernels[ph][e.name[:90]]
                k[0] += 1
                k[1] += e.time_range.elapsed_us()
            elif e.name.startswith(("aten::", "kvpool", "triton")):
                c = cpu_ops[e.name[:60]]
                c[0] += 1
                c[1] += e.cpu_time_total if hasattr(e, "cpu_time_total") else 0
        rec["kernels"] = {}
        for ph, ks in kernels.items():
            tot = sum(v[1] for v in ks.values())
            top = sorted(ks.items(), key=lambda kv: -kv[1][1])[: args.top]
            rec["kernels"][ph] = {
                "total_us": tot,
                "launches": sum(v[0] for v in ks.values()),
                "top": [{"name": n_, "count": c, "us": u} for n_, (c, u) in top],
            }
            print(f"== {ph}: {tot / 1e3:.1f} ms GPU, {sum(v[0] for v in ks.values())} kernels")
            for n_, (c, u) in top:
                print(f"  {u / 1e3:9.2f} ms {c:7d}x  {n_}")
        print(json.dumps(rec["run3_profiled"]))
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
