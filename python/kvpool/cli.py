"""``kvpool`` command line: ``kvpool size MODEL ...`` and ``kvpool models``.

``kvpool size`` prints, per dtype, the allocation line SGLang would log for a pool of that size
(``SGLang would log: KV Cache is allocated. dtype: ..., #tokens: N, K size: X GB, V size: Y GB``;
GB there is GiB; nothing is allocated) and a table across KV dtypes: tokens, capacity vs
BF16, and how many requests of ``--context-len`` tokens fit. GiB = 2^30 bytes everywhere.

With ``--kv-cache-dtype all`` (the default) a dtype that cannot be sized for the model (FP4 with
head dims that are not multiples of 16, a budget too small for its pages) gets a row of ``-``
and a line saying why after the table (``--json``: an entry with ``error`` and ``error_type``);
the others are listed and the exit status is 0. Only when no dtype can be sized does the command
fail, with the first dtype's error, as a single requested dtype that cannot be sized does.
Errors name the flags and GiB (``kvpool._cli_errors``); ``--plot FILE.png`` draws the table
(:mod:`kvpool.plot`, needs the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import kvpool
from kvpool._cli_errors import for_cli
from kvpool._core import BudgetTooSmallError, KvDtypeError, LayoutError
from kvpool.config import bundled_models
from kvpool.gpus import GPUS
from kvpool.sizing import GIB, KV_DTYPES, Plan

#: Errors that depend on the KV dtype: with ``all`` they drop that dtype, not the whole report.
_PER_DTYPE = (LayoutError, BudgetTooSmallError, KvDtypeError)


def _gib(text: str) -> int:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got `{text}`") from None
    if not 0 <= v < 1 << 34:
        raise argparse.ArgumentTypeError(
            f"expected a finite, non-negative number of GiB, got `{text}`"
        )
    return round(v * GIB)


def _weights(text: str) -> int | str:
    return "auto" if text == "auto" else _gib(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description="KV-cache pool sizing and tools")
    p.add_argument("--version", action="version", version=f"kvpool {kvpool.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("size", help="how many tokens/requests fit, per KV dtype")
    s.add_argument(
        "model", help="bundled hub id (see `kvpool models`), config.json, model dir or GGUF"
    )
    s.add_argument(
        "--kv-cache-dtype",
        default="all",
        help="auto, fp32, bf16, fp16, fp8_e4m3 (fp8), fp8_e5m2, nvfp4, fp4_mx_block16, "
        "or all (default)",
    )
    s.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.9,
        help="fraction of device memory for weights + KV pool, in (0, 1] (SGLang's flag; "
        "default 0.9)",
    )
    s.add_argument("--gpu", help=f"GPU by name: {', '.join(GPUS)}")
    s.add_argument("--total-memory", type=_gib, metavar="GIB",
                   help="device memory free before loading weights, in GiB (2^30 bytes)")
    s.add_argument("--available-memory", type=_gib, metavar="GIB",
                   help="device memory free after loading weights, in GiB (2^30 bytes)")
    s.add_argument(
        "--weights",
        type=_weights,
        default=None,
        metavar="GIB|auto",
        help="weights of the whole model in GiB, or auto (checkpoint index / estimate)",
    )
    s.add_argument("--page-size", type=int, default=1, help="tokens per page (default 1)")
    s.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks; figures are per rank (default 1)")
    s.add_argument(
        "--nvfp4-recipe",
        default="linear",
        help="linear (default), page_major, mixed, linear_workspace",
    )
    s.add_argument("--model-dtype", help="the loaded model's compute dtype (what auto resolves to)")
    s.add_argument(
        "--context-len",
        type=int,
        default=None,
        help="request length the budget is split for (models with sliding-window or "
        "linear-attention layers: every group holds the same number of such requests) and of "
        "the requests column (default: 8192)",
    )
    s.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=8192,
        help="tokens per prefill chunk kept free in each sliding-window page space "
        "(SGLang's flag; default 8192; -1: no chunking)",
    )
    s.add_argument(
        "--speculative-algorithm",
        choices=("NEXTN", "EAGLE", "EAGLE3"),
        help="plan a draft model in the same budget: NEXTN = the config's MTP layers "
        "(num_nextn_predict_layers), EAGLE/EAGLE3 = --speculative-draft-model-path",
    )
    s.add_argument(
        "--speculative-draft-model-path",
        help="draft model (bundled hub id, config.json, model dir or GGUF) for EAGLE/EAGLE3",
    )
    s.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=0,
        help="draft tokens per step: sliding spaces keep their pages for rollback (default 0)",
    )
    s.add_argument("--host-memory", type=_gib, metavar="GIB",
                   help="pinned host memory for the host tier (pages evicted from the device "
                        "are demoted there): host pages and bytes per dtype")
    s.add_argument("--json", action="store_true", help="print every figure as JSON")
    s.add_argument("--plot", metavar="FILE.png",
                   help="draw tokens and requests per dtype to FILE (pip install 'kvpool[plot]')")
    sub.add_parser("models", help="list the bundled model configs")
    return p


def _size(args: argparse.Namespace, console: Console) -> int:
    dtypes = list(KV_DTYPES) if args.kv_cache_dtype == "all" else [args.kv_cache_dtype]
    kw = dict(
        mem_frac=args.mem_fraction_static,
        gpu=args.gpu,
        total_memory=args.total_memory,
        available_memory=args.available_memory,
        weights=args.weights,
        page_size=args.page_size,
        tp_size=args.tp_size,
        nvfp4_recipe=args.nvfp4_recipe,
        model_dtype=args.model_dtype,
    )
    context = 8192 if args.context_len is None else args.context_len
    if not 0 < context < 1 << 64:
        raise ValueError(f"--context-len must be in 1..2^64-1, got {context}")
    chunk = args.chunked_prefill_size
    if chunk == -1:
        chunk = None
    elif chunk < 1:
        raise ValueError(f"--chunked-prefill-size must be >= 1 or -1, got {chunk}")
    kw |= dict(context_len=context, chunked_prefill_size=chunk,
               num_draft_tokens=args.speculative_num_draft_tokens,
               draft=_draft(args))  # fmt: skip
    if args.host_memory is not None:
        kw["host_memory"] = args.host_memory
    spec = kvpool.ModelSpec.from_pretrained(args.model, dtype=args.model_dtype)
    results = _plans(spec, dtypes, kw, keep_going=args.kv_cache_dtype == "all")
    plans = [r for r in results if isinstance(r, Plan)]
    if args.plot:
        from kvpool.plot import plot_capacity

        plot_capacity(args.plot, spec, plans, context, gpu=args.gpu, kw=kw)
    if args.json:
        out = []
        for r in results:
            if isinstance(r, Plan):
                d = r.to_dict()
                d.pop("buffers")
            else:
                dtype, e = r
                d = {"dtype": dtype, "model": spec.name, "error": str(e),
                     "error_type": type(e).__name__}  # fmt: skip
            out.append(d | {"context_len": context})
        print(json.dumps(out, indent=2))
        return 0
    b = plans[0].budget
    kinds = {
        k: spec.layer_kinds.count(k) for k in ("full", "sliding", "linear") if k in spec.layer_kinds
    }
    console.print(
        f"[bold]{escape(spec.name)}[/]: {spec.num_layers} layers "
        f"({', '.join(f'{n} {k}' for k, n in kinds.items())}), "
        + (
            f"MLA latent {spec.kv_lora_rank}+{spec.qk_rope_head_dim}"
            if spec.is_mla
            else f"{spec.num_kv_heads} KV heads x head_dim {spec.head_dim}"
        )
        + f", model dtype {spec.dtype} ({spec.dtype_source}); "
        f"tp_size {args.tp_size}, page_size {args.page_size}"
    )
    if b is not None:
        console.print(
            f"budget: {b.budget / GIB:.2f} GiB = available {b.available_memory / GIB:.2f}"
            f" - total {b.total_memory / GIB:.2f} x (1 - {b.mem_frac}); "
            f"weights {b.weights / GIB:.2f} GiB per rank ({b.weights_source})"
        )
    for p in plans:
        console.print(f"SGLang would log: {p.sglang_line()}", highlight=False)
    bf16 = next((p for p in plans if p.dtype == "bf16"), None)
    t = Table(title=f"KV capacity per rank ({context}-token requests)")
    for col in ("dtype", "bytes/token", "#tokens", "x vs bf16", "requests", "pool GiB"):
        t.add_column(col, justify="left" if col == "dtype" else "right")
    for p in results:
        if not isinstance(p, Plan):
            t.add_row(p[0], *["-"] * 5)
            continue
        ratio = f"{p.num_tokens / bf16.num_tokens:.2f}x" if bf16 else "-"
        t.add_row(
            p.dtype,
            f"{p.bytes_per_token:,}",
            f"{p.num_tokens:,}",
            ratio,
            f"{p.requests_fit(context):,}",
            f"{p.total_bytes / GIB:.2f}",
        )
    console.print(t)
    for p in plans:
        if p.host is not None:
            console.print(
                f"host tier {p.dtype}: {p.host_bytes / GIB:.2f} GiB pinned = {p.host_pages:,} "
                f"pages x {p.page_size} ({p.host_pages * p.page_size:,} tokens, "
                f"{p.host.bytes_per_token:,} B/token)",
                highlight=False,
            )
    for r in results:
        if not isinstance(r, Plan):
            console.print(
                f"{r[0]}: not sized: {type(r[1]).__name__}: {escape(str(r[1]))}", highlight=False
            )
    if len(plans[0].groups) > 1 or any(p.page_spaces[s]["capped_by_int32"]
                                       for p in plans for s in p.page_spaces):  # fmt: skip
        chunk_s = "unchunked prefill" if chunk is None else f"{chunk}-token prefill chunks"
        console.print(
            f"layer groups (budget split for {context}-token requests, {chunk_s}, "
            f"{args.speculative_num_draft_tokens} draft tokens):",
            highlight=False,
        )
        for p in plans:
            for line in _group_lines(p):
                console.print(f"  {p.dtype}: {line}", highlight=False)
    return 0


def _draft(args: argparse.Namespace) -> str | None:
    """``size_for``'s ``draft`` from SGLang's speculative flags."""
    algo, path = args.speculative_algorithm, args.speculative_draft_model_path
    if algo == "NEXTN":
        if path is not None:
            raise ValueError("--speculative-algorithm NEXTN runs the model's own MTP layers; "
                             "drop --speculative-draft-model-path")  # fmt: skip
        return "mtp"
    if algo in ("EAGLE", "EAGLE3") and path is None:
        raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
    if args.speculative_num_draft_tokens < 0:
        raise ValueError(
            f"--speculative-num-draft-tokens must be >= 0, got {args.speculative_num_draft_tokens}"
        )
    return path


def _group_lines(p: Plan) -> list[str]:
    """One line per layer group: layers, page space, pages or slots, bytes per row, bytes."""
    spaces = p.page_spaces
    out = []
    for g in p.groups:
        head = f"{g.name}: {len(g.layers)} layer{'s' if len(g.layers) != 1 else ''}"
        if g.page_space is None:
            out.append(f"{head}, reuse the KV of other layers (no bytes of their own)")
            continue
        s = spaces[g.page_space]
        if s["kind"] == "state":
            where = f"{s['num_pages']:,} state slots, {g.bytes_per_row:,} B/slot"
        else:
            where = (f"space {g.page_space}: {s['num_pages']:,} pages x {s['page_size']}, "
                     f"{g.bytes_per_row:,} B/token")  # fmt: skip
            if s["headroom_pages"]:
                where += f", {s['headroom_pages']:,} pages kept for a prefill chunk"
        if s["capped_by_int32"]:
            where += " (capped: int32 slot ids)"
        out.append(f"{head}, {where}, {g.bytes / GIB:.2f} GiB")
    return out


def _plans(
    spec: kvpool.ModelSpec, dtypes: list[str], kw: dict, *, keep_going: bool
) -> list[Plan | tuple[str, Exception]]:
    """A plan per dtype, under one budget.

    With ``keep_going`` a dtype-dependent error (see ``_PER_DTYPE``) stands in for that dtype's
    plan as ``(dtype, error)``; when every dtype fails the first error is raised, as it is for
    any other error and without ``keep_going``.
    """
    out: list[Plan | tuple[str, Exception]] = []
    for d in dtypes:
        try:
            out.append(kvpool.compare(spec, [d], **kw)[0])
        except _PER_DTYPE as e:
            if not keep_going:
                raise
            out.append((d, e))
    if not any(isinstance(r, Plan) for r in out):
        raise out[0][1]  # type: ignore[index]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpool`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    console = Console(soft_wrap=True)
    try:
        if args.command == "models":
            for m in bundled_models():
                print(m)
            return 0
        return _size(args, console)
    except (ValueError, MemoryError, OverflowError, TypeError, ImportError, OSError) as e:
        # ModelConfigError (a bad model file) is a ValueError; ImportError: `--plot` without
        # matplotlib; OSError: an unwritable `--plot` file. The message is escaped: it quotes
        # paths and file contents, and rich would take `[/x]` in them for markup and raise.
        Console(stderr=True, soft_wrap=True).print(
            f"[red]error:[/] {type(e).__name__}: {escape(for_cli(str(e)))}", highlight=False
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
