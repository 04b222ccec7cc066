"""Random tensors for any sparkspec module, named as its state dict names them (official checkpoint names).

Used by `init_dspark_tensors` / `init_mtp_tensors` (what `sparkspec init --drafter` writes) and by tests
that build tiny random models. The scales keep activations O(1) through mHC, attention and MoE.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sparkspec.models.quant import FP4_BLOCK, FP4_VALUES, FP8_BLOCK, fp8_scale_shape

# RMS of a random code: FP8 codes are drawn N(0, 16²) (e4m3 keeps 3 mantissa bits at any magnitude, and 16 σ
# stays far below its 448 limit); FP4 codes are uniform random nibbles, whose RMS is that of the 16 e2m1 values.
FP8_CODE_STD = 16.0
FP4_CODE_RMS = FP4_VALUES.square().mean().sqrt().item()  # 2.93


def random_tensors(module: nn.Module, generator: torch.Generator, prefix: str = "") -> dict[str, torch.Tensor]:
    """name -> fp32 tensor (int64 for `tid2eid`) for every parameter and persistent buffer of `module`."""
    out: dict[str, torch.Tensor] = {}
    named = list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if n.endswith("tid2eid")]
    for name, p in named:
        leaf = name.split(".")[-1]
        shape = tuple(p.shape)
        if leaf == "tid2eid":  # hash routing table [V, A]: A distinct experts per token id
            num_experts = module.get_parameter(name.rsplit(".", 1)[0] + ".weight").shape[0]
            t = torch.stack([torch.randperm(num_experts, generator=generator)[: shape[1]] for _ in range(shape[0])])
        elif leaf.startswith("hc_") and leaf.endswith("_fn"):  # [M, n·H]: mixes of unit-RMS streams ~ N(0, 1)
            t = torch.randn(shape, generator=generator) / shape[1] ** 0.5
        elif leaf.endswith("_scale"):
            t = torch.ones(shape)
        elif leaf.endswith("_base") or leaf in ("attn_sink", "ape", "bias"):
            t = torch.zeros(shape)
        elif name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif leaf == "weight" and len(shape) == 2:
            is_table = name.endswith(("embed.weight", "markov_w1.weight"))
            std = 1.0 if is_table else shape[1] ** -0.5  # lookup tables: unit rows; linears: fan-in scaling
            t = torch.randn(shape, generator=generator) * std
        else:
            t = torch.randn(shape, generator=generator) * 0.02
        out[prefix + name] = t
    return out


# ---------------------------------------------------------------- random models built on their device


def random_model(cfg, device: torch.device, dtype: torch.dtype, pg=None, expert_parallel: bool = False,
                 seed: int = 0, drafter: str | None = None, max_bytes: int | None = None,
                 quantization: str = "dequantize"):
    """(target, DSpark drafter or None) with random weights, built for one rank without ever holding more than
    that rank's share: the models are made on the meta device, sharded (`pg`: this rank's `ParallelGroup`;
    whole experts per rank with `expert_parallel`), and only then is each tensor allocated on `device`, in the
    dtype it is used in, and filled there (`fill_`). Nothing touches the disk or the host memory.

    Values: `init_rule` (unit-RMS activations through mHC, attention and MoE), as `checkpoint.random_target_tensors`
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
    from sparkspec.checkpoint import _move_computed, meta_model
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
    _move_computed(target, device)
    if draft is not None:
        fill_(draft, device, seed, dcuts, pg, prefix="mtp.")
        _move_computed(draft, device)
        draft.eval()
    return target.eval(), draft


def keeps_quantized(cfg, device: torch.device, quantization: str) -> bool:
    """Whether random weights take the official quantised layout (see `random_model`)."""
    from sparkspec.checkpoint import QUANTIZATIONS

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization = {quantization!r}: expected one of {QUANTIZATIONS}")
    if quantization == "auto":
        return cfg.quantization_config is not None and torch.device(device).type != "cpu"
    return quantization == "keep"


