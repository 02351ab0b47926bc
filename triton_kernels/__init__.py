"""Triton kernels of kvpool (``@triton.jit`` code only; launchers live in ``python/kvpool``).

Imported as ``kvpool.triton_kernels`` (``python/kvpool/triton_kernels`` links here), never as a
top-level ``triton_kernels``: that import name belongs to Triton's own kernel package.
"""
