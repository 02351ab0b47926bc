"""Integer arguments that are not bools, one rule for every room's checks.

Python's bool is an int subclass, and numpy/torch bool scalars and 0-d tensors index as 0 or 1,
so ``alloc(True)``, ``tp_size=torch.tensor(True)`` or ``layer=np.True_`` would pass as counts.
Each room raises its own exception around :func:`as_index` (the message names the argument
there); the Rust bindings apply the same rule in ``rust/src/py/array.rs`` (``Int``).
"""

from __future__ import annotations

import operator
from typing import Any


def is_bool(x: Any) -> bool:
    """Whether ``x`` is a bool: Python's, or a numpy/torch value of bool dtype."""
    return isinstance(x, bool) or str(getattr(x, "dtype", "")) in ("bool", "torch.bool")


def as_index(x: Any) -> int:
    """``x`` as a Python int.

    Ints and anything with ``__index__`` pass (numpy integers, integer 0-d tensors).

    Raises
    ------
    TypeError
        A bool (:func:`is_bool`), a float, a string or any other non-integer.
    """
    if is_bool(x):
        raise TypeError(f"a bool is not an integer: {x!r}")
    return operator.index(x)
