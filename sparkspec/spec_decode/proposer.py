"""The drafter interface shared by every speculative method (DSpark, MTP, n-gram, test drafters).

Legend: T rows of the step's target forward, R requests that drafts are proposed for, k drafts per request,
V vocabulary, W window, D latent width.

Drafts are proposed at the END of a step, for the next one: right after the rejection sampler, on the device,
from the rows the target just scored. The one device->host copy that ends the step then carries the accepted
counts, the emitted tokens AND the next drafts with their confidences, so the next step knows on the host how
many drafts each request verifies (the budget reads the confidences) and builds its batch without waiting on
the device.

Two kinds of drafter:
* device drafters (`DeviceProposer`: DSpark, MTP) keep their context in paged pools addressed by the target's block
  tables, one row per position, written for every row of every step. A row of a rejected draft is written too,
  and overwritten by the step that commits its position before anything reads it, so rollback is free. One
  exception: while the adaptive budget's plain arm holds, plain decode steps skip the write, and drafting starts
  again only after `window` steps that wrote (`VerificationBudget.context_window`), so no draft reads a row they
  skipped (but in a block taken from the prefix cache: `block_manager.py`).
* host drafters (`HostProposer`: n-gram, test drafters) look at the committed token ids after the copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from sparkspec.models.deepseek_v4 import ModelOutput
from sparkspec.models.forward_batch import ForwardBatch
from sparkspec.ops.indices import window_rows
from sparkspec.ops.sampling import DEFAULT_GUMBEL_DRAFT_TEMPERATURE, SamplingTensors


@dataclass
class DraftBatch:
    """Drafts for R requests: token d_i follows the pending token b (d_0 at b's position + 1)."""

    token_ids: torch.Tensor  # [R, k] int64
    probs: torch.Tensor | None = None  # [R, k, V] fp32 the exact q each d_i was drawn from; None = one-hot
    confidences: torch.Tensor | None = None  # [R, k] P(d_i accepted | d_<i accepted), from a confidence head


@dataclass
class StepRows:
    """What a device drafter sees at the end of a step."""

    batch: ForwardBatch  # the step's batch (positions, request rows, block tables)
    output: ModelOutput  # taps / final streams of every row
    next_ids: torch.Tensor  # [T] the token that follows each row (emitted tokens on sampled rows; garbage past them)
    reqs: torch.Tensor  # [R] batch request rows to draft for (those that sampled a token this step)
    pending_ids: torch.Tensor  # [R] the new pending token b of each
    pending_pos: torch.Tensor  # [R] its position N (= committed positions)
    last_rows: torch.Tensor  # [R] forward row of position N - 1 (the last committed row)
    sampling: SamplingTensors  # [R] the requests' sampling parameters


class Proposer(ABC):
    """A drafter, as the engine sees it: its method, k, what it needs from the target forward, and what pools it
    costs. `on_device` says which kind it is: a `DeviceProposer` (`observe` / `propose`, inside the step) or a
    `HostProposer` (`propose_ids`, after the step's copy)."""

    method: str = "none"
    on_device: bool
    tap_layers: tuple[int, ...] = ()  # 0-based target layers whose outputs `observe` receives as taps
    window: int = 0  # context rows before each pending position that `propose` reads (device drafters)
    needs_final_streams: bool = False  # whether `observe` receives the final residual streams

    def __init__(self, num_spec_tokens: int):
        self.num_spec_tokens = num_spec_tokens

    def bytes_per_position(self) -> int:
        """Pool bytes one cached position costs (charged per block by the engine's KV plan)."""
        return 0

    def allocate(self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:  # noqa: B027 (a no-op default: host drafters keep no pools)
        """Allocate the per-position pools for the engine's blocks (none for a host drafter)."""


class DeviceProposer(Proposer):
    """A drafter that runs on the device at the end of the step (DSpark, MTP). Subclasses set `method` and what
    they need from the target forward."""

    on_device = True

    def __init__(self, num_spec_tokens: int, gumbel_draft_temperature: float = DEFAULT_GUMBEL_DRAFT_TEMPERATURE):
        super().__init__(num_spec_tokens)
        self.pools: list[torch.Tensor] = []  # per draft layer [N·bs + 1, D] context K=V rows by position
        # the Gumbel-max rows' proposal rule (`sampling.sample_draft`): fixed for the proposer's life, since captured
        # graphs bake it in
        self.gumbel_draft_temperature = gumbel_draft_temperature

    @abstractmethod
    def observe(self, step: StepRows) -> None:
        """Write the context of every row of the step (committed or not) into the pools."""

    @abstractmethod
    def propose(self, step: StepRows, k: int) -> DraftBatch:
        """k drafts after each pending token of `step.reqs`."""

    def gather_windows(self, step: StepRows, window: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The `window` context rows before each pending position, from every pool -> (pool rows [R, W], -1 where
        position < 0; per pool [R, W, D], zeros there). The rows are addressed once for all pools."""
        b = step.batch
        rows = window_rows(step.pending_pos, step.reqs, b.block_tables, b.block_size, window)  # [R, W]
        return rows, [torch.where((rows >= 0).unsqueeze(-1), pool[rows.clamp(min=0)], 0) for pool in self.pools]


class HostProposer(Proposer):
    """A drafter that looks at token ids only (n-gram lookup, test drafters); runs on the host after the step."""

    on_device = False

    @abstractmethod
    def propose_ids(self, token_ids: list[list[int]], k: int) -> list[list[int]]:
        """Up to k drafts following each request's tokens (prompt + output, the pending token last)."""
