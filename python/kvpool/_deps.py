"""Optional dependencies, imported with an error that names the extra to install.

Sizing and bookkeeping need neither torch nor matplotlib; the pool, the kernels and
``kvpool size --plot`` do; the page store needs redis and xxhash. ``pyproject.toml`` lists the
extras (``torch``, ``plot``, ``store``).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def missing(module: str, extra: str, what: str) -> ImportError:
    """The error for a missing optional dependency: what needs it, and the extra to install."""
    return ImportError(
        f"{what} needs {module}, which is not installed: pip install 'kvpool[{extra}]'"
    )


def require(module: str, extra: str, what: str, package: str | None = None) -> ModuleType:
    """The module ``module`` (dotted name), imported.

    Raises
    ------
    ImportError
        :func:`missing`'s error, naming ``package`` (default ``module``), the PyPI name to
        install, and ``extra``; chained from the original ImportError.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing(package or module, extra, what) from e


def require_torch() -> ModuleType:
    """The ``torch`` module.

    Raises
    ------
    ImportError
        torch is missing; the message names the extra (``pip install 'kvpool[torch]'``).
    """
    return require("torch", "torch", "KVPool, kvpool.attention and kvpool.write")


def require_pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (writes files, needs no display).

    Raises
    ------
    ImportError
        matplotlib is missing; the message names the extra (``pip install 'kvpool[plot]'``).
    """
    try:
        mpl = importlib.import_module("matplotlib")
        mpl.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError as e:
        raise missing("matplotlib", "plot", "`kvpool size --plot`") from e


def require_redis() -> ModuleType:
    """The ``redis`` client package (Valkey and Redis servers alike).

    Raises
    ------
    ImportError
        redis is missing; the message names the extra (``pip install 'kvpool[store]'``).
    """
    return require("redis", "store", "kvpool.store")


def require_xxhash() -> ModuleType:
    """The ``xxhash`` package (the page store's XXH3-128 checksums).

    Raises
    ------
    ImportError
        xxhash is missing; the message names the extra (``pip install 'kvpool[store]'``).
    """
    return require("xxhash", "store", "kvpool.store")
