"""The op table: every compute-heavy op has a plain PyTorch reference ("native") and may have faster versions
registered per backend (cuda, rocm, xpu). Models call `ops.<name>(...)` and never branch on the device.

The implementation is picked per call by the device of the op's first tensor argument, not by the machine:
a CPU tensor runs the native op even on a GPU machine (`--device cpu`), a cuda tensor the cuda (or, on a HIP
build, rocm) registration. The choice is cached per (op, device type), so dispatch costs a dict lookup.
The native version is the test oracle. In batch-invariant mode (`set_batch_invariant`, see
`sparkspec.ops.batch_invariant`) an op's `invariant` registration, where it has one, replaces its accelerated
version: the same result for a row whatever the number of rows in the call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from sparkspec.platform import current_platform, op_backend

log = logging.getLogger("sparkspec.ops")

_NATIVE: dict[str, Callable[..., Any]] = {}
_ACCEL: dict[tuple[str, str], Callable[..., Any]] = {}  # (backend, op) -> impl
_INVARIANT: dict[tuple[str, str], Callable[..., Any]] = {}  # (backend, op) -> batch-invariant impl


def native(name: str):
    """Register the PyTorch reference of op `name`."""

    def wrap(fn):
        _NATIVE[name] = fn
        return fn

    return wrap


def accelerated(name: str, *backends: str):
    """Register a faster implementation of op `name` for the given backends (cuda | rocm | xpu)."""

    def wrap(fn):
        for b in backends:
            _ACCEL[(b, name)] = fn
        return fn

    return wrap


def invariant(name: str, *backends: str):
    """Register the batch-invariant implementation of op `name` for the given backends: used instead of the
    `accelerated` one while the table's batch-invariant mode is on."""

    def wrap(fn):
        for b in backends:
            _INVARIANT[(b, name)] = fn
        return fn

    return wrap


def _device_type(args: tuple, kwargs: dict) -> str:
    """Device type of the first tensor argument (positional first); 'cpu' when there is none."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


class OpTable:
    """`table.<name>(...)` calls the implementation of op `name` for its tensors' device type."""

    def __init__(self, use_native: bool = False):
        self.use_native = use_native
        self.batch_invariant = False
        self.compiled: frozenset[str] = frozenset()
        self._impl: dict[tuple[str, str], Callable[..., Any]] = {}  # (op, device type) -> implementation

    def set_native(self, use_native: bool, compiled: tuple[str, ...] = ()) -> None:
        """Force the PyTorch references everywhere (training needs autograd through every op); the references of
        `compiled` run through torch.compile on accelerator tensors (CPU tensors keep the plain reference)."""
        self.use_native = use_native
        self.compiled = frozenset(compiled)
        self._impl.clear()

    def set_batch_invariant(self, enabled: bool) -> None:
        """Prefer the `invariant` registrations on accelerators (`sparkspec.ops.batch_invariant`)."""
        self.batch_invariant = bool(enabled)
        self._impl.clear()

    def resolve(self, name: str, device_type: str) -> Callable[..., Any]:
        """The implementation of op `name` for tensors on `device_type` ('cpu', 'cuda', 'xpu', ...)."""
        fn = self._impl.get((name, device_type))
        if fn is None:
            _load_all()
            if name not in _NATIVE:
                raise AttributeError(f"unknown op '{name}'; known: {sorted(_NATIVE)}")
            backend = op_backend(device_type)
            if backend != "native" and not self.use_native:
                _load_kernels()
            fn = _NATIVE[name] if self.use_native else _ACCEL.get((backend, name), _NATIVE[name])
            if self.batch_invariant and not self.use_native:
                fn = _INVARIANT.get((backend, name), fn)
            if fn is _NATIVE[name] and name in self.compiled and device_type != "cpu":
                fn = compiled_native(name)
            self._impl[(name, device_type)] = fn
        return fn

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        _load_all()
        if name not in _NATIVE:
            raise AttributeError(f"unknown op '{name}'; known: {sorted(_NATIVE)}")
        impl = self._impl

        def dispatch(*args, **kwargs):
            key = (name, _device_type(args, kwargs))
            fn = impl.get(key)
            if fn is None:
                fn = self.resolve(*key)
            return fn(*args, **kwargs)

        dispatch.__name__ = dispatch.__qualname__ = name
        dispatch.__doc__ = _NATIVE[name].__doc__
        object.__setattr__(self, name, dispatch)  # later lookups skip __getattr__
        return dispatch

    def implementation(self, name: str, device_type: str | None = None) -> str:
        """'native', or '<backend>:<module>.<function>' of the implementation `device_type` tensors get
        (default: the machine's default device)."""
        device_type = device_type or current_platform().device.type
        fn = self.resolve(name, device_type)
        if fn is _NATIVE[name]:
            return "native"
        return f"{op_backend(device_type)}:{fn.__module__}.{fn.__name__}"


