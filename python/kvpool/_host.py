"""Host arrays into the pool's device: numpy int32 batch metadata as torch tensors, no sync.

The Rust batch helpers (:func:`kvpool.page_table`, :func:`kvpool.extend_slots`,
:func:`kvpool.decode_slots`) return numpy int32 arrays; the write and attention entry points
take them as they are (issue 21, point 1) through :func:`as_device_tensor`: one copy per
array, through pinned host memory with ``non_blocking=True`` on CUDA, so the host never waits
for the GPU (the pinned block is released to torch's caching host allocator, which keeps it until
the copy has run).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from kvpool._torch import torch

_NP = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def as_device_tensor(name: str, x, device: torch.device, dtypes=(torch.int32,)):
    """``x`` on ``device`` if it is a numpy array of one of ``dtypes``, else ``x`` unchanged.

    Parameters
    ----------
    name : str
        The argument's name, for the error message.
    x : numpy.ndarray or anything
        A numpy array is converted; anything else (a torch tensor, None) is returned as it is,
        for the caller's own checks.
    device : torch.device
        The pool's device.
    dtypes : tuple of torch.dtype
        The integer dtypes accepted (int32; slots also int64).

    Returns
    -------
    torch.Tensor or the input
        A contiguous tensor on ``device`` with ``x``'s values (a new copy; on CPU a copy too,
        so that the caller may refill its array while the tensor is in use).

    Raises
    ------
    ValueError
        ``x`` is a numpy array of another dtype (named, with the dtypes accepted).
    """
    if not isinstance(x, np.ndarray):
        return x
    dt = _NP.get(x.dtype)
    if dt not in dtypes:
        want = " or ".join(str(d).replace("torch.", "numpy ") for d in dtypes)
        raise ValueError(f"`{name}` is a numpy {x.dtype} array, expected {want}")
    t = torch.from_numpy(np.ascontiguousarray(x))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, copy=True)


#: Byte alignment of each array in a packed copy: every view starts 16-byte aligned (what the
#: Triton kernels are specialized on: a view at another alignment would compile another kernel)
#: and on its own 64-byte line.
PACK_ALIGN = 64

_TORCH_OF: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dt: np.dtype) -> torch.dtype:
    t = _TORCH_OF.get(dt)
    if t is None:
        t = _TORCH_OF[dt] = torch.from_numpy(np.empty(0, dt)).dtype
    return t


def pack_layout(specs) -> tuple[list[int], int]:
    """Byte offsets of arrays packed one after another, and the total size in bytes.

    Each array starts at a multiple of :data:`PACK_ALIGN`. ``specs``: numpy arrays, or
    ``(shape, numpy dtype)`` pairs.
    """
    key = tuple(
        (sp.shape, sp.dtype) if isinstance(sp, np.ndarray) else (tuple(sp[0]), np.dtype(sp[1]))
        for sp in specs
    )
    offs, total = _layout(key)
    return list(offs), total


@functools.lru_cache(maxsize=256)
def _layout(key) -> tuple[tuple[int, ...], int]:
    # (a serving loop packs the same few shapes every step: computed once per shape set)
    offs, n = [], 0
    for shape, dt in key:
        offs.append(n)
        nbytes = math.prod(shape) * dt.itemsize
        n += -(-nbytes // PACK_ALIGN) * PACK_ALIGN
    return tuple(offs), max(n, PACK_ALIGN)


def packed_views(buf, specs, offs) -> list:
    """Views of a packed ``uint8`` buffer (a torch tensor or a numpy array) as arrays.

    ``specs``: ``(shape, numpy dtype)`` pairs, at byte offsets ``offs`` (a sequence of ints,
    :func:`pack_layout`). One view op per array (``as_strided`` of the buffer viewed once per
    dtype; numpy: an ``ndarray`` over the buffer): slicing, then viewing the dtype, then the
    shape costs three torch ops (~1 us each).
    """
    out = []
    if isinstance(buf, np.ndarray):
        for (shape, dt), o in zip(specs, offs, strict=True):
            out.append(np.ndarray(shape, dt, buffer=buf, offset=o))
        return out
    typed: dict = {}
    for (shape, dt), o in zip(specs, offs, strict=True):
        dt = np.dtype(dt)
        whole = typed.get(dt)
        if whole is None:
            whole = typed[dt] = buf.view(_torch_dtype(dt))  # (the offsets are 64-byte aligned)
        # (as_strided's offset counts from the storage's start, not the buffer's)
        at = whole.storage_offset() + o // dt.itemsize
        out.append(whole.as_strided(shape, _strides(tuple(shape)), at))
    return out


@functools.lru_cache(maxsize=256)
def _strides(shape) -> tuple[int, ...]:
    """C-contiguous strides (in elements) of ``shape`` (a tuple; cached: a loop's shapes recur)."""
    st, n = [], 1
    for d in reversed(shape):
        st.append(n)
        n *= max(d, 1)
    return tuple(reversed(st))


def to_device_packed(arrays, device: torch.device, out: torch.Tensor | None = None):
    """Several host arrays on ``device`` with one copy: views of one device buffer.

    The arrays are packed into one host buffer (on CUDA pinned, from torch's caching host
    allocator, which keeps it until the copy has run) and copied with one ``non_blocking`` copy
    (no host sync); each result is a view of one ``uint8`` device buffer at a
    :data:`PACK_ALIGN`-byte aligned offset. Separate pinned copies cost ~20 us of host time
    each (run 13 on the H200: 67 us for a page table, seq_lens and slots at B=256).

    Parameters
    ----------
    arrays : sequence of numpy.ndarray
        Numeric arrays of any shape (copied as C-contiguous).
    device : torch.device
        Where the tensors go. On a CPU device (and no ``out``) each array is copied into a
        tensor of its own.
    out : torch.Tensor, optional
        A contiguous 1-D ``uint8`` buffer on ``device``, 16-byte aligned, of at least
        :func:`pack_layout`'s size to copy into (its first bytes are used; queued work that
        still reads it must be on the current stream); default a new one.

    Returns
    -------
    list of torch.Tensor
        One per array, same dtype and shape (new memory: the caller may refill its arrays).

    Raises
    ------
    ValueError
        ``out`` too small, not uint8, on another device, strided or not 16-byte aligned.
    """
    # (not np.ascontiguousarray: it makes a 0-d array 1-D)
    arrays = [
        a if a.flags.c_contiguous else np.array(a, order="C") for a in map(np.asarray, arrays)
    ]
    device = torch.device(device)
    if device.type == "cpu" and out is None:
        return [torch.from_numpy(a.copy()) for a in arrays]
    specs = [(a.shape, a.dtype) for a in arrays]
    offs, total = pack_layout(specs)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.device != device or out.dim() != 1 or out.numel() < total:
        raise ValueError(
            f"`out` is {out.dtype} {list(out.shape)} on {out.device}; the packed copy needs a "
            f"1-D uint8 buffer of >= {total} bytes on {device}"
        )
    elif out.stride(0) != 1 or out.data_ptr() % 16 or out.storage_offset() % 16:
        raise ValueError(
            f"`out` (stride {out.stride(0)}, address {out.data_ptr():#x}): the packed copy needs "
            "a contiguous buffer starting on a 16-byte boundary (its views are 16-byte aligned)"
        )
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for a, v in zip(arrays, packed_views(host.numpy(), specs, offs), strict=True):
        v[...] = a
    out = out[:total]
    out.copy_(host, non_blocking=True)
    return packed_views(out, specs, offs)


class PackedUpload:
    """A step's host arrays on the device with one copy, into reused device buffers.

    What :func:`to_device_packed` does, for a loop that uploads its batch metadata every step:
    the device side is a ring of ``depth`` buffers whose views are made once per shape set
    and handed out again, so a call costs one pinned host buffer (torch's caching host
    allocator, which keeps it until the copy has run), the fill and one ``non_blocking`` copy
    (H200 host, ``benches/step``: see ``h2d_upload`` against ``h2d_packed``).

    Parameters
    ----------
    device : torch.device or str
        Where the arrays go (on CPU the same ring, unpinned and copied at once: the same
        lifetime rules, testable without a GPU).
    depth : int
        Device buffers in the ring, >= 1 (default 2).

    Notes
    -----
    The tensors a call returns are views of ring buffer ``n % depth``: the call ``depth`` calls
    later copies new values into the same memory. The copy is queued on the current stream,
    so work already queued that reads the old values still reads them; what must not happen is
    work queued *after* that later call reading the old tensors (hold at most ``depth - 1``
    earlier steps' metadata live, on one stream). A plan (:func:`kvpool.attention.plan_decode`)
    keeps the tensors it was made from: make each step's plan from that step's upload.
    """

    def __init__(self, device, depth: int = 2):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"`depth` = {depth!r}: must be an int >= 1")
        self.device = torch.device(device)
        self.depth = depth
        self._pin = self.device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * depth
        # per ring slot: {shape set: device views}; cleared when the slot's buffer regrows
        self._views: list[dict] = [{} for _ in range(depth)]
        self._next = 0

    def __call__(self, arrays) -> list[torch.Tensor]:
        """``arrays`` on the device, as views of this call's ring buffer.

        ``arrays``: numpy arrays, or what ``numpy.asarray`` makes one of (any shapes, numeric
        dtypes).

        Returns
        -------
        list of torch.Tensor
            One per array, same dtype and shape, each at a :data:`PACK_ALIGN`-aligned offset of
            this call's ring buffer (valid as the class notes say).

        Raises
        ------
        TypeError
            An entry of a non-numeric dtype (named by its index); nothing is uploaded.
        """
        arrays = [a if type(a) is np.ndarray else np.asarray(a) for a in arrays]
        key = tuple((a.shape, a.dtype) for a in arrays)
        for i, (_, dt) in enumerate(key):
            if dt.kind not in "biuf":
                raise TypeError(f"`arrays[{i}]` is of dtype {dt}, expected a numeric array")
        offs, total = _layout(key)
        i = self._next
        self._next = (i + 1) % self.depth
        views = self._views[i].get(key)
        if views is None:
            buf = self._bufs[i]
            if buf is None or buf.numel() < total:
                # (grown to a power of two: a batch that grows by a row does not regrow it)
                size = 1 << max(total - 1, 255).bit_length()
                buf = self._bufs[i] = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._views[i].clear()
            if len(self._views[i]) >= 64:  # (bounded: a loop meets few shape sets)
                self._views[i].clear()
            views = self._views[i][key] = (buf[:total], packed_views(buf, key, offs))
        host = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
        for a, v in zip(arrays, packed_views(host.numpy(), key, offs), strict=True):
            v[...] = a
        views[0].copy_(host, non_blocking=True)
        return views[1]
