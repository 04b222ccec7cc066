"""The drafter modules built from a checkpoint's `mtp.*` tensors (`LoadedCheckpoint.drafter_tensors`).

Each drafter is recognised by its own tensors: DSpark by `mtp.0.main_proj.weight` (stages `mtp.0..n-1`), classic
MTP by the stages that own `e_proj` (after the DSpark stages when a checkpoint carries both; see
`sparkspec.models.dspark` and `sparkspec.models.mtp` for the layouts).
"""

from __future__ import annotations

import re

import torch

from sparkspec.config import ModelConfig
from sparkspec.loading import CheckpointError
from sparkspec.loading.state import load_state
from sparkspec.models.dspark import DSparkDraftModel
from sparkspec.models.mtp import MTPDraftModel

CONFIDENCE_SUFFIX = "confidence_head.proj.weight"


def dspark_from_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> DSparkDraftModel:
    """Build from checkpoint tensors named `mtp.S.*`; a missing tensor is a ValueError naming it.
    Other tensors (the target's, classic MTP layers at later stages) are ignored."""
    model = DSparkDraftModel(cfg)
    conf_name = f"mtp.{model.num_layers - 1}.{CONFIDENCE_SUFFIX}"
    if conf_name not in tensors:
        model.last.confidence_head = None
    if "mtp.0.main_proj.weight" not in tensors:
        raise CheckpointError("DSpark drafter: missing tensor 'mtp.0.main_proj.weight'; the checkpoint has no "
                              "DSpark weights (write them with `sparkspec init --drafter dspark`)")
    # other stages' tensors (mtp.*) may be present; the target's are not ours to check
    load_state(model, {k: v for k, v in tensors.items() if k.startswith("mtp.")}, source="DSpark drafter")
    temperature = tensors.get(f"mtp.{model.num_layers - 1}.confidence_head.temperature")
    if model.has_confidence and temperature is not None:
        model.last.confidence_head.temperature = temperature.float()
    survival_map = tensors.get(f"mtp.{model.num_layers - 1}.confidence_head.survival_map")
    if model.has_confidence and survival_map is not None:
        if survival_map.dim() != 2 or survival_map.shape[1] < 2:
            raise CheckpointError(f"mtp.{model.num_layers - 1}.confidence_head.survival_map: expected [k, K >= 2], "
                                  f"got {tuple(survival_map.shape)}")
        model.last.confidence_head.survival_map = survival_map.float()
    return model


def find_mtp_stages(tensors: dict[str, torch.Tensor]) -> list[int]:
    """Stage numbers S that hold a classic MTP layer (`mtp.S.e_proj.weight`), ascending."""
    stages = sorted(int(m.group(1)) for n in tensors if (m := re.match(r"^mtp\.(\d+)\.e_proj\.weight$", n)))
    if stages and stages != list(range(stages[0], stages[0] + len(stages))):
        raise CheckpointError(f"MTP drafter: layers must be consecutive stages, found mtp.{stages} with e_proj")
    return stages


def mtp_from_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> MTPDraftModel:
    """Build from checkpoint tensors; the layers are the `mtp.S` stages that own `e_proj` (ValueError if none)."""
    stages = find_mtp_stages(tensors)
    if not stages:
        raise CheckpointError("MTP drafter: missing tensor 'mtp.0.e_proj.weight'; the checkpoint has no MTP "
                              "layers (write them with `sparkspec init --drafter mtp`)")
    has_norm = f"mtp.{stages[0]}.norm.weight" in tensors
    model = MTPDraftModel(cfg, len(stages), stages[0], has_norm)
    # other stages' tensors (mtp.*) may be present; the target's are not ours to check
    load_state(model, {k: v for k, v in tensors.items() if k.startswith("mtp.")}, source="MTP drafter")
    return model
