"""kvpool's serving loop (examples/serve.py ``Engine``) against transformers' continuous batching.

Same GPU, same random bf16 weights (one ``LlamaForCausalLM`` built from a config, its state dict
loaded into :class:`kvpool.llama.Llama`), same request list, greedy, a fixed number of new
tokens (no stop token). Models (issue 22):

- ``SmolLM2-135M``: its geometry (576 hidden, 30 layers, 9 q / 3 KV heads), 192 requests of
  32..511 prompt tokens (three in four share a 512-token system prompt), 96 new tokens;
- ``Llama-3.1-8B-geometry``: 4,096 hidden, 32 layers, 32 q / 8 KV heads, ``--big-requests``
  requests (default 64; the issue's run is 256) of 1,024 prompt + 256 new tokens.

Writes ``throughput.json`` under ``--out`` (one record per system, model, dtype: ``system``,
``model``, ``dtype``, ``tokens_per_s``, ``step_ms``, ``host_fraction`` (None where not
measured), ``requests``, ``new_tokens``; kvpool's also ``cuda_graph``: serve.py's GraphEngine
(``--cuda-graph``) or its eager Engine), rewritten after each record so a cut run keeps what
finished, and ``log.txt``. Every section runs under a wall-clock budget (``--budget-s``, default
420 s in all): a section that would start past it is skipped and recorded as such.

    python benches/e2e/bench_vs_transformers.py --out $OUT/vs_transformers
    python benches/e2e/bench_vs_transformers.py --tiny --device cpu --out /tmp/vs  # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "python"))

import serve  # noqa: E402  (examples/serve.py: the Engine)
from kvpool.config import ModelSpec  # noqa: E402
from kvpool.llama import Llama  # noqa: E402

CONFIGS = {
    "SmolLM2-135M": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    "Llama-3.1-8B-geometry": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
    ),
}  # fmt: skip


# --tiny (a CPU check of this script, seconds): both geometries shrunk, few short requests
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256)  # fmt: skip


def workload(model: str, n: int, vocab: int, seed: int = 0, tiny: bool = False):
    """``n`` prompts (token lists) and the new tokens per request."""
    g = np.random.default_rng(seed)
    if tiny:
        return [g.integers(3, vocab, int(g.integers(4, 40))).tolist() for _ in range(n)], 8
    if model == "SmolLM2-135M":
        system = g.integers(3, vocab, 512).tolist()
        out = []
        for k in range(n):
            user = g.integers(3, vocab, int(g.integers(32, 512))).tolist()
            out.append((system if k % 4 else []) + user)
        return out, 96
    return [g.integers(3, vocab, 1024).tolist() for _ in range(n)], 256


def build(model: str, device: str, seed: int = 0, tiny: bool = False):
    """(transformers model, kvpool Llama) on ``device`` with the same random bf16 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(CONFIGS[model], **(TINY if tiny else {}))
    cfg.update(eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # (initialised in bf16: no fp32 copy of an 8B model)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(old)
    sd = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
    spec = ModelSpec.from_dict(dict(cfg, torch_dtype="bfloat16"), name=model, dtype="bf16")
    return hf, Llama(dict(cfg), sd, spec, device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_kvpool(llama: Llama, prompts, new: int, dtype: str, graph: bool) -> dict:
    """Tokens/s, decode step time and its host fraction of the example's engine (``graph``:
    serve.py --cuda-graph's GraphEngine, else the eager Engine), all requests at once.

    ``host_fraction`` (graphs): 1 - (GPU time of the decode forwards, CUDA events around each
    replay) / (decode wall time), the share of a decode step the GPU waits for the host (None
    on CPU); eager runs get theirs from the graph run's GPU time (:func:`eager_host_fraction`).
    """
    dev = str(llama.device)
    need = sum(len(p) + new for p in prompts) + 64 * 16
    pool = serve.make_pool(llama, dtype, need, 16)
    longest = max(len(p) for p in prompts) + new

    def engine(n):
        if graph:
            return serve.GraphEngine(llama, pool, max_running=n, max_prefill_tokens=16384,
                                     max_seq_len=longest, use_graphs=dev.startswith("cuda"))
        return serve.Engine(llama, pool, max_running=n, max_prefill_tokens=16384)

    warm = engine(4)  # compile this dtype's kernels first
    for p in prompts[:4]:
        warm.submit(p[:64], 4)
    warm.run()
    del warm
    eng = engine(len(prompts))  # (GraphEngine captures its buckets here, before the clock)
    for p in prompts:
        eng.submit(p, new)
    _sync(dev)
    t0 = time.perf_counter()
    eng.run()
    _sync(dev)
    wall = time.perf_counter() - t0
    s = eng.stats
    if dev.startswith("cuda"):
        serve.gpu_timer.flush(s)
    bad = [r.status for r in eng.requests if r.status != "finished"]
    assert not bad, f"requests did not finish: {bad[:3]}"
    gen = sum(len(r.output) for r in eng.requests)
    steps = max(1, s.decode_steps)
    gpu = s.decode_gpu_s if dev.startswith("cuda") and s.decode_gpu_s else None
    return {
        "tokens_per_s": gen / wall, "seconds": wall, "generated": gen,
        "step_ms": 1e3 * s.decode_s / steps if s.decode_s else None,
        "host_fraction": None if gpu is None or not graph else max(0.0, 1 - gpu / s.decode_s),
        "decode_steps": s.decode_steps, "decode_s": s.decode_s, "decode_gpu_s": gpu,
        "cuda_graph": graph,
    }  # fmt: skip


def eager_host_fraction(records: list[dict], r: dict) -> None:
    """An eager run's host fraction: 1 - (GPU time of the same steps replayed from CUDA graphs,
    the graph run of this model and dtype) / (its decode wall time). Eager CUDA events would
    count the GPU's waits for the launches as GPU time."""
    for g in records:
        if (g.get("system"), g.get("model"), g.get("dtype"), g.get("cuda_graph")) == (
            "kvpool", r["model"], r["dtype"], True
        ) and g.get("decode_gpu_s") and r.get("decode_s"):
            r["host_fraction"] = max(0.0, 1 - g["decode_gpu_s"] / r["decode_s"])
            r["host_fraction_basis"] = "GPU time of the graph run's decode steps"


def run_transformers(hf, prompts, new: int) -> dict:
    """Tokens/s of ``generate_batch`` (paged cache, continuous batching) on the same requests.

    ``step_ms``: wall time / new tokens per request (its steps are not counted one by one).
    """
    from transformers import GenerationConfig

    dev = str(hf.device)
    gc = GenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    kw = {}
    if not dev.startswith("cuda"):  # (its cache sizing reads GPU memory: sized by hand here)
        from transformers import ContinuousBatchingConfig

        kw["continuous_batching_config"] = ContinuousBatchingConfig(
            block_size=32, num_blocks=64, max_batch_tokens=512
        )
    hf.generate_batch(inputs=[p[:64] for p in prompts[:4]], generation_config=gc,
                      progress_bar=False, **kw)  # fmt: skip  (warm-up)
    _sync(dev)
    t0 = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=gc, progress_bar=False, **kw)
    _sync(dev)
    wall = time.perf_counter() - t0
    gen = sum(len(o.generated_tokens) for o in out.values())
    errors = [o.error for o in out.values() if o.error is not None]
    return {"tokens_per_s": gen / wall, "seconds": wall, "generated": gen,
            "step_ms": 1e3 * wall / new, "host_fraction": None,
            "attn_implementation": hf.config._attn_implementation,
            **({"errors": errors[:3]} if errors else {})}  # fmt: skip


def main() -> int:  # noqa: D103
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for throughput.json and log.txt")
    ap.add_argument("--models", default="SmolLM2-135M,Llama-3.1-8B-geometry")
    ap.add_argument("--small-requests", type=int, default=192)
    ap.add_argument("--big-requests", type=int, default=64, help="8B geometry (issue: 256)")
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3", help="kvpool cache dtypes")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of all")
    ap.add_argument("--graph", default="on,off",
                    help="kvpool engines: on (serve.py --cuda-graph), off (eager), or both")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true",
                    help="both models shrunk to 2 layers, 6 short requests: a CPU check")
    args = ap.parse_args()
    if args.tiny:
        args.small_requests = args.big_requests = 6
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a")
    t_start = time.perf_counter()
    records: list[dict] = []

    def say(msg):
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    def save():
        (out / "throughput.json").write_text(json.dumps(records, indent=1) + "\n")

    for model in args.models.split(","):
        n = args.small_requests if model == "SmolLM2-135M" else args.big_requests
        hf = llama = None
        try:
            hf, llama = build(model, args.device, tiny=args.tiny)
            vocab = (TINY if args.tiny else CONFIGS[model])["vocab_size"]
            prompts, new = workload(model, n, vocab, tiny=args.tiny)
            graphs = [g == "on" for g in args.graph.split(",")]
            sections = [("kvpool", d, g) for d in args.dtypes.split(",") for g in graphs]
            # the peer second, so that a budget cut leaves the main comparison
            sections.insert(1, ("transformers", "bf16", None))
            for system, dtype, graph in sections:
                base = {"system": system, "model": model, "dtype": dtype, "requests": n,
                        "new_tokens": new, "weights": "random bf16 (same for both systems)",
                        "device": args.device + (" (--tiny geometry)" if args.tiny else "")}
                if graph is not None:
                    base["cuda_graph"] = graph
                if time.perf_counter() - t_start > args.budget_s:
                    records.append(dict(base, skipped="over --budget-s"))
                    say(f"{system} {model} {dtype}: skipped (budget)")
                    save()
                    continue
                try:
                    if system == "kvpool":
                        r = run_kvpool(llama, prompts, new, dtype, graph)
                    else:
                        r = run_transformers(hf, prompts, new)
                    r = dict(base, **r)
                    if system == "kvpool" and not graph:
                        eager_host_fraction(records, r)
                    records.append(r)
                    hfr = r["host_fraction"]
                    hfr = "-" if hfr is None else f"{hfr:.2f}"
                    say(f"{system} {model} {dtype}" + ("" if graph is None else
                        f" cuda_graph={graph}") + f": {r['tokens_per_s']:.0f} tokens/s, step "
                        f"{r['step_ms'] or 0:.2f} ms, host fraction {hfr}, "
                        f"{r['seconds']:.1f} s")  # fmt: skip
                except Exception as e:  # a failing system is recorded, the others still run
                    records.append(dict(base, error=f"{type(e).__name__}: {e}"))
                    say(traceback.format_exc())
                save()
                gc.collect()  # (transformers' paged cache takes most free memory while it lives)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
        except Exception as e:
            records.append({"model": model, "error": f"{type(e).__name__}: {e}"})
            say(traceback.format_exc())
            save()
        del hf, llama
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
