"""Small helpers shared by the Triton wrappers."""

from __future__ import annotations

import torch
import triton


def check(cond: bool, msg: str) -> None:
    """Precondition of a kernel wrapper: a one-line message instead of a crash inside the kernel."""
    if not cond:
        raise ValueError(msg)


def same_device(*tensors: torch.Tensor) -> bool:
    return len({t.device for t in tensors}) <= 1


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def on_interpreter(t: torch.Tensor) -> bool:
    """CPU tensors only reach a Triton kernel under TRITON_INTERPRET=1 (the tests)."""
    return t.device.type == "cpu"
