"""The one allocator of the KV caches (pure Python).

A sequence owns `seq.block_ids`, in position order: block b of the list holds its positions b·bs .. (b+1)·bs - 1
in every pool (`models/cache.py` and the drafters' pools), so the ids handed out here ARE the storage; no
second accounting has to agree with this one. `blocks_per_seq` charges a constant number of extra blocks per
resident sequence (none of the shipped drafters needs it: their context lives in the pools). `kv_plan.py`
decides how many bytes one block stands for.

Verbs come in pairs: `can_allocate` / `allocate` / `trim` / `free`.
"""

from __future__ import annotations

from collections import deque

from sparkspec.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, blocks_per_seq: int = 0):
        if num_blocks < 1 or block_size < 1 or blocks_per_seq < 0:
            raise ValueError(f"BlockManager(num_blocks={num_blocks}, block_size={block_size}, "
                             f"blocks_per_seq={blocks_per_seq}): expected positive sizes")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks_per_seq = blocks_per_seq
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a resident sequence with `num_tokens` cached positions is charged."""
        return -(-num_tokens // self.block_size) + self.blocks_per_seq

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Can `seq` grow to `num_tokens` positions?"""
        return self.blocks_for(num_tokens) - len(seq.block_ids) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(seq.block_ids)
        if need > self.num_free_blocks:
            raise RuntimeError(f"sequence {seq.seq_id}: needs {need} blocks, {self.num_free_blocks} free")
        for _ in range(max(need, 0)):
            seq.block_ids.append(self.free_block_ids.popleft())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back blocks beyond what `num_tokens` positions need (after rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_ids) > keep:
            self.free_block_ids.append(seq.block_ids.pop())

    def free(self, seq: Sequence) -> None:
        self.free_block_ids.extend(reversed(seq.block_ids))
        seq.block_ids.clear()
