"""kvpool's serving loop (examples/serve.py ``Engine``) against transformers' continuous batching.

Same GPU, same random bf16 weights (one ``LlamaForCausalLM`` built from a config, its state dict
loaded into :class:`kvpool.llama.Llama`), same request list, greedy, a fixed number of new
tokens (no stop token). Models (issue 22):

- ``SmolLM2-135M``: its geometry (576 hidden, 30 layers, 9 q / 3 KV heads), 192 requests of
  32..511 prompt tokens (three in four share a 512-token system prompt), 96 new tokens;
- ``Llama-3.1-8B-geometry``: 4,096 hidden, 32 layers, 32 q / 8 KV heads, ``--big-requests``
  requests (default 64; the issue's run is 256) of 1,024 prompt + 256 new tokens.

KV budget (``--kv-budget-gib``, 8B geometry): kvpool's pool is sized to that many GiB of KV
(``kvpool.size_for`` with it as the memory budget), so an fp8 cache holds about twice the tokens
of a bf16 one; ``max_running`` is as many whole requests (prompt + new tokens) as the pool's
pages hold. ``auto`` (the default) picks the budget whose bf16 cache holds half the requests
(256 requests: 20.125 GiB, bf16 128 at once, fp8_e4m3 all 256; printed). SmolLM2's pool
(``--small-kv-budget-gib``, default 0) holds every request in any dtype.

Writes ``throughput.json`` under ``--out`` (one record per section: ``system``, ``model``,
``dtype``, ``section``, ``tokens_per_s``, ``step_ms``, ``host_fraction`` (None where not
measured), ``requests``, ``new_tokens``, ``compile``; kvpool's also ``cuda_graph`` (serve.py's
GraphEngine, ``--cuda-graph``, or its eager Engine), ``kv_budget_gib``, ``pool_tokens``,
``max_running``, ``peak_running`` (the largest batch that ran), ``retracted``), rewritten after
each record so a cut run keeps what finished (records of an earlier run in the same ``--out``
are kept unless the same section runs again), and ``log.txt``. Before running, each section's
H200 time estimate is printed (``--dry-run``: only that, no GPU needed); ``--sections`` (globs
over the section names) and ``--models`` split a run across calls. Every section runs under a
wall-clock budget (``--budget-s``, default 420 s in all): a section that would start past it is
skipped and recorded as such.

    python benches/e2e/bench_vs_transformers.py --out $OUT/vs_transformers
    python benches/e2e/bench_vs_transformers.py --models Llama-3.1-8B-geometry --big-requests 256 \
        --sections 'kvpool-*' --compile on,off --out $OUT/l8b   # then --sections transformers
    python benches/e2e/bench_vs_transformers.py --tiny --device cpu --out /tmp/vs  # CPU check
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "python"))

import kvpool  # noqa: E402
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


PAGE = 16  # tokens per page of kvpool's pools


def request_pages(prompts, new: int) -> int:
    """Pages of the longest request at its full length (prompt + new tokens)."""
    return -(-(max(len(p) for p in prompts) + new) // PAGE)


def auto_budget_gib(spec: ModelSpec, prompts, new: int) -> float:
    """The KV budget (GiB, rounded up) whose bf16 pool holds half the requests whole."""
    half = max(1, len(prompts) // 2)
    plan = kvpool.size_for(spec, "bf16", num_tokens=half * request_pages(prompts, new) * PAGE,
                           page_size=PAGE)  # fmt: skip
    gib = plan.to_dict()["total_bytes"] / 2**30
    step = 8 if gib >= 1 else 2**18  # (1/8 GiB; a --tiny pool: 4 KiB)
    return math.ceil(gib * step) / step


def pool_plan(spec: ModelSpec, dtype: str, prompts, new: int, budget_gib: float):
    """kvpool's plan: ``budget_gib`` GiB of KV (the memory budget of ``size_for``), or with 0 the
    pages every request needs at once (prefix sharing ignored) plus 64."""
    if budget_gib:
        b = int(budget_gib * 2**30)
        return kvpool.size_for(spec, dtype, 1.0, total_memory=b, available_memory=b,
                               page_size=PAGE)  # fmt: skip
    need = (sum(-(-(len(p) + new) // PAGE) for p in prompts) + 64) * PAGE
    return kvpool.size_for(spec, dtype, num_tokens=need, page_size=PAGE)


def fit_requests(plan, prompts, new: int) -> int:
    """Requests the plan's pages hold whole (prompt + new tokens) at once, in submission order
    (prefix sharing ignored)."""
    free = kvpool.PageAllocator(plan.to_dict()["num_pages"], PAGE).num_free
    pages = np.cumsum([-(-(len(p) + new) // PAGE) for p in prompts])
    return int((pages <= free).sum())


def run_kvpool(llama: Llama, prompts, new: int, dtype: str, graph: bool, budget_gib: float = 0.0
               ) -> dict:  # fmt: skip
    """Tokens/s, decode step time and its host fraction of the example's engine (``graph``:
    serve.py --cuda-graph's GraphEngine, else the eager Engine), every request submitted at once,
    at most as many running as the pool holds whole (``max_running``).

    ``host_fraction`` (graphs): 1 - (GPU time of the decode forwards, CUDA events around each
    replay) / (decode wall time), the share of a decode step the GPU waits for the host (None
    on CPU); eager runs get theirs from the graph run's GPU time (:func:`eager_host_fraction`).
    """
    dev = str(llama.device)
    plan = pool_plan(llama.spec, dtype, prompts, new, budget_gib)
    pool = kvpool.KVPool(plan, device=llama.device)
    longest = max(len(p) for p in prompts) + new
    fit = fit_requests(plan, prompts, new)
    if fit < 1:
        raise ValueError(f"a {budget_gib} GiB {dtype} pool ({plan.num_tokens} tokens) holds no "
                         f"request of {longest} tokens")  # fmt: skip
    max_running = min(len(prompts), fit)

    def engine(n):
        if graph:
            return serve.GraphEngine(
                llama,
                pool,
                max_running=n,
                max_prefill_tokens=16384,
                max_seq_len=longest,
                use_graphs=dev.startswith("cuda"),
            )
        return serve.Engine(llama, pool, max_running=n, max_prefill_tokens=16384)

    warm = engine(min(4, max_running))  # compile this dtype's kernels (and the model's) first
    for p in prompts[:4]:
        warm.submit(p[:64], 4)
    warm.run()
    del warm
    eng = engine(max_running)  # (GraphEngine captures its buckets here, before the clock)
    for p in prompts:
        eng.submit(p, new)
    peak = [0]

    def on_step(e):
        peak[0] = max(peak[0], len(e.running))

    _sync(dev)
    t0 = time.perf_counter()
    eng.run(on_step=on_step)
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
        "cuda_graph": graph, "compile": llama.compiled, "kv_dtype": plan.dtype,
        "kv_budget_gib": budget_gib or None, "pool_tokens": eng.capacity_tokens,
        "pool_gib": plan.to_dict()["total_bytes"] / 2**30, "max_running": max_running,
        "peak_running": peak[0], "retracted": s.retracted, "evicted_pages": s.evicted_pages,
        "prefill_s": s.prefill_s,
    }  # fmt: skip


# Rough H200 figures (runs 13-14, bf16 cache) behind the per-section estimates: prefill tokens/s,
# decode step seconds (graphs, eager), transformers' generated tokens/s, model build seconds.
H200 = {
    "SmolLM2-135M": dict(prefill=250e3, graph=0.006, eager=0.025, hf=900.0, build=10.0),
    "Llama-3.1-8B-geometry": dict(prefill=35e3, graph=0.016, eager=0.02, hf=600.0, build=30.0),
}
COMPILE_S = 60.0  # first compiled section of a model: inductor compiles the two pieces (x2)


def estimate_s(model: str, system: str, graph: bool | None, compiled: bool, first_compiled: bool,
               prompts, new: int, fit: int) -> float:  # fmt: skip
    """Seconds a section takes on an H200 (warm-up, capture and compile included): a guide."""
    r = H200[model]
    n = len(prompts)
    if system == "transformers":
        return 15.0 + n * new / r["hf"]
    waves = math.ceil(n / max(1, min(n, fit)))
    run = sum(map(len, prompts)) / r["prefill"] + waves * new * r["graph" if graph else "eager"]
    return run + 10.0 + (COMPILE_S if first_compiled else 0.0)  # (+ warm-up and capture)


def eager_host_fraction(records: list[dict], r: dict) -> None:
    """An eager run's host fraction: 1 - (GPU time of the same steps replayed from CUDA graphs,
    the graph run of this model and dtype) / (its decode wall time). Eager CUDA events would
    count the GPU's waits for the launches as GPU time."""
    for g in records:
        same = ("kvpool", r["model"], r["dtype"], True, r.get("compile"), r.get("requests"))
        if (g.get("system"), g.get("model"), g.get("dtype"), g.get("cuda_graph"),
                g.get("compile"), g.get("requests")) == same and g.get("decode_gpu_s") and r.get(
                "decode_s"):  # fmt: skip
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
    hf.generate_batch(
        inputs=[p[:64] for p in prompts[:4]], generation_config=gc, progress_bar=False, **kw
    )  # fmt: skip  (warm-up)
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


