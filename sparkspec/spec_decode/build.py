"""`build_proposer`: the drafter of a speculative method for a target model (DSpark, MTP on the device; n-gram on
the host)."""

from __future__ import annotations

import warnings

import torch

from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.ops.sampling import DEFAULT_GUMBEL_DRAFT_TEMPERATURE
from sparkspec.spec_decode.methods import DRAFT_METHODS
from sparkspec.spec_decode.proposer import Proposer

DEFAULT_NGRAM_TOKENS = 4


def default_num_spec_tokens(method: str, model: DeepseekV4Model) -> int:
    """The checkpoint's `dspark_block_size` for DSpark, 1 for MTP, 4 for n-gram."""
    if method == "dspark":
        if model.cfg.dspark_block_size is None:
            raise ValueError("config field 'dspark_block_size' is missing: the checkpoint has no DSpark drafter")
        return model.cfg.dspark_block_size
    return {"mtp": 1, "ngram": DEFAULT_NGRAM_TOKENS}[method]


def _place(drafter: torch.nn.Module, model: DeepseekV4Model) -> torch.nn.Module:
    """The drafter on the target's device in the target's compute dtype (its embedding's: the first parameter
    of a bf16 model is an fp32 mHC tensor), with the same fp32 exceptions."""
    w = model.embed.weight
    return drafter.to(device=w.device, dtype=w.dtype).keep_fp32().eval()


def build_proposer(method: str, model: DeepseekV4Model, drafter_tensors: dict[str, torch.Tensor] | None = None,
                   num_spec_tokens: int | None = None,
                   gumbel_draft_temperature: float = DEFAULT_GUMBEL_DRAFT_TEMPERATURE) -> Proposer:
    """A drafter for `model`. `drafter_tensors`: the checkpoint's `mtp.*` tensors (others are ignored);
    `gumbel_draft_temperature`: the device drafters' proposal rule for Gumbel-max rows (`sampling.sample_draft`;
    n-gram drafts are one-hot and have none).

    Errors (ValueError, one line): unknown method, num_spec_tokens < 1, gumbel_draft_temperature <= 0, no DSpark /
    MTP weights or config.
    Warnings (the positions beyond what the drafter was trained for draft, but are rarely accepted): DSpark with
    num_spec_tokens > dspark_block_size; MTP with num_spec_tokens > its MTP layers (the later steps reuse a layer
    trained for an earlier one)."""
    if method not in DRAFT_METHODS:
        raise ValueError(f"speculative method {method!r}: expected one of {', '.join(DRAFT_METHODS)}")
    k = default_num_spec_tokens(method, model) if num_spec_tokens is None else num_spec_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_spec_tokens = {k!r}: expected an integer >= 1")
    if not gumbel_draft_temperature > 0 or gumbel_draft_temperature == float("inf"):
        raise ValueError(f"gumbel_draft_temperature = {gumbel_draft_temperature!r}: expected a finite number > 0")
    tensors = drafter_tensors or {}
    if method == "ngram":
        from sparkspec.spec_decode.ngram import NgramProposer

        return NgramProposer(k)
    if method == "dspark":
        from sparkspec.loading.drafters import dspark_from_tensors
        from sparkspec.spec_decode.dspark import DSparkProposer

        block = default_num_spec_tokens("dspark", model)
        drafter = _place(dspark_from_tensors(model.cfg, tensors), model)
        if k > block:
            warnings.warn(f"num_spec_tokens = {k} > dspark_block_size = {block}: draft positions {block + 1}..{k} "
                          "were never trained and will rarely be accepted", stacklevel=2)
        return DSparkProposer(model, drafter, k, gumbel_draft_temperature)
    from sparkspec.loading.drafters import mtp_from_tensors
    from sparkspec.spec_decode.mtp import MTPProposer

    drafter = _place(mtp_from_tensors(model.cfg, tensors), model)
    if k > drafter.num_layers:
        warnings.warn(f"num_spec_tokens = {k} > MTP layers = {drafter.num_layers}: draft positions "
                      f"{drafter.num_layers + 1}..{k} reuse a layer trained for an earlier position and will rarely "
                      "be accepted", stacklevel=2)
    return MTPProposer(model, drafter, k, gumbel_draft_temperature)
