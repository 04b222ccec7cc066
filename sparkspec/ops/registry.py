"""The op table: every compute-heavy op has a plain PyTorch reference ("native") and may have faster
versions per platform. The implementation is chosen once per process, from `sparkspec.platform`;
models call `ops.<name>(...)` and never branch on the device. The native version is the test oracle.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from sparkspec.platform import current_platform

_NATIVE: dict[str, Callable[..., Any]] = {}
_ACCEL: dict[tuple[str, str], Callable[..., Any]] = {}  # (platform, op) -> impl


def native(name: str):
    """Register the PyTorch reference of op `name`."""

    def wrap(fn):
        _NATIVE[name] = fn
        return fn

    return wrap


def accelerated(name: str, *platforms: str):
    """Register a faster implementation of op `name` for the given platforms."""

    def wrap(fn):
        for p in platforms:
            _ACCEL[(p, name)] = fn
        return fn

    return wrap


class OpTable:
    """Resolved op table; attribute access returns the chosen implementation."""

    def __init__(self, platform: str, use_native: bool = False):
        self.platform = platform
        self.use_native = use_native
        self._resolved: dict[str, Callable[..., Any]] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        fn = self._resolved.get(name)
        if fn is None:
            _load_all()
            if name not in _NATIVE:
                raise AttributeError(f"unknown op '{name}'; known: {sorted(_NATIVE)}")
            fn = _NATIVE[name] if self.use_native else _ACCEL.get((self.platform, name), _NATIVE[name])
            self._resolved[name] = fn
        return fn

    def implementation(self, name: str) -> str:
        fn = getattr(self, name)
        return "native" if fn is _NATIVE[name] else f"{self.platform}:{fn.__module__}.{fn.__name__}"


_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from sparkspec.ops import attention, compressor, indices, mhc, moe, sampling  # noqa: F401

    if current_platform().has_triton and current_platform().is_accelerator:
        try:
            from sparkspec.ops import triton_kernels  # noqa: F401
        except ImportError:
            pass


ops = OpTable(current_platform().name, use_native=os.environ.get("SPARKSPEC_NATIVE_OPS") == "1")
native_ops = OpTable("native", use_native=True)
