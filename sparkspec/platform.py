"""Which device family the machine has (cuda | rocm | xpu | cpu), detected once: it picks the default device and
dtype. Ops do not use it: they dispatch on the device of their tensors (`op_backend`, `sparkspec.ops.registry`)."""

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


def op_backend(device_type: str) -> str:
    """The op-registration key for tensors of `device_type`: cpu -> native; a "cuda" tensor is cuda or rocm
    depending on the torch build (HIP reuses the cuda device type); xpu -> xpu; anything else (mps, meta) native."""
    if device_type == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return device_type if device_type == "xpu" else "native"


def available_device_types() -> list[str]:
    """Device types this process can put tensors on, cpu first."""
    types = ["cpu"]
    if torch.cuda.is_available():
        types.append("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        types.append("xpu")
    return types


def check_device(name: str | None, flag: str = "--device") -> torch.device | None:
    """A device flag's value -> the torch.device, checked usable by this process before anything loads (None stays
    None: the platform default). ValueError naming the flag for a name torch does not parse, a device type this
    torch build or machine lacks (`--device cuda` on a CPU-only torch), or an index past the device count."""
    if name is None:
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"{flag} {name!r}: not a device (expected cpu, cuda, cuda:N, xpu or xpu:N)") from None
    available = available_device_types()
    if device.type not in available:
        built = {"cuda": torch.backends.cuda.is_built(), "xpu": hasattr(torch, "xpu")}
        if device.type not in built:
            why = "sparkspec runs on cpu, cuda or xpu devices"
        elif built[device.type]:
            why = f"no {device.type} device is visible to this process"
        else:
            why = f"this torch ({torch.__version__}) has no {device.type.upper()} support"
        raise ValueError(f"{flag} {name}: {why} (available: {', '.join(available)})")
    if device.index is not None and device.type != "cpu":
        count = (torch.cuda if device.type == "cuda" else torch.xpu).device_count()
        if device.index >= count:
            raise ValueError(f"{flag} {name}: device index {device.index} out of range ({count} {device.type} "
                             f"device{'s' if count != 1 else ''})")
    return device


def _version(module: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_lines() -> list[str]:
    """`sparkspec env`'s platform, library versions and devices (the CLI adds the op table)."""
    plat = current_platform()
    hip = getattr(torch.version, "hip", None)
    lines = [f"platform      {plat.name} (default device {plat.device})",
             f"torch         {torch.__version__}" + (f" (HIP {hip})" if hip else
                                                      f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""),
             f"triton        {_version('triton')}", f"transformers  {_version('transformers')}", "", "devices:"]
    import os

    lines.append(f"  cpu     {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    for kind, mod in (("cuda", torch.cuda), ("xpu", getattr(torch, "xpu", None))):
        if kind in available_device_types():
            for i in range(mod.device_count()):
                props = mod.get_device_properties(i)
                lines.append(f"  {kind}:{i}  {props.name}, {props.total_memory / 2**30:.1f} GiB")
    return lines


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