def quantize_layers_(model: nn.Module, cuts: dict) -> list[str]:
    """On a meta target (sharded or not), replace the `nn.Linear` layers an official checkpoint stores quantised
    and the model calls as modules (`quantized.FP8_LAYERS` -> `Fp8Linear`, `FP4_LAYERS` -> `Fp4Linear`) with
    empty quantised layers of the same (rank's) shape, as `keep_quantized_` does from a checkpoint's dtypes.
    A layer whose rank cut (`cuts`, from `shard_`) is not on its scale blocks stays plain (a tiny config's
    slices; the real models' cuts all are); routed experts go all or none per MoE layer (they are stacked).
    -> names of the replaced layers."""
    from sparkspec.models.quantized import FP4_LAYERS, FP8_LAYERS, Fp4Linear, Fp8Linear, swap_layers_

    chosen: dict[str, type[nn.Module]] = {}
    moe_experts: dict[str, list[str]] = {}  # MoE layer -> its routed expert linears
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if FP4_LAYERS.match(name):
            moe_experts.setdefault(name.split(".experts.")[0], []).append(name)
            cls, blocks, fits = Fp4Linear, (1, FP4_BLOCK), module.in_features % FP4_BLOCK == 0
        elif FP8_LAYERS.match(name):
            cls, blocks, fits = Fp8Linear, (FP8_BLOCK, FP8_BLOCK), True
        else:
            continue
        cut = cuts.get(name + ".weight")
        if cut is not None and cut.dim is not None:
            fits = fits and cut.start % blocks[cut.dim] == 0 and cut.stop % blocks[cut.dim] == 0
        if fits:
            chosen[name] = cls
    return swap_layers_(model, chosen, moe_experts)


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


def meta_drafter(cfg, dtype: torch.dtype):
    """The DSpark drafter on the meta device in `dtype` (fp32 where `keep_fp32` keeps it)."""
    from sparkspec.checkpoint import _MetaInit
    from sparkspec.models.dspark import DSparkDraftModel

    with torch.device("meta"), _MetaInit():
        draft = DSparkDraftModel(cfg)
    for p in draft.parameters():
        p.data = p.data.to(dtype)
    return draft.keep_fp32()


def fill_(model: nn.Module, device: torch.device, seed: int, cuts: dict, pg=None, prefix: str = "") -> None:
    """Allocate every meta parameter / buffer of `model` on `device` (same dtype) and fill it by `init_rule`.
    `cuts`: `shard_`'s record of which sharded tensor holds which part of which whole one."""
    import zlib

    from sparkspec.models.quantized import Fp4Linear, Fp8Linear
    from sparkspec.models.weights import assign_tensor
    from sparkspec.ops.moe import expert_weights

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


def init_rule(name: str, t: torch.Tensor, fan_in: int, g: torch.Generator, cfg) -> None:
    """Fill `t` (on its device, in its dtype) with the random weights of a tensor `name`, the rules of every
    random model (`checkpoint.random_target_tensors` and `random_model`): linears and the mHC mixes N(0, 1/fan_in)
    with the fan-in of the whole tensor, lookup tables N(0, 1), head N(0, 4/H), norms and hc scales 1, small
    nonzero sinks / ape / router bias / hc biases, distinct random experts per token for hash layers."""

    def normal(std: float) -> None:
        torch.randn(t.shape, generator=g, out=t).mul_(std)

    if name.endswith("tid2eid"):  # [V, A] distinct experts per token id
        scores = torch.rand(t.shape[0], cfg.n_routed_experts, generator=g, device=t.device)
        t.copy_(scores.argsort(-1)[:, : t.shape[1]])
    elif name.endswith(("norm.weight", "_scale")):
        t.fill_(1.0)
    elif name.endswith(("attn_sink", ".ape")):
        normal(0.3)
    elif name.endswith(("gate.bias", "_base")):
        normal(0.1)
    elif name.endswith(("embed.weight", "markov_w1.weight")):  # lookup tables: unit rows
        normal(1.0)
    elif name == "head.weight":
        normal(2.0 / cfg.hidden_size ** 0.5)
    elif t.dim() == 2:  # linears and the mHC mixes: N(0, 1 / fan_in of the whole tensor)
        normal(fan_in ** -0.5)
    else:
        raise AssertionError(f"no init rule for tensor '{name}' {tuple(t.shape)}")
