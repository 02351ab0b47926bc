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
measured), ``requests``, ``new_tokens``), rewritten after each record so a cut run keeps what
finished, and ``log.txt``. Every section runs under a wall-clock budget (``--budget-s``, default
420 s in all): a section that would start past it is skipped and recorded as such.

    python benches/e2e/bench_vs_transformers.py --out $OUT/vs_transformers
"""

from __future__ import annotations

import argparse
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


def workload(model: str, n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """``n`` prompts (token lists) and the new tokens per request."""
    g = np.random.default_rng(seed)
    if model == "SmolLM2-135M":
        system = g.integers(3, vocab, 512).tolist()
        out = []
        for k in range(n):
            user = g.integers(3, vocab, int(g.integers(32, 512))).tolist()
            out.append((system if k % 4 else []) + user)
        return out, 96
    return [g.integers(3, vocab, 1024).tolist() for _ in range(n)], 256


def build(model: str, seed: int = 0):
    """(transformers model, kvpool Llama) on CUDA with the same random bf16 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(CONFIGS[model], eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    sd = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
    spec = ModelSpec.from_dict(dict(cfg, torch_dtype="bfloat16"), name=model, dtype="bf16")
    return hf, Llama(dict(cfg), sd, spec, "cuda")


def run_kvpool(llama: Llama, prompts, new: int, dtype: str) -> dict:
    """Tokens/s and decode step time of the example's Engine, all requests running at once."""
    need = sum(len(p) + new for p in prompts) + 64 * 16
    pool = serve.make_pool(llama, dtype, need, 16)
    warm = serve.Engine(llama, pool, max_running=4)
    for p in prompts[:4]:
        warm.submit(p[:64], 4)
    warm.run()
    del warm
    eng = serve.Engine(llama, pool, max_running=len(prompts), max_prefill_tokens=16384)
    for p in prompts:
        eng.submit(p, new)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.run()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s = eng.stats
    assert all(r.status == "finished" for r in eng.requests), "a request did not finish"
    gen = sum(len(r.output) for r in eng.requests)
    decode_steps = max(1, s.steps - 1)
    return {
        "tokens_per_s": gen / wall, "seconds": wall, "generated": gen,
        "step_ms": 1e3 * s.decode_s / decode_steps if s.decode_s else None,
        "host_fraction": None,
    }  # fmt: skip


def run_transformers(hf, prompts, new: int) -> dict:
    """Tokens/s of ``generate_batch`` (paged cache, continuous batching) on the same requests."""
    from transformers import GenerationConfig

    gc = GenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    hf.config._attn_implementation = "sdpa_paged"
    hf.generate_batch(inputs=[p[:64] for p in prompts[:4]], generation_config=gc,
                      progress_bar=False)  # fmt: skip  (warm-up)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=gc, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    gen = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens_per_s": gen / wall, "seconds": wall, "generated": gen,
            "step_ms": 1e3 * wall / new, "host_fraction": None}  # fmt: skip


def main() -> int:  # noqa: D103
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for throughput.json and log.txt")
    ap.add_argument("--models", default="SmolLM2-135M,Llama-3.1-8B-geometry")
    ap.add_argument("--small-requests", type=int, default=192)
    ap.add_argument("--big-requests", type=int, default=64, help="8B geometry (issue: 256)")
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3", help="kvpool cache dtypes")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of all")
    args = ap.parse_args()
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
            hf, llama = build(model)
            prompts, new = workload(model, n, CONFIGS[model]["vocab_size"])
            sections = [("kvpool", d) for d in args.dtypes.split(",")] + [("transformers", "bf16")]
            for system, dtype in sections:
                base = {"system": system, "model": model, "dtype": dtype, "requests": n,
                        "new_tokens": new, "weights": "random bf16 (same for both systems)"}
                if time.perf_counter() - t_start > args.budget_s:
                    records.append(dict(base, skipped="over --budget-s"))
                    say(f"{system} {model} {dtype}: skipped (budget)")
                    save()
                    continue
                try:
                    if system == "kvpool":
                        r = run_kvpool(llama, prompts, new, dtype)
                    else:
                        r = run_transformers(hf, prompts, new)
                    records.append(dict(base, **r))
                    say(f"{system} {model} {dtype}: {r['tokens_per_s']:.0f} tokens/s, "
                        f"step {r['step_ms']} ms, {r['seconds']:.1f} s")  # fmt: skip
                except Exception as e:  # a failing system is recorded, the others still run
                    records.append(dict(base, error=f"{type(e).__name__}: {e}"))
                    say(traceback.format_exc())
                save()
                torch.cuda.empty_cache()
        except Exception as e:
            records.append({"model": model, "error": f"{type(e).__name__}: {e}"})
            say(traceback.format_exc())
            save()
        del hf, llama
        torch.cuda.empty_cache()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
