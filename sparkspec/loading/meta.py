"""Models built on the meta device: no memory and no init work, each parameter already in the dtype it will be
loaded in, so that a loader (or a random initialiser) can shard the model and allocate only this rank's share.
What `__init__` computes (RoPE frequencies) is real, on the CPU (`MetaInit`), and `move_computed` puts it on the
device once the weights are in.
"""

from __future__ import annotations

import torch
from torch import nn

from sparkspec.config import ModelConfig
from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.dspark import DSparkDraftModel


class MetaInit(torch.overrides.TorchFunctionMode):
    """Inside `torch.device("meta")`: `torch.arange` (and so everything computed from it, the RoPE frequencies
    of `Attention.__init__`) runs on the CPU, so tensors that `__init__` computes are real, with the model's own
    values, while parameters and buffers that are only allocated stay on meta. Initialisers on meta tensors are
    skipped: they have no data to fill, and torch's meta kernels for them import sympy (~150 MB of host memory)."""

    INITS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                       "xavier_uniform_", "xavier_normal_", "orthogonal_", "zero_", "zeros_", "ones_", "fill_",
                       "constant_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.arange:
            kwargs["device"] = "cpu"
        elif getattr(func, "__name__", None) in self.INITS:
            target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def meta_model(cfg: ModelConfig, dtype: torch.dtype) -> DeepseekV4Model:
    """The target model on the meta device (no memory, no init work), each parameter already in the dtype it
    will be loaded in: `dtype`, or fp32 where `keep_fp32` keeps it (the model's own rule, not a copy of it).
    RoPE frequencies are real CPU tensors (`MetaInit`); `move_computed` puts them on the device."""
    with torch.device("meta"), MetaInit():
        model = DeepseekV4Model(cfg)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.keep_fp32()


def meta_drafter(cfg: ModelConfig, dtype: torch.dtype) -> DSparkDraftModel:
    """The DSpark drafter on the meta device in `dtype` (fp32 where `keep_fp32` keeps it)."""
    with torch.device("meta"), MetaInit():
        draft = DSparkDraftModel(cfg)
    for p in draft.parameters():
        p.data = p.data.to(dtype)
    return draft.keep_fp32()


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Official tensor name -> (shape, dtype) of the target model, computed without allocating weights."""
    with torch.device("meta"):
        model = DeepseekV4Model(cfg)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def move_computed(model: nn.Module, device: torch.device) -> None:
    """Move what `__init__` computed (buffers that are not in the checkpoint, such as RoPE `inv_freq`, and plain
    tensor attributes such as its fp32 master copy `inv_freq_fp32`) from the CPU to `device`."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                module._buffers[name] = b.to(device)
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and not value.is_meta and value.device != device:
                setattr(module, name, value.to(device))


def check_materialised(model: DeepseekV4Model) -> None:
    """No meta tensor may survive the load (a buffer or tensor attribute added to the model later that the
    loader does not know how to compute would otherwise fail only at the first forward, obscurely)."""
    for mod_name, module in model.named_modules():
        for attr, value in [*module._parameters.items(), *module._buffers.items(), *vars(module).items()]:
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise AssertionError(f"'{mod_name}.{attr}' is still on the meta device after loading: "
                                     "load_checkpoint does not know how to materialise it")
