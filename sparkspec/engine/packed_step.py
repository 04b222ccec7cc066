"""The host side of one step: what `StepPlanner.plan` builds before the forward (rows, logits rows, every int the
device needs) and `read_step` reads the copy back with."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sparkspec.engine.cuda_graphs import GraphKey
from sparkspec.engine.scheduler import ScheduledSeq
from sparkspec.engine.step_io import Upload


@dataclass
class PackedStep:
    """The host side of one step, as `StepPlanner.plan` builds it: which items sample, their rows, and every int
    the device needs (`upload`); `read_step` reads the copy back with it."""

    items: list[ScheduledSeq]
    drafts: list[list[int]]
    item_ids: list[list[int]] = field(default_factory=list)  # per item: its chunk, then its drafts
    sampling: list[int] = field(default_factory=list)  # items whose last row yields a token (S of them)
    K: int = 0  # draft columns of the verify rows: the most drafts any sampling item verifies (graphs: q - 1)
    mode: str = "greedy"  # sampling mode of the step (see `cuda_graphs.SAMPLING_MODES`)
    num_drafts: int = 0  # drafts the drafter proposes per request at the end (graphs: 0 or k, kept: `keep_drafts`)
    keep_drafts: int = 0  # of which the engine keeps the first
    key: GraphKey | None = None  # the captured step the step runs as; None = eager
    logits_rows: list[int] = field(default_factory=list)
    next_host: list[int] = field(default_factory=list)  # per row: the token after it (MTP only)
    prompt_items: list[tuple[int, int, int]] = field(default_factory=list)  # (item, first position, rows)
    logprob_rows: list[int] = field(default_factory=list)  # sampling rows whose requests want logprobs
    num_top: int = 0
    num_prompt_top: int = 0
    upload: Upload = field(default_factory=Upload)  # eager steps: the parts after the batch (named)
    flat: np.ndarray | list[int] | None = None  # graph steps: the whole upload, batch head then the parts
    slots: np.ndarray | None = None  # persistent-batch steps: each item's slot (`InputBatch.slots_for`)

    @property
    def params(self) -> list:
        return [self.items[i].seq.params for i in self.sampling]
