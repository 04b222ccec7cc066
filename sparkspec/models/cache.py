"""Per-sequence caches for the target model.

Every cache is indexed by absolute position (rows are never shifted), so rolling back a rejected draft is
`truncate(n)`: the row counts drop and stale rows are overwritten by the next write. What each layer keeps:

* `kv`          [cap, D]      sliding-window K=V latent (normalised, RoPE applied) of every position
* `comp_kv`     [cap, c·d]    compressor partial state per position (projected kv)      (compressed layers)
* `comp_score`  [cap, c·d]    compressor gate score per position, + ape[pos % ratio]    (compressed layers)
* `compressed`  [cap/r, D]    emitted compressed entries; entry j exists once position (j+1)·r-1 is written
* `idx_kv`, `idx_score`, `idx_keys`: the same three for the lightning indexer (CSA layers)

Positions older than the window are kept because compressor rows may be re-pooled after a rollback
across a ratio boundary; the paged engine cache bounds this (see `engine/kv_cache.py`).
"""

from __future__ import annotations

import torch


class GrowingRows:
    """A [capacity, width] buffer addressed by row, grown by doubling; `n` rows are valid."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, capacity: int = 64):
        self.data = torch.zeros(capacity, width, dtype=dtype, device=device)
        self.n = 0

    def write(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        if end > self.data.shape[0]:
            cap = max(end, 2 * self.data.shape[0])
            grown = torch.zeros(cap, self.data.shape[1], dtype=self.data.dtype, device=self.data.device)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[start:end] = rows.to(self.data.dtype)
        self.n = end

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def view(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.data[start : self.n if end is None else end]


class LayerCache:
    def __init__(self, layer, dtype: torch.dtype, device: torch.device):
        attn = layer.attn
        self.ratio = attn.ratio
        self.kv = GrowingRows(attn.head_dim, dtype, device)
        self.comp_kv = self.comp_score = self.compressed = None
        self.idx_kv = self.idx_score = self.idx_keys = None
        if attn.compressor is not None:
            c = attn.compressor
            self.comp_kv = GrowingRows(c.wkv.out_features, torch.float32, device)
            self.comp_score = GrowingRows(c.wkv.out_features, torch.float32, device)
            self.compressed = GrowingRows(attn.head_dim, dtype, device, capacity=8)
        if attn.indexer is not None:
            c = attn.indexer.compressor
            self.idx_kv = GrowingRows(c.wkv.out_features, torch.float32, device)
            self.idx_score = GrowingRows(c.wkv.out_features, torch.float32, device)
            self.idx_keys = GrowingRows(c.head_dim, torch.float32, device, capacity=8)

    def truncate(self, num_tokens: int) -> None:
        for buf in (self.kv, self.comp_kv, self.comp_score, self.idx_kv, self.idx_score):
            if buf is not None:
                buf.truncate(num_tokens)
        for buf in (self.compressed, self.idx_keys):
            if buf is not None:
                buf.truncate(num_tokens // self.ratio)


class SequenceCache:
    """All layer caches of one sequence; `num_tokens` positions are committed."""

    def __init__(self, model, device: torch.device | None = None):
        p = next(model.parameters())
        self.layers = [LayerCache(layer, p.dtype, device or p.device) for layer in model.layers]
        self.num_tokens = 0

    def truncate(self, num_tokens: int) -> None:
        """Roll back to the first `num_tokens` positions (exact: nothing of later positions is ever read)."""
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: the cache holds {self.num_tokens}")
        for layer in self.layers:
            layer.truncate(num_tokens)
        self.num_tokens = num_tokens
