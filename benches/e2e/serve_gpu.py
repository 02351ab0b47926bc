"""The serving loop of examples/serve.py on a GPU, with kvpool's Triton kernels: tokens/s per KV
dtype, and the Triton attention checked against the torch reference inside the whole model.

SmolLM2-135M geometry (30 layers, 9 query / 3 KV heads, head_dim 64, vocab 49,152) in bf16, with
seeded random weights: the real weights (98 MB as Q4_1, 270 MB as bf16) do not fit the 64 MiB
that reaches the GPU machine, and throughput does not depend on weight values. Fidelity on the
real weights is measured on CPU (examples/serve.py --report).

    python benches/e2e/serve_gpu.py --out DIR [--dtypes bf16,fp8_e4m3,nvfp4] [--requests 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import kvpool  # noqa: E402
import serve  # noqa: E402
from kvpool.config import ModelSpec  # noqa: E402
from kvpool.llama import Llama, Step  # noqa: E402

# kvpool.gguf.config_from_gguf of SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2 = {
    "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
    "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "vocab_size": 49152, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def random_llama(config, dtype: str, device: str, seed: int = 0) -> Llama:
    g = torch.Generator().manual_seed(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    hq, hkv, v = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    d = h // hq

    def r(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": r(v, h, std=0.5), "model.norm.weight": torch.ones(h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = r(hq * d, h, std=0.1)
        w[p + "self_attn.k_proj.weight"] = r(hkv * d, h, std=0.1)
        w[p + "self_attn.v_proj.weight"] = r(hkv * d, h)
        w[p + "self_attn.o_proj.weight"] = r(h, hq * d)
        w[p + "mlp.gate_proj.weight"] = r(i, h)
        w[p + "mlp.up_proj.weight"] = r(i, h)
        w[p + "mlp.down_proj.weight"] = r(h, i)
    spec = ModelSpec.from_dict(config, name="SmolLM2-135M geometry (random weights)", dtype=dtype)
    return Llama(config, w, spec, device)


def workload(n: int, seed: int, shared: int, vocab: int, max_new: int):
    g = np.random.default_rng(seed)
    system = g.integers(3, vocab, shared).tolist()
    out = []
    for k in range(n):
        user = g.integers(3, vocab, int(g.integers(32, 512))).tolist()
        head = system if k % 4 else []  # three in four share the system prompt
        out.append((head + user, max_new, k // 16))  # 16 arrive per step
    return out


def kernel_check(model: Llama, dtype: str, scales) -> dict:
    """Prefill 4 requests (one reusing another's prefix mid-page) + 8 decode steps, Triton vs
    torch attention on identical inputs; compare every logit row."""
    g = np.random.default_rng(7)
    lens = [37, 300, 129, 1000]
    prompts = [g.integers(3, 49152, n).tolist() for n in lens]
    res, forced = {}, []
    first = "triton" if model.device.type == "cuda" else "torch_"  # CPU: a smoke run only
    for backend in (first, "torch"):
        model.attn_backend = backend.rstrip("_")
        pool = serve.make_pool(model, dtype, 4 * 80 * 16, 16, scales)
        pages = [np.arange(1 + 80 * b, 1 + 80 * (b + 1), dtype=np.int32) for b in range(4)]
        ids = torch.tensor([t for p in prompts for t in p])
        step = Step.build(pages, [0] * 4, lens, 16, device=model.device)
        rows = [model.forward(pool, ids, step, all_logits=True)]
        toks = rows[0][step.last_index].argmax(-1)
        seq = list(lens)
        for k in range(8):
            if backend == first:
                forced.append(toks)
            toks = forced[k]  # both runs feed the same tokens
            step = Step.build(pages, seq, [1] * 4, 16, device=model.device)
            out = model.forward(pool, toks, step)
            rows.append(out)
            toks = out.argmax(-1)
            seq = [s + 1 for s in seq]
        res[backend] = torch.cat(rows).float()
    model.attn_backend = "auto"
    a, b = res[first], res["torch"]
    lp_a, lp_b = a.log_softmax(-1), b.log_softmax(-1)
    return {
        "rows": a.shape[0],
        "max_abs_logit_diff": float((a - b).abs().max()),
        "logit_scale": float(b.abs().max()),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "kl_torch_vs_triton": float((lp_b.exp() * (lp_b - lp_a)).sum(-1).mean()),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3,nvfp4,fp4_mx_block16")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--shared", type=int, default=512)
    ap.add_argument("--pool-tokens", type=int, default=131072)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    cuda = dev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = random_llama(SMOLLM2, "bf16", dev)
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "model": model.spec.name, "compute_dtype": "bf16", "results": []}  # fmt: skip
    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        scales = None
        if dtype in ("fp8_e4m3", "fp8_e5m2", "nvfp4"):
            ids = torch.tensor(workload(1, 3, 0, 49152, 1)[0][0])
            _, past = model.forward_reference(ids)
            from kvpool.fidelity import calibrate_scales

            scales = calibrate_scales(past, dtype)
        check = kernel_check(model, dtype, scales)
        pool = serve.make_pool(model, dtype, args.pool_tokens, 16, scales)
        # warm-up: compile the kernels of this dtype (prefill shapes + decode)
        warm = serve.Engine(model, pool, max_running=4)
        for p, n, _ in workload(4, 1, 64, 49152, 4):
            warm.submit(p, n)
        warm.run()
        del warm
        eng = serve.Engine(model, pool, max_running=args.max_running)
        for p, n, a in workload(args.requests, 2, args.shared, 49152, args.max_new):
            eng.submit(p, n, arrival=a)
        sync()
        eng.run()
        sync()
        s = eng.stats
        # capacity on this device (measured memory; weights as the model's bf16 bytes)
        mem = {} if cuda else {"gpu": "H200"}
        plan = kvpool.size_for(model.spec, dtype, 0.9, page_size=16, **mem)
        row = {
            "dtype": dtype,
            "tokens_per_s": s.tokens_per_s,
            "decode_tokens_per_s": s.decode_tokens / s.decode_s if s.decode_s else 0.0,
            "prefill_tokens_per_s": s.prefill_tokens / s.prefill_s if s.prefill_s else 0.0,
            "generated": s.generated, "steps": s.steps, "seconds": s.seconds,
            "hit_rate": s.hit_rate, "evicted_pages": s.evicted_pages, "retracted": s.retracted,
            "capacity_tokens_h200_0.9": plan.num_tokens,
            "requests_4096_h200_0.9": plan.requests_fit(4096),
            "triton_vs_torch": check,
            "wall_s_incl_compile": time.perf_counter() - t0,
        }  # fmt: skip
        info["results"].append(row)
        print(json.dumps(row), flush=True)
        (out / "serve_gpu.json").write_text(json.dumps(info, indent=1))
        del pool, eng
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
