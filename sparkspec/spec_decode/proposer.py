"""The drafter interface shared by every speculative method (DSpark, MTP, n-gram, test drafters).

Legend: k drafts of one request, V vocabulary, T rows of a target forward, m tapped layers, n hc streams, H hidden.

Protocol, per request (see `sparkspec.spec_decode.decode`): the target cache holds the committed tokens 0..N-1 and
the pending token b (the target's last sample) sits at position N.

1. `start(seqs)` before the prompt is prefilled;
2. `observe(step)` after every target forward, with the rows the target COMMITTED (prefill: the whole
   prompt; verify: b and the accepted drafts) and their captured outputs — a drafter's state only ever
   holds committed tokens, so a rejected draft leaves nothing behind;
3. `propose(seqs, num_tokens)` drafts up to num_tokens[r] tokens following b (positions N+1..);
4. `finish(seqs)` frees the state of finished requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from sparkspec.generation import Sequence


@dataclass
class Draft:
    """Drafts for one request."""

    token_ids: list[int]  # [k] d_0..d_{k-1}, following the pending token
    probs: torch.Tensor | None = None  # [k, V] fp32 the exact distribution each d_i was drawn from; None = one-hot
    confidences: torch.Tensor | None = None  # [k] P(d_i accepted | d_<i accepted) from a confidence head

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.token_ids):
            raise ValueError(f"draft probs cover {self.probs.shape[0]} rows for {len(self.token_ids)} tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


EMPTY_DRAFT = Draft([])


@dataclass
class CommittedRows:
    """What one target forward committed, as the drafters see it."""

    seqs: list[Sequence]  # requests with committed rows (unfinished after this step)
    spans: list[tuple[int, int]]  # rows (s, e) of the forward that sequence r committed
    start_positions: list[int]  # position of row s
    input_ids: torch.Tensor  # [T] token ids of every row of the forward
    taps: torch.Tensor | None  # [T, m, H] mean over hc streams of the tapped layers' outputs
    final_streams: torch.Tensor | None  # [T, n·H] residual streams before hc_head

    def next_ids(self, r: int) -> torch.Tensor:
        """The token following each committed row of sequence r (the last one is the pending token) -> [e - s]."""
        s, e = self.spans[r]
        pending = torch.tensor([self.seqs[r].output_ids[-1]], device=self.input_ids.device)
        return torch.cat([self.input_ids[s + 1 : e], pending])


class Proposer(ABC):
    """A drafter. Subclasses set `method`, and what they need from the target forward."""

    method: str = "none"
    tap_layers: tuple[int, ...] = ()  # 0-based target layers whose outputs `observe` receives as taps
    needs_final_streams: bool = False  # whether `observe` receives the final residual streams

    def __init__(self, num_spec_tokens: int):
        self.num_spec_tokens = num_spec_tokens
        self.states: dict[int, Any] = {}  # per-request drafter state, keyed by seq_id; dropped in `finish`

    def start(self, seqs: list[Sequence]) -> None:
        """New requests are about to be prefilled."""

    def observe(self, step: CommittedRows) -> None:
        """The target committed `step.spans` rows for `step.seqs`."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        """Up to num_tokens[r] drafts after each request's pending token (0 -> EMPTY_DRAFT)."""

    def finish(self, seqs: list[Sequence]) -> None:
        """These requests ended; drop their state."""
        for s in seqs:
            self.states.pop(s.seq_id, None)
