"""Paged caches of the target model: one flat pool per cache kind per layer, addressed by block id.

A sequence owns a block table (the engine's `BlockManager` hands out the ids); block `b` of the table holds
positions `b·bs .. (b+1)·bs - 1` in EVERY pool, so one allocator serves every cache kind. Legend: N blocks,
bs positions per block, e compressed entries per block (`entries_per_block`), D latent width.

Pools of one layer:
* `attn`        [N·(bs + e) + 1, D]   raw K=V latent of bs positions, then the block's e compressed entries.
                                      Attention reads raw rows and compressed entries from ONE tensor.
* `comp_kv`     [N·bs + 1, c·d] fp32  compressor partial state per position (projected kv)   (compressed layers)
* `comp_score`  [N·bs + 1, c·d] fp32  compressor gate score per position, + ape[pos % ratio]
* `idx_kv`, `idx_score` [N·bs + 1, ·] fp32, `idx_keys` [N·e + 1, id] fp32: the same for the lightning
  indexer (CSA layers)

Compressed entry j (pooling positions up to (j+1)·ratio - 1) lives in the block of position j·ratio, at entry
row (j·ratio mod bs) // ratio; `entries_per_block` = ceil(bs / ratio), so bs must divide ratio or ratio bs.
The last row of every pool is a trash row: writes that must not land anywhere go there. One block more than
asked for is allocated: the scratch block (`scratch_block`, never handed out) pads block tables, so a padded
row of a graph-captured step (or a position past a sequence's blocks) writes into it and never into a real block.

Rows are indexed by absolute position and never shifted, so rolling back a rejected draft is moving a length:
every row a later query reads is rewritten by the step that commits its position, before it is read.
"""

from __future__ import annotations

import torch


def entries_per_block(block_size: int, ratio: int) -> int:
    """Compressed entries stored per block for a layer with this compress ratio (0 for sliding-only layers)."""
    if ratio <= 1:
        return 0
    if block_size % ratio and ratio % block_size:
        raise ValueError(f"block_size = {block_size}: expected a divisor or a multiple of the compress ratio {ratio}")
    return -(-block_size // ratio)


def layer_widths(layer) -> dict[str, tuple[int, bool]]:
    """This layer's cache kinds -> (row width, stored in the model dtype rather than fp32)."""
    attn = layer.attn
    specs = {"attn": (attn.head_dim, True)}
    if attn.compressor is not None:
        w = attn.compressor.wkv.out_features
        specs |= {"comp_kv": (w, False), "comp_score": (w, False)}
    if attn.indexer is not None:
        c = attn.indexer.compressor
        specs |= {"idx_kv": (c.wkv.out_features, False), "idx_score": (c.wkv.out_features, False),
                  "idx_keys": (c.head_dim, False)}
    return specs


class KVCache:
    """Every pool of every target layer, for `num_blocks` blocks of `block_size` positions."""

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device | None = None,
                 dtype: torch.dtype | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KVCache(num_blocks={num_blocks}, block_size={block_size}): expected positive sizes")
        # the activations' dtype (the embedding's), not the first parameter's: mHC parameters come first, and they
        # stay fp32 in a bf16 model (`keep_fp32`)
        p = model.embed.weight if hasattr(model, "embed") else next(model.parameters())
        device, dtype = device or p.device, dtype or p.dtype
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks  # pads block tables; rows past the real blocks
        self.layers: list[dict[str, torch.Tensor]] = []
        for layer in model.layers:
            e = entries_per_block(block_size, layer.attn.ratio)
            pools = {}
            for kind, (width, model_dtype) in layer_widths(layer).items():
                rows = {"attn": block_size + e, "idx_keys": e}.get(kind, block_size)
                pools[kind] = torch.zeros((num_blocks + 1) * rows + 1, width, dtype=dtype if model_dtype else torch.float32,
                                          device=device)
            self.layers.append(pools)

    def trash_row(self, rows_per_block: int) -> int:
        """The last row of a pool with `rows_per_block` rows per block: writes that must land nowhere."""
        return (self.num_blocks + 1) * rows_per_block

    @property
    def device(self) -> torch.device:
        return self.layers[0]["attn"].device if self.layers else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pools in self.layers for t in pools.values())

    @classmethod
    def for_sequences(cls, model, num_seqs: int, max_len: int, block_size: int = 16) -> tuple[KVCache, list[list[int]]]:
        """A cache with room for `num_seqs` sequences of `max_len` positions, and their block tables (tests,
        training, probes: callers without a block manager)."""
        per_seq = -(-max_len // block_size)
        cache = cls(model, num_seqs * per_seq, block_size)
        return cache, [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]

    @classmethod
    def for_lengths(cls, model, lengths, block_size: int = 16) -> tuple[KVCache, list[list[int]]]:
        """A cache with exactly the blocks that sequences of these lengths need, and their block tables."""
        tables, n = [], 0
        for length in lengths:
            k = max(1, -(-int(length) // block_size))
            tables.append(list(range(n, n + k)))
            n += k
        return cls(model, max(n, 1), block_size), tables
