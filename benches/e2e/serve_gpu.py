"""The serving loop of examples/serve.py on a GPU with kvpool's Triton kernels, on SmolLM2-135M's
real weights: Triton attention checked against the torch reference path inside the real model,
fidelity of every KV dtype through the Triton kernels, and tokens/s of the continuous-batching loop.

    python benches/e2e/serve_gpu.py --model SmolLM2-135M-Instruct.Q4_1.gguf --out DIR
    python benches/e2e/serve_gpu.py --out DIR        # no model: seeded random weights (speed only)

Sections of ``DIR/serve_gpu.json`` (written after each one, so a cut run keeps what finished):

- ``layers``: every layer's attention output, Triton vs the torch reference path, on identical
  inputs (the real model's q/k/v; the run continues on the reference output), for an extend
  (teacher forcing of the fixed text) and a decode step (4 requests of 37..1,000 tokens), per KV
  dtype. A layer off by more than a dtype's float noise is saved as a reproducer
  (``repro_<dtype>_<kind>.pt``: q, k, v, scales, lengths, both outputs).
- ``fidelity``: teacher forcing of the fixed text (examples/fidelity_text.txt, 1,140 tokens) with
  the fp32 model (the dequantized GGUF) per KV dtype, once through the Triton kernels and once
  through the torch reference attention, each against the fp32 reference cache; and Triton vs
  torch directly (top-1 agreement, KL).
- ``bf16_model``: the model in bf16 with a bf16 cache, Triton vs torch: teacher forcing and
  prefill + 8 decode steps of 4 requests (both runs fed the same tokens).
- ``serving``: bf16 model, the continuous-batching loop (examples/serve.py's ``Engine``) per KV
  dtype on a synthetic workload (192 requests, shared 512-token system prompt): tokens/s, hit rate,
  capacity; then examples/serve.py's own ``--report`` (chat workload: hit rate, greedy agreement)
  on the fp32 model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import kvpool  # noqa: E402
import serve  # noqa: E402
from kvpool import attention, fidelity  # noqa: E402
from kvpool.config import ModelSpec  # noqa: E402
from kvpool.llama import Llama, Step  # noqa: E402

# kvpool.gguf.config_from_gguf of SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2 = {
    "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
    "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "vocab_size": 49152, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
ALL = ["auto", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16"]
# Largest Triton-vs-torch difference of one layer's attention output, relative to the output's
# amax, that float noise explains: the kernels dot bf16/fp16 operands (fp8/fp4 values in fp16,
# mx in bf16, p in the compute dtype) and the reference dots in fp32.
NOISE = {"fp32": 1e-4, "bf16": 2e-2, "fp4_mx_block16": 2e-2}
NOISE_DEFAULT = 5e-3


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


def workload(n: int, seed: int, shared: int, vocab: int, max_new: int, lo=32, hi=512):
    g = np.random.default_rng(seed)
    system = g.integers(3, vocab, shared).tolist()
    out = []
    for k in range(n):
        user = g.integers(3, vocab, int(g.integers(lo, hi))).tolist()
        head = system if k % 4 else []  # three in four share the system prompt
        out.append((head + user, max_new, k // 16))  # 16 arrive per step
    return out


def cross(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Triton logits ``a`` vs torch logits ``b`` (same rows): top-1 agreement, KL(b || a)."""
    a, b = a.double(), b.double()
    lp_a, lp_b = a.log_softmax(-1), b.log_softmax(-1)
    return {
        "rows": a.shape[0],
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
        "kl_torch_vs_triton": float((lp_b.exp() * (lp_b - lp_a)).sum(-1).clamp_min(0).mean()),
        "max_abs_logit_diff": float((a - b).abs().max()),
        "logit_scale": float(b.abs().max()),
    }


def resolve(model: Llama, dtype: str) -> str:
    return model.spec.dtype if dtype == "auto" else dtype