def sections(args) -> list[tuple[str, str, str, bool | None, bool]]:
    """``(name, system, dtype, cuda_graph, compile)`` of one model's sections, those of
    ``--sections``: kvpool's per compile mode, dtype and engine, the peer second (a budget cut
    then leaves the main comparison)."""
    out = [(f"kvpool-{d}-{'graph' if g else 'eager'}" + ("-compiled" if c else ""),
            "kvpool", d, g, c)
           for c in [x == "on" for x in args.compile.split(",")]
           for d in args.dtypes.split(",")
           for g in [x == "on" for x in args.graph.split(",")]]  # fmt: skip
    out.insert(1, ("transformers", "transformers", "bf16", None, False))
    pats = args.sections.split(",")
    return [x for x in out if any(fnmatch.fnmatchcase(x[0], p) for p in pats)]


def parser() -> argparse.ArgumentParser:  # noqa: D103
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for throughput.json and log.txt")
    ap.add_argument("--models", default="SmolLM2-135M,Llama-3.1-8B-geometry")
    ap.add_argument("--small-requests", type=int, default=192)
    ap.add_argument("--big-requests", type=int, default=64, help="8B geometry (issue: 256)")
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3", help="kvpool cache dtypes")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of all")
    ap.add_argument(
        "--graph",
        default="on,off",
        help="kvpool engines: on (serve.py --cuda-graph), off (eager), or both",
    )
    ap.add_argument("--compile", nargs="?", const="on", default="off",
                    help="kvpool's model pieces through torch.compile (Llama.compile): on, off, "
                    "or on,off (both); --compile alone: on")  # fmt: skip
    ap.add_argument("--kv-budget-gib", default="auto",
                    help="8B geometry: GiB of KV in kvpool's pool (auto: bf16 holds half the "
                    "requests at once; 0: every request in any dtype)")  # fmt: skip
    ap.add_argument(
        "--small-kv-budget-gib",
        type=float,
        default=0.0,
        help="SmolLM2: the same (0: every request in any dtype)",
    )
    ap.add_argument("--sections", default="*",
                    help="comma-separated globs over section names: kvpool-bf16-graph, "
                    "kvpool-fp8_e4m3-eager-compiled, transformers, ...")  # fmt: skip
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the sections, pool sizes and H200 time estimates; run nothing",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="both models shrunk to 2 layers, 6 short requests: a CPU check",
    )
    return ap


