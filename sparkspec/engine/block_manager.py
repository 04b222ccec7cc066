"""Block accounting for the KV caches (pure Python).

Memory for a sequence's caches is charged in blocks of `block_size` token positions, plus a constant number
of blocks per resident sequence (`blocks_per_seq`: drafter context windows and other per-request state whose
size does not grow with the sequence). `kv_cache.py` decides how many bytes one block stands for.

Verbs come in pairs: `can_allocate` / `allocate` / `trim` / `free`. A sequence owns `seq.block_ids`; the
ids are charge handles. This class is the one authority for admission and preemption; the storage is the
engine's block pools (`models/cache.py`), sized from this block count so that whatever is admitted here fits
there (see `kv_cache.py`).
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
