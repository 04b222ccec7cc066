"""Triton versions of the compute-heavy ops, registered for cuda / rocm / xpu through the op table.

Each kernel sits behind a thin wrapper that checks its preconditions (one-line messages), allocates the
output, computes the grid and launches. Portability rules (Triton 3.6 on GPUs, 3.9 in the CPU
interpreter): pointers + masks, no block pointers, no autotune, every bf16 load upcast to fp32 before
arithmetic and before `tl.dot`. The PyTorch natives in `sparkspec.ops.*` are the oracles.
"""

from sparkspec.ops.triton_kernels import attention, compressor, indices, mhc, moe_route, rope  # noqa: F401  (registers)