_COMPILED: dict[str, Callable[..., Any]] = {}


def compiled_native(name: str, backend: str = "inductor") -> Callable[..., Any]:
    """The reference of op `name` through torch.compile (dynamic shapes: a training step's token count varies),
    made once per op. If compiling fails, the reason is logged once and the plain reference runs from then on."""
    if name in _COMPILED:
        return _COMPILED[name]
    import torch._dynamo

    # one op is called with several ranks / optional arguments (rope: q, kv, inverse, with or without a norm); past
    # dynamo's default of 8 variants per function the rest would silently run uncompiled
    torch._dynamo.config.recompile_limit = max(getattr(torch._dynamo.config, "recompile_limit", 8), 32)
    ref = _NATIVE[name]
    fast = torch.compile(ref, dynamic=True, backend=backend)
    state = {"ok": True}

    def call(*args, **kwargs):
        if state["ok"]:
            try:
                return fast(*args, **kwargs)
            except Exception as e:  # a compiler that cannot build here: correct, slower
                state["ok"] = False
                log.warning("torch.compile of op %s failed, running its reference: %s: %s", name,
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return ref(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"compiled_{name}"
    call.__wrapped__ = ref
    _COMPILED[name] = call
    return call


def op_names() -> list[str]:
    _load_all()
    return sorted(_NATIVE)


def implementation_table(device_types: list[str] | None = None) -> dict[str, dict[str, str]]:
    """{device type: {op: 'native' | short module of the accelerated version}} for `sparkspec env`."""
    from sparkspec.platform import available_device_types

    table = {}
    for dt in device_types or available_device_types():
        row = {}
        for name in op_names():
            impl = ops.implementation(name, dt)
            row[name] = impl if impl == "native" else impl.split(":", 1)[1].removeprefix("sparkspec.ops.")
        table[dt] = row
    return table


_loaded = False
_kernels_loaded = False


def _load_all() -> None:
    """Import the modules that register native ops (lazily: they import this module)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from sparkspec.ops import (  # noqa: F401
        attention,
        batch_invariant,
        compressor,
        head,
        indices,
        linear,
        mhc,
        moe,
        quant,
        rope,
        sampling,
    )


def _load_kernels() -> None:
    """Import the Triton kernels the first time an accelerator tensor reaches an op. Not earlier: importing triton
    fixes its interpreter mode for the process. A failure is logged once, naming the error: the ops then run
    their native versions, correct but slower, and the user should know why."""
    global _kernels_loaded
    if _kernels_loaded:
        return
    _kernels_loaded = True
    try:
        from sparkspec.ops import triton_kernels  # noqa: F401
    except Exception as e:  # ImportError, or a triton that fails on this driver / torch build
        log.warning("Triton kernels unavailable, accelerator ops fall back to native PyTorch: %s: %s",
                    type(e).__name__, e)


ops = OpTable(use_native=os.environ.get("SPARKSPEC_NATIVE_OPS") == "1")
native_ops = OpTable(use_native=True)
