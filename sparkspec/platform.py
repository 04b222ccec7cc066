"""Which device family we run on (cuda | rocm | xpu | cpu) — detected once, used by the op table."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

Platform = Literal["cuda", "rocm", "xpu", "cpu"]


@dataclass(frozen=True)
class PlatformInfo:
    name: Platform
    device: torch.device
    has_triton: bool
    supports_bf16: bool

    @property
    def is_accelerator(self) -> bool:
        return self.name != "cpu"


def _has_triton() -> bool:
    # find_spec, not import: importing triton here would fix its interpreter mode (TRITON_INTERPRET) for the
    # whole process before the kernel tests can set it.
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@functools.cache
def current_platform() -> PlatformInfo:
    if torch.cuda.is_available():
        name: Platform = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return PlatformInfo(name, torch.device("cuda"), _has_triton(), True)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return PlatformInfo("xpu", torch.device("xpu"), _has_triton(), True)
    return PlatformInfo("cpu", torch.device("cpu"), _has_triton(), True)


def default_dtype(platform: PlatformInfo | None = None) -> torch.dtype:
    """bf16 on accelerators, fp32 on CPU (exactness of tests and speed of CPU matmuls)."""
    platform = platform or current_platform()
    return torch.bfloat16 if platform.is_accelerator else torch.float32


SMALL_MODEL_HIDDEN = 1024


def configure_cpu_threads(hidden_size: int) -> int:
    """Pick intra-op threads for CPU inference; returns the count in use.

    Small models are latency bound: their GEMMs are too small to split, so extra OpenMP threads only add
    synchronisation, and on a busy machine spinning threads slow every op by 10-40x (measured on 2 cores).
    They get one thread. `SPARKSPEC_NUM_THREADS` (or `OMP_NUM_THREADS`) overrides."""
    import os

    env = os.environ.get("SPARKSPEC_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if env:
        torch.set_num_threads(max(1, int(env)))
    elif hidden_size < SMALL_MODEL_HIDDEN:
        torch.set_num_threads(1)
    return torch.get_num_threads()
