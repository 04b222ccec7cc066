"""The one allocator of the KV caches (pure Python).

A sequence owns `seq.block_ids`, in position order: block b of the list holds its positions b·bs .. (b+1)·bs - 1
in every pool (`models/cache.py` and the drafters' pools), so the ids handed out here ARE the storage; no
second accounting has to agree with this one. `blocks_per_seq` charges a constant number of extra blocks per
resident sequence (none of the shipped drafters needs it: their context lives in the pools). `kv_plan.py`
decides how many bytes one block stands for.

Verbs come in pairs: `can_allocate` / `allocate` / `trim` / `free`.

Every change to a sequence's list stamps it with a new `table_version` (one counter for the whole manager), so
a copy of the list kept elsewhere (the runner's persistent block tables, `engine/input_batch.py`) is current
exactly when it was taken at the stamp the sequence holds now: one int compare per step instead of a list
compare.
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
        self.table_versions: dict[int, int] = {}  # seq_id -> stamp of its last block-list change
        self._clock = 0

    def table_version(self, seq: Sequence) -> int:
        """The stamp of `seq.block_ids` as it is now (-1: never allocated here)."""
        return self.table_versions.get(seq.seq_id, -1)

    def _changed(self, seq: Sequence) -> None:
        self._clock += 1
        self.table_versions[seq.seq_id] = self._clock

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
        if need > 0:
            for _ in range(need):
                seq.block_ids.append(self.free_block_ids.popleft())
            self._changed(seq)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back blocks beyond what `num_tokens` positions need (after rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        if len(seq.block_ids) > keep:
            while len(seq.block_ids) > keep:
                self.free_block_ids.append(seq.block_ids.pop())
            self._changed(seq)

    def free(self, seq: Sequence) -> None:
        self.free_block_ids.extend(reversed(seq.block_ids))
        seq.block_ids.clear()
        self.table_versions.pop(seq.seq_id, None)  # a later allocate stamps it anew
