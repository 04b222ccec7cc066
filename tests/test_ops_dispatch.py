"""Op dispatch follows the device of the tensors, not the machine: a CPU tensor gets the native op even where an
accelerated version is registered for another device type."""

import logging

import pytest
import torch

from sparkspec.ops import registry
from sparkspec.platform import op_backend


@pytest.fixture
def fake_op(monkeypatch):
    """Op 'fake_scale' with a native version and a 'cuda' version, kernels marked as loaded (no triton import)."""
    monkeypatch.setattr(registry, "_kernels_loaded", True)
    monkeypatch.setitem(registry._NATIVE, "fake_scale", lambda x, s=2: x * s)
    monkeypatch.setitem(registry._ACCEL, (op_backend("cuda"), "fake_scale"), lambda x, s=2: x * s + 1000)
    table = registry.OpTable()
    yield table


def test_cpu_tensors_get_native_even_with_a_cuda_registration(fake_op):
    assert fake_op.fake_scale(torch.ones(2)).tolist() == [2.0, 2.0]
    assert fake_op.implementation("fake_scale", "cpu") == "native"
    assert fake_op.resolve("fake_scale", "cuda")(torch.ones(1)).item() == 1002.0
    assert fake_op.implementation("fake_scale", "cuda").startswith(op_backend("cuda") + ":")
    assert fake_op.resolve("fake_scale", "mps") is registry._NATIVE["fake_scale"]  # no registration: native


def test_dispatch_reads_the_first_tensor_argument_and_caches(fake_op):
    assert fake_op.fake_scale(s=3, x=torch.ones(1)).item() == 3.0  # keyword tensor
    assert ("fake_scale", "cpu") in fake_op._impl
    fake_op._impl[("fake_scale", "cpu")] = lambda x, s=2: x - 1  # the cache is what a call consults
    assert fake_op.fake_scale(torch.ones(1)).item() == 0.0
    fake_op.set_native(True)  # clears the cache; every device type gets the reference
    assert fake_op.resolve("fake_scale", "cuda") is registry._NATIVE["fake_scale"]


def test_rocm_builds_register_under_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert op_backend("cuda") == "rocm"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert (op_backend("cuda"), op_backend("xpu"), op_backend("cpu"), op_backend("meta")) == \
        ("cuda", "xpu", "native", "native")


def test_a_failed_kernel_import_is_logged_once(monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_triton(name, globals=None, locals=None, fromlist=(), level=0):
        if "triton_kernels" in name or "triton_kernels" in (fromlist or ()):
            raise ImportError("No module named 'triton' (simulated)")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(registry, "_kernels_loaded", False)
    monkeypatch.setattr(builtins, "__import__", no_triton)
    with caplog.at_level(logging.WARNING, logger="sparkspec.ops"):
        registry._load_kernels()
        registry._load_kernels()
    warnings = [r for r in caplog.records if "Triton kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "simulated" in warnings[0].getMessage()


def test_unknown_op_names_the_known_ones():
    with pytest.raises(AttributeError, match="sparse_attention"):
        _ = registry.OpTable().no_such_op
