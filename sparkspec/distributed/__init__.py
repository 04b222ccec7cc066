"""Tensor parallelism over torch.distributed (NCCL / RCCL / XCCL on accelerators, gloo on CPU).

A `ParallelGroup` is what a sharded module keeps: its rank, the group size and the process group. The two
collectives the model needs are here, and each is the identity when there is no group, so a single process runs
the same code with no branch on the device and no collective. `tensor_parallel.py` shards a model over a group;
the engine that drives the ranks in lockstep is `sparkspec/engine/lockstep.py` (above the model, beside the engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroup:
    rank: int
    world_size: int
    group: Any = None  # torch.distributed ProcessGroup (None: the default group)

    def shard(self, n: int, what: str) -> slice:
        """This rank's contiguous 1/world_size of n items (n must divide)."""
        if n % self.world_size:
            raise ValueError(f"{what} = {n}: not divisible by the tensor-parallel size {self.world_size}")
        k = n // self.world_size
        return slice(self.rank * k, (self.rank + 1) * k)


def all_reduce(x: torch.Tensor, pg: ParallelGroup | None) -> torch.Tensor:
    """Sum of x over the group (in place); x itself without a group."""
    if pg is not None and pg.world_size > 1:
        dist.all_reduce(x, group=pg.group)
    return x


def all_gather_last(x: torch.Tensor, pg: ParallelGroup | None) -> torch.Tensor:
    """The ranks' x concatenated along the last dim (rank order); x itself without a group."""
    if pg is None or pg.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(pg.world_size)]
    dist.all_gather(parts, x.contiguous(), group=pg.group)
    return torch.cat(parts, dim=-1)
