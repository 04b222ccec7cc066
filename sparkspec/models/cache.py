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

from dataclasses import dataclass

import torch

from sparkspec.config import CSA, ModelConfig


def entries_per_block(block_size: int, ratio: int) -> int:
    """Compressed entries stored per block for a layer with this compress ratio (0 for sliding-only layers)."""
    if ratio <= 1:
        return 0
    if block_size % ratio and ratio % block_size:
        raise ValueError(f"block_size = {block_size}: expected a divisor or a multiple of the compress ratio {ratio}")
    return -(-block_size // ratio)


def compressor_width(ratio: int, head_dim: int) -> int:
    """Per-position partial-state width of a compressor (`c·d`): overlapping windows (ratio 4) keep two halves."""
    return head_dim * (2 if ratio == 4 else 1)


@dataclass(frozen=True)
class Pool:
    """One pool of one layer: `rows_per_block` rows of `width` elements per block, in `dtype`."""

    kind: str  # attn | comp_kv | comp_score | idx_kv | idx_score | idx_keys
    rows_per_block: int
    width: int
    dtype: torch.dtype

    def num_rows(self, num_blocks: int) -> int:
        """Rows allocated for `num_blocks` blocks: one block more (the scratch block) and the trash row."""
        return (num_blocks + 1) * self.rows_per_block + 1

    @property
    def bytes_per_block(self) -> int:
        return self.rows_per_block * self.width * self.dtype.itemsize

    @property
    def bytes_per_row(self) -> int:
        return self.width * self.dtype.itemsize


def cache_layout(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> list[list[Pool]]:
    """Every pool of every target layer, the latents in `dtype` (the model's activations), the partial states
    fp32. The one description of the layout: `KVCache` allocates it and the engine's KV plan prices it."""
    f32, layers = torch.float32, []
    for layer in range(cfg.num_hidden_layers):
        ratio = cfg.compress_ratio(layer)
        e = entries_per_block(block_size, ratio)
        pools = [Pool("attn", block_size + e, cfg.head_dim, dtype)]
        if ratio > 1:
            w = compressor_width(ratio, cfg.head_dim)
            pools += [Pool("comp_kv", block_size, w, f32), Pool("comp_score", block_size, w, f32)]
        if cfg.layer_types[layer] == CSA:
            w = compressor_width(ratio, cfg.index_head_dim)
            pools += [Pool("idx_kv", block_size, w, f32), Pool("idx_score", block_size, w, f32),
                      Pool("idx_keys", e, cfg.index_head_dim, f32)]
        layers.append(pools)
    return layers


def cache_dtype(model) -> torch.dtype:
    """The dtype of the latent pools: the activations' (the embedding's), not the first parameter's: mHC
    parameters come first, and they stay fp32 in a bf16 model (`keep_fp32`)."""
    return (model.embed.weight if hasattr(model, "embed") else next(model.parameters())).dtype


class KVCache:
    """Every pool of every target layer, for `num_blocks` blocks of `block_size` positions."""

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device | None = None,
                 dtype: torch.dtype | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KVCache(num_blocks={num_blocks}, block_size={block_size}): expected positive sizes")
        device = device or next(model.parameters()).device
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks  # pads block tables; rows past the real blocks
        layout = cache_layout(model.cfg, block_size, dtype or cache_dtype(model))
        self.layers: list[dict[str, torch.Tensor]] = [
            {p.kind: torch.zeros(p.num_rows(num_blocks), p.width, dtype=p.dtype, device=device) for p in pools}
            for pools in layout]

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
    def for_lengths(cls, model, lengths, block_size: int = 16) -> tuple[KVCache, list[list[int]]]:
        """A cache with exactly the blocks that sequences of these lengths need, and their block tables."""
        tables, n = [], 0
        for length in lengths:
            k = max(1, -(-int(length) // block_size))
            tables.append(list(range(n, n + k)))
            n += k
        return cls(model, max(n, 1), block_size), tables
