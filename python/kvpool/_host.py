"""Host arrays into the pool's device: numpy int32 batch metadata as torch tensors, no sync.

The Rust batch helpers (:func:`kvpool.page_table`, :func:`kvpool.extend_slots`,
:func:`kvpool.decode_slots`) return numpy int32 arrays; the write and attention entry points
take them as they are (issue 21, point 1) through :func:`as_device_tensor`: one copy per
array, through pinned host memory with ``non_blocking=True`` on CUDA, so the host never waits
for the GPU (the pinned block is released to torch's caching host allocator, which keeps it until
the copy has run).
"""

from __future__ import annotations

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
