"""Installing tensors into a model: names and shapes checked against it, then assigned (no copy) or copied in."""

from __future__ import annotations

import torch

from sparkspec.loading import CheckpointError


def check_tensors(expected: dict[str, tuple[int, ...]], have: dict[str, tuple[int, ...]], source: str,
                  prefix: str = "", allow_extra: tuple[str, ...] = ("mtp.",)) -> None:
    """Names and shapes of a checkpoint against a model: `expected` (model names -> shape) against `have`
    (names relative to `prefix` -> shape). One function for `load_state` and the streaming loader, so both
    word a missing, unexpected or misshapen tensor the same way."""
    missing = sorted(set(expected) - set(have))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor '{prefix}{missing[0]}'{more}")
    extra = sorted(n for n in set(have) - set(expected) if not (prefix + n).startswith(allow_extra))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{source}: unexpected tensor '{prefix}{extra[0]}'{more}")
    for n in sorted(expected):
        if tuple(have[n]) != tuple(expected[n]):
            raise CheckpointError(f"{source}: tensor '{prefix}{n}' has shape {tuple(have[n])}, "
                                  f"expected {tuple(expected[n])}")


def assign_tensor(model: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    """Install `t` as parameter or buffer `name` of `model` in place of what is there (a meta tensor when the
    model was built on the meta device): no copy, so the model never holds a second set of weights."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(t, requires_grad=module._parameters[attr].requires_grad)
    elif attr in module._buffers:
        module._buffers[attr] = t
    else:
        raise KeyError(f"'{name}' is neither a parameter nor a buffer of {type(model).__name__}")


def load_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str = "",
               source: str = "checkpoint", allow_extra: tuple[str, ...] = ("mtp.",)) -> None:
    """Copy `tensors` into `model` (names relative to `prefix`); every parameter must be present with its shape."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    expected = {n: tuple(p.shape) for n, p in params.items() if not n.endswith("inv_freq")}
    have = {n[len(prefix):]: tuple(t.shape) for n, t in tensors.items() if n.startswith(prefix)}
    check_tensors(expected, have, source, prefix, allow_extra)
    with torch.no_grad():
        for n in expected:
            p = params[n]
            p.copy_(tensors[prefix + n].to(p.dtype))
