"""kvpool: a KV-cache manager for people who write their own LLM serving loops.

Sizing (``size_for``, ``ModelSpec``) needs neither torch nor triton; ``KVPool`` and the kernels
import torch when used.
"""

from kvpool._core import (
    ArrayTypeError,
    BatchError,
    BudgetTooSmallError,
    CacheBusyError,
    InvalidArgumentError,
    KvDtypeError,
    LayoutError,
    LockError,
    ModelConfigError,
    OutOfPagesError,
    PageAllocator,
    PageError,
    PinBudgetError,
    RadixCache,
    RadixNode,
    SizingError,
    StaleNodeError,
    StateSlotAllocator,
    assign_pages,
    decode_slots,
    extend_slots,
    page_hashes,
    page_table,
    pages_needed,
    release_window_pages,
    rollback_slots,
)
from kvpool._version import __version__ as __version__
from kvpool.config import ModelSpec
from kvpool.sizing import KV_DTYPES, Plan, compare, size_for

__all__ = [
    "KV_DTYPES",
    "ArrayTypeError",
    "BatchError",
    "BudgetTooSmallError",
    "CacheBusyError",
    "InvalidArgumentError",
    "KVPool",
    "KvDtypeError",
    "LayoutError",
    "LockError",
    "ModelConfigError",
    "ModelSpec",
    "OutOfPagesError",
    "PackedUpload",
    "PageAllocator",
    "PageError",
    "PinBudgetError",
    "Plan",
    "RadixCache",
    "RadixNode",
    "SizingError",
    "StaleNodeError",
    "StateSlotAllocator",
    "assign_pages",
    "compare",
    "decode_slots",
    "extend_slots",
    "page_hashes",
    "page_table",
    "pages_needed",
    "release_window_pages",
    "rollback_slots",
    "size_for",
    "to_device_packed",
]


def __getattr__(name: str):
    # KVPool, to_device_packed and PackedUpload need torch; import them only when asked so
    # `import kvpool` stays light.
    if name == "KVPool":
        from kvpool.pool import KVPool

        return KVPool
    if name == "to_device_packed":
        from kvpool._host import to_device_packed

        return to_device_packed
    if name == "PackedUpload":
        from kvpool._host import PackedUpload

        return PackedUpload
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