# ----------------------------------------------------------------------------- per layer
@torch.inference_mode()
def dual_forward(model: Llama, pool, ids: torch.Tensor, step: Step, tag: str, out: Path,
                 saved: list) -> list[float]:  # fmt: skip
    """One forward step, attention through both paths per layer on identical inputs; the run
    continues on the reference output. Returns each layer's max |triton - torch| / amax(torch);
    a layer above the noise bound is saved as a reproducer (once per tag)."""
    h = model.w["model.embed_tokens.weight"][ids.to(model.device)]
    view0 = pool.layer(pool.layers[0])
    kw = {"sm_scale": model.scale}
    if step.is_decode:
        plan = attention.plan_decode(view0, model.hq, step.page_table, step.seq_lens)
        ref_kw = {"page_table": step.page_table, "seq_lens": step.seq_lens}
        fn = pool.decode
    else:
        plan = attention.plan_extend(
            view0, model.hq, step.cu_seqlens_q, step.page_table, step.seq_lens
        )
        ref_kw = {"cu_seqlens_q": step.cu_seqlens_q, "page_table": step.page_table,
                  "seq_lens": step.seq_lens}  # fmt: skip
        fn = pool.extend
    errs = []
    bound = NOISE.get(pool.plan.dtype, NOISE_DEFAULT)
    for i in range(model.num_layers):
        q, k, v = model.qkv(i, h, step.positions)
        pool.write(i, step.out_loc, k, v)
        o_t = fn(i, q, plan=plan, backend="triton", **kw)
        o_r = fn(i, q, backend="torch", **ref_kw, **kw)
        err = float((o_t.float() - o_r.float()).abs().max() / o_r.float().abs().max())
        errs.append(err)
        if err > bound and tag not in saved:
            saved.append(tag)
            view = pool.layer(i)
            torch.save({
                "layer": i, "dtype": pool.plan.dtype, "page_size": pool.page_size,
                "q": q.cpu(), "k": k.cpu(), "v": v.cpu(),
                "k_scale": None if view.k_scale is None else view.k_scale.cpu(),
                "v_scale": None if view.v_scale is None else view.v_scale.cpu(),
                "page_table": step.page_table.cpu(), "seq_lens": step.seq_lens.cpu(),
                "cu_seqlens_q": step.cu_seqlens_q.cpu(), "out_loc": step.out_loc.cpu(),
                "positions": step.positions.cpu(), "sm_scale": model.scale,
                "out_triton": o_t.cpu(), "out_torch": o_r.cpu(), "rel_err": err,
            }, out / f"repro_{tag}.pt")  # fmt: skip
        h = model.finish_layer(i, h, o_r)
    return errs


def decode_prompts(text: list[int], lens: list[int]) -> list[list[int]]:
    """4 requests cut from the text at different offsets (their next token follows in it)."""
    starts = [0, 40, 350, 100]
    starts = [min(s, len(text) - 1 - m) for s, m in zip(starts, lens, strict=True)]
    return [text[s : s + m + 1] for s, m in zip(starts, lens, strict=True)]


