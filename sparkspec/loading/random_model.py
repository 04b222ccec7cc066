"""Random models built on their device: the target (and the DSpark drafter) made on the meta device, sharded
for one rank, then each tensor allocated on the device and filled there by `random_init.init_rule`, so that a rank
never holds more than its share and nothing touches the disk or the host memory (latency benchmarks at real
size, tests of tensor parallelism).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from sparkspec.loading.meta import meta_drafter, meta_model, move_computed
from sparkspec.loading.quantized import QUANTIZATIONS, Fp4Linear, Fp8Linear, quantize_layers_
from sparkspec.loading.random_init import init_rule
from sparkspec.loading.state import assign_tensor
from sparkspec.ops.formats import FP4_BLOCK, FP4_VALUES, fp8_scale_shape
from sparkspec.ops.moe import expert_weights

# RMS of a random code: FP8 codes are drawn N(0, 16²) (e4m3 keeps 3 mantissa bits at any magnitude, and 16 σ
# stays far below its 448 limit); FP4 codes are uniform random nibbles, whose RMS is that of the 16 e2m1 values.
FP8_CODE_STD = 16.0
FP4_CODE_RMS = FP4_VALUES.square().mean().sqrt().item()  # 2.93


def random_model(cfg, device: torch.device, dtype: torch.dtype, pg=None, expert_parallel: bool = False,
                 seed: int = 0, drafter: str | None = None, max_bytes: int | None = None,
                 quantization: str = "dequantize"):
    """(target, DSpark drafter or None) with random weights, built for one rank without ever holding more than
    that rank's share: the models are made on the meta device, sharded (`pg`: this rank's `ParallelGroup`;
    whole experts per rank with `expert_parallel`), and only then is each tensor allocated on `device`, in the
    dtype it is used in, and filled there (`fill_`). Nothing touches the disk or the host memory.

    Values: `init_rule` (unit-RMS activations through mHC, attention and MoE), as `random_init.random_target_tensors`
    uses it.
    Replicated tensors are equal on every rank (their seed is their name), so every rank routes and samples the
    same; a slice gets a seed of its own per rank, and an expert-parallel rank's experts the seeds of their
    global ids (the same values a single process would hold). `max_bytes`: refuse (ValueError, before anything is
    allocated) when this rank's weights would need more.

    `quantization` (as `load_checkpoint` takes it): "keep" builds the target in the official quantised layout
    (`quantize_layers_`: FP8 attention / shared-expert projections, FP4 routed experts, after the rank's cuts);
    "auto" does so when `cfg` declares a quantised checkpoint (`quantization_config`) and `device` is not the
    CPU, as the loader keeps kept-able weights off the CPU; "dequantize": every weight in `dtype`. The drafter
    stays in `dtype` (the loader dequantises `mtp.*` too)."""
    from sparkspec.distributed.tensor_parallel import shard_, shard_drafter_

    if drafter not in (None, "dspark"):
        raise ValueError(f"drafter = {drafter!r}: random drafters are built for 'dspark' only")
    target = meta_model(cfg, dtype)
    cuts = shard_(target, pg, expert_parallel) if pg is not None else {}
    if keeps_quantized(cfg, device, quantization):
        quantize_layers_(target, cuts)
    draft = meta_drafter(cfg, dtype) if drafter == "dspark" else None
    dcuts = shard_drafter_(draft, pg, expert_parallel) if draft is not None and pg is not None else {}
    need = sum(_nbytes(m) for m in (target, draft) if m is not None)
    if max_bytes is not None and need > max_bytes:
        per_layer = sum(_nbytes(layer) for layer in target.layers) / cfg.num_hidden_layers
        fits = int(cfg.num_hidden_layers - (need - max_bytes) / per_layer)
        raise ValueError(f"random weights need {need / 1e9:.1f} GB on this rank, {max_bytes / 1e9:.1f} GB are "
                         f"available ({dtype}, {pg.world_size if pg else 1} rank(s)); about {max(fits, 0)} of "
                         f"{cfg.num_hidden_layers} layers would fit (--num-layers), or more ranks")
    fill_(target, device, seed, cuts, pg)
    move_computed(target, device)
    if draft is not None:
        fill_(draft, device, seed, dcuts, pg, prefix="mtp.")
        move_computed(draft, device)
        draft.eval()
    return target.eval(), draft


def keeps_quantized(cfg, device: torch.device, quantization: str) -> bool:
    """Whether random weights take the official quantised layout (see `random_model`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization = {quantization!r}: expected one of {QUANTIZATIONS}")
    if quantization == "auto":
        return cfg.quantization_config is not None and torch.device(device).type != "cpu"
    return quantization == "keep"


def random_quantized(kind: str, shape: tuple[int, int], fan_in: int, g: torch.Generator,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of a random `Fp8Linear` ("fp8": float8_e4m3fn [out, in], fp32 [out/128, in/128]) or
    `Fp4Linear` ("fp4": packed uint8 [out, in/2], e8m0 bytes [out, in/32]) made on `device`, whose dequantised
    weight has the std of the plain init N(0, 1/fan_in). Official scales are powers of two (ue8m0), so these
    are too: FP8 draws its codes to the std, FP4 mixes two neighbouring block exponents."""
    std = fan_in ** -0.5
    out, width = shape
    if kind == "fp8":
        exp = round(math.log2(std / FP8_CODE_STD))
        codes = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0, std * 2.0 ** -exp, generator=g)
        return codes.to(torch.float8_e4m3fn), torch.full(fp8_scale_shape(shape), 2.0 ** exp, device=device)
    if kind == "fp4":  # block exponents e or e + 1, the share p of e + 1 making the mean square std²
        ratio = std / FP4_CODE_RMS
        exp = math.floor(math.log2(ratio))
        p = (ratio ** 2 / 4.0 ** exp - 1) / 3
        codes = torch.empty(shape, dtype=torch.uint8, device=device).random_(0, 256, generator=g)
        num_blocks = (2 * width + FP4_BLOCK - 1) // FP4_BLOCK
        bumps = torch.rand(out, num_blocks, generator=g, device=device) < p
        return codes, bumps.to(torch.uint8).add_(127 + exp)
    raise ValueError(f"kind = {kind!r}: expected 'fp8' or 'fp4'")


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def fill_(model: nn.Module, device: torch.device, seed: int, cuts: dict, pg=None, prefix: str = "") -> None:
    """Allocate every meta parameter / buffer of `model` on `device` (same dtype) and fill it by `init_rule`.
    `cuts`: `shard_`'s record of which sharded tensor holds which part of which whole one."""
    world = pg.world_size if pg is not None else 1
    rank = pg.rank if pg is not None else 0
    named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if b.is_meta]
    with torch.no_grad():
        for name, meta in named:
            cut = cuts.get(name)
            source = cut.source if cut is not None else name
            is_slice = cut is not None and cut.dim is not None
            fan_in = meta.shape[-1] * (world if is_slice and cut.dim == 1 else 1) if meta.dim() == 2 else 0
            key = zlib.crc32(f"{prefix}{source}|{rank if is_slice else -1}".encode())
            g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + key)
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if isinstance(owner, (Fp8Linear, Fp4Linear)):  # codes and scale together, from the weight's seed
                if leaf == "weight":
                    fan_in = owner.in_features * (world if is_slice and cut.dim == 1 else 1)
                    kind = "fp8" if isinstance(owner, Fp8Linear) else "fp4"
                    codes, scale = random_quantized(kind, tuple(meta.shape), fan_in, g, device)
                    assign_tensor(model, name, codes)
                    assign_tensor(model, f"{owner_name}.scale", scale)
                continue
            t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            init_rule(prefix + name, t, fan_in, g, model.cfg)
            assign_tensor(model, name, t)
        for m in model.modules():  # stack each layer's experts now, while only one layer's copy is extra
            if hasattr(m, "experts") and hasattr(m, "shared_experts") and len(m.experts):
                expert_weights(m)
