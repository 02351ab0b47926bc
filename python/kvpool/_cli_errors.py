"""Library error messages in the command line's terms: flags for keyword names, GiB for bytes.

The library names its keyword arguments (```mem_frac```, ```total_memory=```) and counts bytes;
``kvpool size`` takes ``--mem-fraction-static`` and GiB (2^30 bytes), so its errors say that.
"""

from __future__ import annotations

import re

#: Keyword of :func:`kvpool.size_for` -> the ``kvpool size`` flag that sets it.
FLAGS = {
    "mem_frac": "--mem-fraction-static",
    "gpu": "--gpu",
    "total_memory": "--total-memory",
    "available_memory": "--available-memory",
    "weights": "--weights",
    "page_size": "--page-size",
    "tp_size": "--tp-size",
    "nvfp4_recipe": "--nvfp4-recipe",
    "model_dtype": "--model-dtype",
    "context_len": "--context-len",
}
_NAME = re.compile(r"`(" + "|".join(FLAGS) + r")=?`|\bmem_frac\b")
# A byte count, not a per-token/per-row size ("147,456 bytes per token" stays in bytes).
_BYTES = re.compile(r"\b(\d+) bytes\b(?! per)|(?<=, )(\d+)(?= more)")
_GIB = 1 << 30


def for_cli(message: str) -> str:
    """``message`` with keyword names as flags and byte counts of 1 MiB or more as GiB."""
    message = _NAME.sub(lambda m: f"`{FLAGS[m.group(1) or 'mem_frac']}`", message)
    message = message.replace(" in bytes", " in GiB")

    def gib(m: re.Match[str]) -> str:
        n = int(m.group(1) or m.group(2))
        return f"{n / _GIB:.2f} GiB" if n >= 1 << 20 else m.group(0)

    return _BYTES.sub(gib, message)
