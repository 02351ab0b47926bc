"""``kvpool.__version__``: the installed distribution's version, else ``pyproject.toml``'s.

A source checkout on ``PYTHONPATH`` (not installed) has no package metadata; its version is read
from the ``[project]`` table of the ``pyproject.toml`` beside ``python/``.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def _pyproject_version() -> str:
    p = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        m = re.search(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', p.read_text(), re.M | re.S)
    except OSError:
        m = None
    return m.group(1) if m else "0+unknown"


try:
    __version__ = version("kvpool")
except PackageNotFoundError:
    __version__ = _pyproject_version()
