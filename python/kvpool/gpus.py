"""Memory of real GPUs, for sizing without a device at hand.

Bytes are the total memory the driver reports (``nvidia-smi``'s MiB figure x 2^20, which is what
``torch.cuda.mem_get_info()[1]`` returns), not the marketing GB. Free memory at start-up is a
little lower (the CUDA context takes some hundreds of MiB); pass ``total_memory`` when you have
measured it.
"""

from __future__ import annotations

from kvpool._core import SizingError

_MIB = 1 << 20

#: name -> (total bytes, note)
GPUS: dict[str, tuple[int, str]] = {
    "H100": (81559 * _MIB, "H100 SXM/PCIe 80GB (HBM3)"),
    "H100-NVL": (95830 * _MIB, "H100 NVL 94GB"),
    "H200": (143771 * _MIB, "H200 SXM 141GB (as seen on the H200 this project measures on)"),
    "H20": (97871 * _MIB, "H20 96GB"),
    "B200": (183359 * _MIB, "B200 180GB"),
    "A100-40GB": (40960 * _MIB, "A100 40GB"),
    "A100-80GB": (81920 * _MIB, "A100 80GB"),
    "L4": (23034 * _MIB, "L4 24GB"),
    "L40S": (46068 * _MIB, "L40S 48GB"),
    "RTX-4090": (24564 * _MIB, "GeForce RTX 4090 24GB"),
    "RTX-5090": (32607 * _MIB, "GeForce RTX 5090 32GB"),
    "GB10": (128 * 1024 * _MIB, "DGX Spark GB10, 128 GiB unified memory shared with the CPU"),
}

_ALIASES = {"A100": "A100-80GB", "4090": "RTX-4090", "5090": "RTX-5090", "SPARK": "GB10"}


def gpu_memory(name: str) -> int:
    """Total memory of a GPU by name, in bytes.

    Names are case-insensitive; ``_``, spaces and ``-`` are interchangeable.

    Raises
    ------
    SizingError
        Unknown GPU name (the message lists the known ones).
    """
    key = str(name).upper().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in GPUS:
        raise SizingError(f"unknown GPU `{name}`; known: {', '.join(GPUS)}")
    return GPUS[key][0]