def main(argv: list[str] | None = None) -> int:  # noqa: D103
    ap = parser()
    args = ap.parse_args(argv)
    for name in ("graph", "compile"):
        bad = set(getattr(args, name).split(",")) - {"on", "off"}
        if bad:
            ap.error(f"--{name}: on, off or on,off; got {getattr(args, name)!r}")
    if args.kv_budget_gib != "auto":
        try:
            args.kv_budget_gib = float(args.kv_budget_gib)
        except ValueError:
            ap.error(f"--kv-budget-gib: a number of GiB or auto, got {args.kv_budget_gib!r}")
    if args.tiny:
        args.small_requests = args.big_requests = 6
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a")
    t_start = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    old = json.loads((out / "throughput.json").read_text()) if (
        out / "throughput.json").is_file() and not args.dry_run else []  # fmt: skip
    records: list[dict] = []

    def key(r):
        return r.get("model"), r.get("section"), r.get("requests")

    def say(msg):
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    def save():
        done = {key(r) for r in records}
        kept = [r for r in old if key(r) not in done]
        (out / "throughput.json").write_text(json.dumps(kept + records, indent=1) + "\n")

    total_est = 0.0
    for model in args.models.split(","):
        n = args.small_requests if model == "SmolLM2-135M" else args.big_requests
        cfg = dict(CONFIGS[model], **(TINY if args.tiny else {}))
        prompts, new = workload(model, n, cfg["vocab_size"], tiny=args.tiny)
        spec = ModelSpec.from_dict(dict(cfg, torch_dtype="bfloat16"), name=model, dtype="bf16")
        budget = args.small_kv_budget_gib if model == "SmolLM2-135M" else args.kv_budget_gib
        if budget == "auto":
            budget = auto_budget_gib(spec, prompts, new)
            say(f"{model}: --kv-budget-gib auto = {budget:g} GiB (bf16 holds half of {n} "
                f"requests of up to {max(map(len, prompts)) + new} tokens)")  # fmt: skip
        fits = {}
        for d in args.dtypes.split(","):
            plan = pool_plan(spec, d, prompts, new, budget)
            fits[d] = fit_requests(plan, prompts, new)
            say(f"{model} {d}: pool {plan.num_tokens:,} tokens "
                f"({plan.to_dict()['total_bytes'] / 2**30:.2f} GiB), {min(n, fits[d])} of {n} "
                "requests at once")  # fmt: skip
        todo = sections(args)
        est, first = {}, True
        for name, system, dtype, graph, comp in todo:
            est[name] = estimate_s(model, system, graph, comp, comp and first, prompts, new,
                                   fits.get(dtype, n))  # fmt: skip
            first = first and not comp
        model_est = H200[model]["build"] + sum(est.values())
        total_est += model_est
        say(f"{model}: {len(todo)} sections, H200 estimate {model_est:.0f} s ("
            + ", ".join(f"{k} {v:.0f}" for k, v in est.items()) + ")")  # fmt: skip
        if args.dry_run:
            continue
        hf = llama = None
        try:
            hf, llama = build(model, args.device, tiny=args.tiny)
            for name, system, dtype, graph, comp in todo:
                base = {
                    "system": system,
                    "model": model,
                    "dtype": dtype,
                    "section": name,
                    "requests": n,
                    "new_tokens": new,
                    "compile": comp,
                    "weights": "random bf16 (same for both systems)",
                    "started": started,
                    "estimate_s": est[name],
                    "device": args.device + (" (--tiny geometry)" if args.tiny else ""),
                }
                if graph is not None:
                    base["cuda_graph"] = graph
                if time.perf_counter() - t_start > args.budget_s:
                    records.append(dict(base, skipped="over --budget-s"))
                    say(f"{model} {name}: skipped (budget)")
                    save()
                    continue
                try:
                    if system == "kvpool":
                        llama.compile(comp)
                        r = run_kvpool(llama, prompts, new, dtype, graph, budget)
                    else:
                        r = run_transformers(hf, prompts, new)
                    r = dict(base, **r)
                    if system == "kvpool" and not graph:
                        eager_host_fraction(old + records, r)
                    records.append(r)
                    hfr = r["host_fraction"]
                    hfr = "-" if hfr is None else f"{hfr:.2f}"
                    batch = (
                        f", batch {r['peak_running']}/{r['max_running']} of "
                        f"{r['pool_tokens']:,} tokens"
                        if system == "kvpool"
                        else ""
                    )
                    say(f"{model} {name}: {r['tokens_per_s']:.0f} tokens/s, step "
                        f"{r['step_ms'] or 0:.2f} ms, host fraction {hfr}{batch}, "
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
    say(f"H200 estimate of the whole run: {total_est:.0f} s; took "
        f"{time.perf_counter() - t_start:.0f} s here")  # fmt: skip
    if not args.dry_run:
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
