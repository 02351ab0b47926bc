"""A picture of KV capacity: ``kvpool size MODEL --plot FILE.png``.

Left: tokens the pool holds per KV dtype under one budget, each bar labelled with the requests of
``context_len`` tokens that fit (:meth:`kvpool.Plan.requests_fit`, the CLI's ``requests``
column). Right: those requests as ``--mem-fraction-static`` goes from 0.5 to 0.95, each dtype
re-sized with :func:`kvpool.compare` under the same memory figures. Needs matplotlib
(``pip install 'kvpool[plot]'``); drawn with the Agg backend, so no display is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool._deps import require_pyplot
from kvpool.sizing import GIB, compare

if TYPE_CHECKING:
    from kvpool.config import ModelSpec
    from kvpool.sizing import Plan

#: The memory fractions of the right panel.
MEM_FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)


def requests_by_fraction(
    spec: ModelSpec, dtype: str, context_len: int, kw: dict[str, Any]
) -> list[tuple[float, int]]:
    """``(mem_frac, requests_fit(context_len))`` for each fraction of :data:`MEM_FRACTIONS`.

    ``kw`` are :func:`kvpool.size_for`'s keywords (its ``mem_frac`` is replaced); a fraction whose
    budget cannot hold the pool is left out.
    """
    out = []
    for f in MEM_FRACTIONS:
        try:
            plan = compare(spec, [dtype], **(kw | {"mem_frac": f}))[0]
        except (ValueError, MemoryError):  # SizingError and its kin: no budget at this fraction
            continue
        out.append((f, plan.requests_fit(context_len)))
    return out


def plot_capacity(
    path: str | Path,
    spec: ModelSpec,
    plans: list[Plan],
    context_len: int,
    *,
    gpu: str | None = None,
    kw: dict[str, Any] | None = None,
) -> Path:
    """Draw the capacity of ``plans`` (one per dtype, one budget) to ``path`` (PNG, SVG, PDF...).

    Parameters
    ----------
    path : str or path
        Output file; the format follows the suffix (matplotlib's ``savefig``).
    spec : ModelSpec
        The model the plans were sized for (named in the title).
    plans : list of Plan
        One plan per KV dtype, sized under the same budget.
    context_len : int
        Tokens per request for the requests figures.
    gpu : str, optional
        GPU name for the title.
    kw : dict, optional
        :func:`kvpool.size_for` keywords the plans were sized with; given, the right panel
        sweeps ``mem_frac`` over :data:`MEM_FRACTIONS`, else only the bars are drawn.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ImportError
        matplotlib is missing (names the ``plot`` extra).
    ValueError
        ``plans`` is empty.
    """
    if not plans:
        raise ValueError("`plans` is empty: nothing to draw")
    plt = require_pyplot()
    path = Path(path)
    ncols = 2 if kw is not None else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.2 * ncols, 4.4), squeeze=False)
    ax = axes[0][0]
    names = [p.dtype for p in plans]
    tokens = [p.num_tokens / 1e6 for p in plans]
    bars = ax.bar(names, tokens, color="#4c72b0")
    for b, p in zip(bars, plans, strict=True):
        ax.annotate(f"{p.requests_fit(context_len):,} req", (b.get_x() + b.get_width() / 2,
                    b.get_height()), ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylabel("tokens in the pool (millions)")
    ax.set_title(f"tokens per dtype; requests of {context_len:,} tokens", fontsize=10)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.margins(y=0.12)
    if kw is not None:
        ax2 = axes[0][1]
        # Dtypes of the same bytes per token size alike: one line for them ("bf16 = fp16").
        same: dict[tuple[int, int], list[Plan]] = {}
        for p in plans:
            same.setdefault((p.bytes_per_token, p.fixed_bytes), []).append(p)
        for group in same.values():
            pts = requests_by_fraction(spec, group[0].dtype, context_len, kw)
            if pts:
                label = " = ".join(p.dtype for p in group)
                ax2.plot(*zip(*pts, strict=True), marker="o", ms=3, label=label)
        ax2.set_xlabel("--mem-fraction-static")
        ax2.set_ylabel(f"requests of {context_len:,} tokens")
        ax2.set_title("requests as the memory fraction grows", fontsize=10)
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)
    b = plans[0].budget
    where = f" on {gpu}" if gpu else ""
    budget = f", KV budget {b.budget / GIB:.2f} GiB" if b is not None else ""
    fig.suptitle(
        f"{spec.name}{where}: tp_size {plans[0].tp_size}, page_size {plans[0].page_size}"
        f"{budget}", fontsize=11,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