def layer_checks(model: Llama, text: list[int], dtype: str, scales, lens, out: Path,
                 saved) -> dict:  # fmt: skip
    n = len(text)
    pool = fidelity.pool_for(model, dtype, n + 2048, scales=scales)
    ps = pool.page_size
    pages = np.arange(1, -(-n // ps) + 1, dtype=np.int32)
    ids = torch.tensor(text)
    tag = pool.plan.dtype
    ext = dual_forward(model, pool, ids, Step.build([pages], [0], [n], ps, device=model.device),
                       f"{tag}_extend", out, saved)  # fmt: skip
    # decode: 4 requests of 37..1,000 text tokens (prefilled through the reference path), then
    # one decode step checked per layer
    cut = decode_prompts(text, lens)
    per = -(-(max(lens) + 1) // ps)
    pool2 = fidelity.pool_for(model, dtype, 4 * per * ps, scales=scales)
    rp = [np.arange(1 + per * b, 1 + per * (b + 1), dtype=np.int32) for b in range(4)]
    model.attn_backend = "torch"
    model.forward(pool2, torch.tensor([t for p in cut for t in p[:-1]]),
                  Step.build(rp, [0] * 4, lens, ps, device=model.device))  # fmt: skip
    model.attn_backend = "auto"
    nxt = torch.tensor([p[-1] for p in cut])
    dec = dual_forward(model, pool2, nxt, Step.build(rp, lens, [1] * 4, ps, device=model.device),
                       f"{tag}_decode", out, saved)  # fmt: skip
    bound = NOISE.get(tag, NOISE_DEFAULT)
    return {
        "dtype": tag, "bound": bound,
        "extend_max_rel_err": max(ext), "extend_worst_layer": int(np.argmax(ext)),
        "decode_max_rel_err": max(dec), "decode_worst_layer": int(np.argmax(dec)),
        "extend_rel_err": ext, "decode_rel_err": dec,
        "ok": max(ext) <= bound and max(dec) <= bound,
    }  # fmt: skip


# ----------------------------------------------------------------------------- whole model
def teacher_forced(model: Llama, dtype: str, ids: torch.Tensor, scales, backend: str):
    model.attn_backend = backend
    try:
        pool = fidelity.pool_for(model, dtype, ids.numel(), scales=scales)
        return fidelity.teacher_forced_logits(model, pool, ids)
    finally:
        model.attn_backend = "auto"


def fidelity_rows(model: Llama, text: list[int], calib: list[int], dtypes) -> list[dict]:
    ids = torch.tensor(text)
    ref, _ = model.forward_reference(ids)
    _, past = model.forward_reference(torch.tensor(calib))
    targets = ids[1:].to(model.device)
    rows = []
    for dtype in dtypes:
        scales = fidelity.calibrate_scales(past, resolve(model, dtype))
        tri = teacher_forced(model, dtype, ids, scales, "triton")
        tor = teacher_forced(model, dtype, ids, scales, "torch")
        rows.append({
            "dtype": dtype, "resolved": resolve(model, dtype), "tokens": int(targets.numel()),
            "triton": fidelity.metrics(ref[:-1], tri[:-1], targets),
            "torch": fidelity.metrics(ref[:-1], tor[:-1], targets),
            "triton_vs_torch": cross(tri[:-1], tor[:-1]),
        })  # fmt: skip
        print(json.dumps({k: rows[-1][k] for k in ("dtype", "triton", "triton_vs_torch")}),
              flush=True)  # fmt: skip
    return rows


def kernel_check(model: Llama, dtype: str, scales, prompts: list[list[int]]) -> dict:
    """Prefill 4 requests + 8 decode steps, Triton vs torch attention, both fed the same tokens
    (the Triton run's greedy choices); compare every logit row."""
    lens = [len(p) for p in prompts]
    res, forced = {}, []
    for backend in ("triton", "torch"):
        model.attn_backend = backend
        pool = serve.make_pool(model, dtype, 4 * 80 * 16, 16, scales)
        pages = [np.arange(1 + 80 * b, 1 + 80 * (b + 1), dtype=np.int32) for b in range(4)]
        ids = torch.tensor([t for p in prompts for t in p])
        step = Step.build(pages, [0] * 4, lens, 16, device=model.device)
        rows = [model.forward(pool, ids, step, all_logits=True)]
        toks = rows[0][step.last_index].argmax(-1)
        seq = list(lens)
        for k in range(8):
            if backend == "triton":
                forced.append(toks)
            toks = forced[k]
            step = Step.build(pages, seq, [1] * 4, 16, device=model.device)
            out = model.forward(pool, toks, step)
            rows.append(out)
            toks = out.argmax(-1)
            seq = [s + 1 for s in seq]
        res[backend] = torch.cat(rows).float()
    model.attn_backend = "auto"
    n_dec = 8 * 4
    c = cross(res["triton"], res["torch"])
    c["decode_top1_agreement"] = float(
        (res["triton"][-n_dec:].argmax(-1) == res["torch"][-n_dec:].argmax(-1)).float().mean()
    )
    return c


def serving_row(model: Llama, dtype: str, scales, args, cuda: bool) -> dict:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    pool = serve.make_pool(model, dtype, args.pool_tokens, 16, scales)
    warm = serve.Engine(model, pool, max_running=4)  # compile this dtype's kernels first
    for p, n, _ in workload(4, 1, 64, 49152, 4, *args.prompt_range):
        warm.submit(p, n)
    warm.run()
    del warm
    eng = serve.Engine(model, pool, max_running=args.max_running)
    lo, hi = args.prompt_range
    for p, n, a in workload(args.requests, 2, args.shared, 49152, args.max_new, lo, hi):
        eng.submit(p, n, arrival=a)
    sync()
    eng.run()
    sync()
    s = eng.stats
    assert all(r.status == "finished" for r in eng.requests)
    mem = {} if cuda else {"gpu": "H200"}  # capacity from the device's measured free memory
    plan = kvpool.size_for(model.spec, dtype, 0.9, page_size=16, **mem)
    row = {
        "dtype": dtype, "tokens_per_s": s.tokens_per_s,
        "decode_tokens_per_s": s.decode_tokens / s.decode_s if s.decode_s else 0.0,
        "prefill_tokens_per_s": s.prefill_tokens / s.prefill_s if s.prefill_s else 0.0,
        "generated": s.generated, "steps": s.steps, "seconds": s.seconds,
        "hit_rate": s.hit_rate, "evicted_pages": s.evicted_pages, "retracted": s.retracted,
        "capacity_tokens_0.9": plan.num_tokens, "requests_4096_0.9": plan.requests_fit(4096),
        "wall_s_incl_compile": time.perf_counter() - t0,
    }  # fmt: skip
    del pool, eng
    if cuda:
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="SmolLM2 GGUF (default: random weights)")
    ap.add_argument("--text", default=str(ROOT / "examples" / "fidelity_text.txt"))
    ap.add_argument("--fidelity-dtypes", default=",".join(ALL))
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3,nvfp4,fp4_mx_block16")
    ap.add_argument("--sections", default="layers,fidelity,bf16_model,serving,report")
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--max-running", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--shared", type=int, default=512)
    ap.add_argument("--pool-tokens", type=int, default=131072)
    ap.add_argument("--fidelity-tokens", type=int, default=0, help="0: the whole text")
    ap.add_argument("--decode-lens", default="37,300,129,1000", help="4 request lengths")
    ap.add_argument("--prompt-range", default="32,512", help="user prompt lengths (synthetic)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    args.prompt_range = [int(x) for x in args.prompt_range.split(",")]
    args.decode_lens = [int(x) for x in args.decode_lens.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    cuda = dev.startswith("cuda")
    sections = args.sections.split(",")
    info: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                  "torch": torch.__version__, "errors": {}}  # fmt: skip
    if cuda:
        import triton

        info["triton"] = triton.__version__

    def save():
        (out / "serve_gpu.json").write_text(json.dumps(info, indent=1))

    def section(name, fn):
        if name not in sections:
            return
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            info[name] = fn()
        except Exception:
            info["errors"][name] = traceback.format_exc()
            print(info["errors"][name], flush=True)
        info.setdefault("section_s", {})[name] = time.perf_counter() - t0
        save()

    if args.model is None:  # random weights: the loop's speed only
        model = random_llama(SMOLLM2, "bf16", dev)
        info["model"] = model.spec.name
        section("serving", lambda: [serving_row(model, d, None, args, cuda)
                                    for d in args.dtypes.split(",")])  # fmt: skip
        return 0

    from kvpool.gguf import load_gguf_weights, tokenizer_from_gguf

    t0 = time.perf_counter()
    config, weights = load_gguf_weights(args.model)
    tok = tokenizer_from_gguf(args.model)
    info["load_s"] = time.perf_counter() - t0
    name = Path(args.model).name
    info["model"] = name
    f32 = Llama(config, weights, ModelSpec.from_pretrained(args.model, dtype="fp32"), dev)
    text = tok.encode(Path(args.text).read_text()).ids
    text = text[: args.fidelity_tokens or len(text)]
    calib = tok.encode(serve.chat(serve.SYSTEM, serve.QUESTIONS[0])).ids
    info["text_tokens"] = len(text)
    _, past32 = f32.forward_reference(torch.tensor(calib))
    saved: list[str] = []

    def layers():
        rows = []
        for d in args.fidelity_dtypes.split(","):
            sc = fidelity.calibrate_scales(past32, resolve(f32, d))
            rows.append(layer_checks(f32, text, d, sc, args.decode_lens, out, saved))
            r = rows[-1]
            print(f"{r['dtype']:<16} extend {r['extend_max_rel_err']:.2e} (layer "
                  f"{r['extend_worst_layer']}) decode {r['decode_max_rel_err']:.2e} (layer "
                  f"{r['decode_worst_layer']}) bound {r['bound']:.0e} ok={r['ok']}", flush=True)
        return {"model_dtype": "fp32", "rows": rows, "reproducers": list(saved)}

    section("layers", layers)
    section("fidelity", lambda: {"model_dtype": "fp32", "reference": "fp32 contiguous cache",
                                 "rows": fidelity_rows(f32, text, calib,
                                                       args.fidelity_dtypes.split(","))})

    b16 = Llama(config, weights, ModelSpec.from_pretrained(args.model, dtype="bf16"), dev)
    del weights
    _, past16 = b16.forward_reference(torch.tensor(calib))
    prompts = [p[:-1] for p in decode_prompts(text, args.decode_lens)]

    def bf16_model():
        ids = torch.tensor(text)
        ref16, _ = b16.forward_reference(ids)
        ref32, _ = f32.forward_reference(ids)
        targets = ids[1:].to(b16.device)
        res = {"teacher_forcing": {}, "prefill_decode": {}}
        for d in args.dtypes.split(","):
            scales = fidelity.calibrate_scales(past16, d)
            tri = teacher_forced(b16, d, ids, scales, "triton")
            tor = teacher_forced(b16, d, ids, scales, "torch")
            res["teacher_forcing"][d] = {
                "triton_vs_torch": cross(tri[:-1], tor[:-1]),
                "triton_vs_bf16_reference": fidelity.metrics(ref16[:-1], tri[:-1], targets),
                "triton_vs_fp32_reference": fidelity.metrics(ref32[:-1], tri[:-1], targets),
                "torch_vs_fp32_reference": fidelity.metrics(ref32[:-1], tor[:-1], targets),
            }
            res["prefill_decode"][d] = kernel_check(b16, d, scales, prompts)
            print(d, json.dumps(res["teacher_forcing"][d]["triton_vs_torch"]),
                  json.dumps(res["prefill_decode"][d]), flush=True)  # fmt: skip
        res["bf16_reference_vs_fp32_reference"] = fidelity.metrics(ref32[:-1], ref16[:-1], targets)
        return res

    section("bf16_model", bf16_model)

    def serving():
        rows = []
        for d in args.dtypes.split(","):
            rows.append(serving_row(b16, d, fidelity.calibrate_scales(past16, d), args, cuda))
            print(json.dumps(rows[-1]), flush=True)
        return {"model_dtype": "bf16", "requests": args.requests, "max_new": args.max_new,
                "max_running": args.max_running, "shared": args.shared,
                "pool_tokens": args.pool_tokens, "rows": rows}  # fmt: skip

    section("serving", serving)
    b16.w.clear()  # free its weights before the report
    if cuda:
        torch.cuda.empty_cache()

    def report():
        ns = SimpleNamespace(
            text=args.text, fidelity_tokens=args.fidelity_tokens, dtypes=ALL, context=4096,
            pool_tokens=2048, page_size=16, max_running=6, max_new=64, mem_frac=0.9,
            gpu="H200", model=name,
        )  # fmt: skip
        return serve.report(f32, tok, ns)

    section("report", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
