"""A page's bytes out of a :class:`~kvpool.KVPool` and back: every buffer, bytes unchanged.

A page of the primary page space (full-attention, MLA and draft layers) lives in several
buffers: each layer's ``k``/``v`` (or MLA ``kv``) data rows, their block scales (nvfp4,
fp4_mx_block16; row-major or page-major), and the layer's per-tensor scale (fp8, nvfp4 global
scale) that gives the bytes their meaning. :class:`PageLayout` lists them once per plan;
:meth:`PageLayout.read` gathers the bytes of a set of pages with one gather per buffer
(numpy fancy indexing on the CPU, ``index_select`` on a GPU), :meth:`PageLayout.write` scatters
them back into other page ids with one scatter per buffer. Nothing is converted: fp8, FP4
nibbles and ue8m0/e4m3 scales move as the bytes they are, so a page read from one pool and
written into another is bit-identical.

A page's bytes are ``page_bytes`` uint8 values: the per-page buffers in ``plan.buffers`` order,
each contributing ``page_size`` rows of its row bytes (``block_scale_page_major`` buffers: their
one page-major block). Per-tensor scales (``role == "scale"``, shape ``(1,)`` fp32) are not
per page: :meth:`PageLayout.scale_bytes` returns them, in ``plan.buffers`` order, for a store to
check that two pools agree. Workspaces (scratch) hold nothing to move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool._torch import torch
from kvpool.host_plan import PER_PAGE_ROLES as PAGE_ROLES  # the host tier's: one list of roles

if TYPE_CHECKING:
    from kvpool.pool import KVPool


@dataclass(frozen=True)
class Section:
    """One buffer's part of a page.

    ``name`` (``plan.buffers`` name), ``dtype`` (torch dtype name), ``page_shape`` (the buffer's
    shape with its first dimension cut to one page: ``page_size`` rows, or 1 page-major block)
    and ``nbytes`` (bytes per page).
    """

    name: str
    dtype: str
    page_shape: tuple[int, ...]
    nbytes: int


class PageLayout:
    """Which bytes of a pool make up a page, and how to move them.

    Parameters
    ----------
    pool : KVPool
        The pool (any device). Its per-page buffers must all be in the ``primary`` page space.

    Attributes
    ----------
    sections : list of Section
        The per-page buffers, in ``plan.buffers`` order.
    scales : list of str
        Names of the per-tensor scale buffers, in ``plan.buffers`` order.
    page_bytes : int
        Bytes of one page over every section.

    Raises
    ------
    ValueError
        The plan has per-page buffers outside the primary page space (sliding-window groups)
        or linear-attention state: a page id there names different tokens, so such pools are
        not supported (the message names the buffer).
    """

    def __init__(self, pool: KVPool):
        plan = pool.plan
        self.pool = pool
        self.page_size = plan.page_size
        self.num_pages = plan.num_pages
        self.sections: list[Section] = []
        self.scales: list[str] = []
        self._flat: list[torch.Tensor] = []
        for b in plan.buffers:
            if b.role == "workspace":
                continue
            if b.role == "state" or (b.role in PAGE_ROLES and b.space != "primary"):
                raise ValueError(
                    f"buffer `{b.name}` (role {b.role}, space {b.space}) is not in the primary "
                    "page space: pages of sliding-window or linear-attention groups cannot be "
                    "moved by page id (hybrid models are not supported)"
                )
            if b.role == "scale":
                self.scales.append(b.name)
                continue
            t = pool.buffers[b.name]
            blocks = self.num_pages + 1
            rows_per_page, rem = divmod(b.shape[0], blocks)
            if rem or rows_per_page not in (1, self.page_size):
                raise ValueError(
                    f"buffer `{b.name}` has {b.shape[0]} rows, not (num_pages + 1) = {blocks} "
                    f"pages of 1 or {self.page_size} rows"
                )
            # [pages + 1, bytes per page], a view of the buffer's memory
            flat = t.view(torch.uint8).reshape(blocks, -1)
            self._flat.append(flat)
            self.sections.append(
                Section(b.name, b.dtype, (rows_per_page, *b.shape[1:]), flat.shape[1])
            )
        self.page_bytes = sum(s.nbytes for s in self.sections)

    def check_pages(self, pages: np.ndarray | torch.Tensor) -> None:
        """Raise the error :meth:`read` raises for bad ``pages``, else nothing."""
        self._host_index(pages)

    def _index(self, pages: np.ndarray | torch.Tensor) -> torch.Tensor:
        return self._host_index(pages).to(self.pool.device)

    def _host_index(self, pages: np.ndarray | torch.Tensor) -> torch.Tensor:
        """``pages`` checked, as a CPU int64 tensor (checks on the host: no device sync)."""
        idx = torch.as_tensor(np.asarray(pages), dtype=torch.int64)
        if idx.ndim != 1:
            raise ValueError(f"`pages` must be 1-D, got shape {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 1 or int(idx.max()) > self.num_pages):
            bad = idx[(idx < 1) | (idx > self.num_pages)][0].item()
            raise ValueError(
                f"`pages` holds page id {bad}: ids are 1..{self.num_pages} (0 is padding)"
            )
        return idx

    def read(
        self, pages: np.ndarray | torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The bytes of ``pages``: ``[len(pages), page_bytes]`` uint8 on the pool's device.

        One gather per section (row ``i`` is page ``pages[i]``): numpy fancy indexing on a CPU
        pool (a ``memcpy`` per row; torch's CPU ``index_select`` on uint8 runs 5-10x slower),
        ``index_select`` and one concatenation on a GPU. ``out`` (CPU pools): a contiguous
        uint8 tensor of at least ``len(pages)`` rows to fill and return (its first rows).

        Raises
        ------
        ValueError
            ``pages`` is not 1-D or holds an id outside ``1..num_pages``; ``out`` too small.
        """
        idx = self._index(pages)
        n = idx.numel()
        if self.pool.device.type == "cpu":
            if out is None:
                out = torch.empty((n, self.page_bytes), dtype=torch.uint8)
            elif (
                out.dtype != torch.uint8 or out.shape[0] < n or out.shape[1:] != (self.page_bytes,)
            ):
                raise ValueError(f"`out` must be uint8 [>= {n}, {self.page_bytes}]")
            out = out[:n]
            dst, ix = out.numpy(), idx.numpy()
            off = 0
            for s, flat in zip(self.sections, self._flat, strict=True):
                dst[:, off : off + s.nbytes] = flat.numpy()[ix]
                off += s.nbytes
            return out
        parts = [flat.index_select(0, idx) for flat in self._flat]
        if not parts:
            return torch.empty((n, 0), dtype=torch.uint8, device=self.pool.device)
        return torch.cat(parts, dim=1)

    def write(self, pages: np.ndarray | torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` ``[len(pages), page_bytes]`` uint8 (any device) into ``pages``.

        One scatter per section (numpy on a CPU pool, ``index_copy_`` on a GPU); nothing is
        written when an argument is bad.

        Raises
        ------
        ValueError
            ``pages`` as in :meth:`read`, repeated ids, or ``data`` not uint8 of that shape.
        """
        idx = self._host_index(pages)
        if data.dtype != torch.uint8 or tuple(data.shape) != (idx.numel(), self.page_bytes):
            raise ValueError(
                f"`data` must be uint8 [{idx.numel()}, {self.page_bytes}], got "
                f"{data.dtype} {list(data.shape)}"
            )
        if torch.unique(idx).numel() != idx.numel():  # on the host: no device sync
            raise ValueError(f"`pages` repeats a page id: {idx.tolist()}")
        idx = idx.to(self.pool.device)
        cpu = self.pool.device.type == "cpu"
        data = data.to(self.pool.device)
        src, ix = (data.numpy(), idx.numpy()) if cpu else (None, None)
        off = 0
        for s, flat in zip(self.sections, self._flat, strict=True):
            if cpu:
                flat.numpy()[ix] = src[:, off : off + s.nbytes]
            else:
                flat.index_copy_(0, idx, data[:, off : off + s.nbytes])
            off += s.nbytes

    def scale_bytes(self) -> bytes:
        """The per-tensor scale buffers' bytes (fp32 each), in ``plan.buffers`` order."""
        if not self.scales:
            return b""
        ts = [self.pool.buffers[n].view(torch.uint8).reshape(-1) for n in self.scales]
        return torch.cat(ts).cpu().numpy().tobytes()
