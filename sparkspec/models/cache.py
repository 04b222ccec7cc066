"""Per-sequence caches for the target model, growable or paged.

Every cache is indexed by absolute position (rows are never shifted), so rolling back a rejected draft is
`truncate(n)`: the row counts drop and stale rows are overwritten by the next write. What each layer keeps:

* `kv`          [n, D]        sliding-window K=V latent (normalised, RoPE applied) of every position
* `comp_kv`     [n, c·d]      compressor partial state per position (projected kv)      (compressed layers)
* `comp_score`  [n, c·d]      compressor gate score per position, + ape[pos % ratio]    (compressed layers)
* `compressed`  [n/r, D]      emitted compressed entries; entry j exists once position (j+1)·r-1 is written
* `idx_kv`, `idx_score`, `idx_keys`: the same three for the lightning indexer (CSA layers)

Two storages with one interface (`write`, `truncate`, `view`, `n`):
* `GrowingRows`: a private buffer grown by doubling (plain `Generator`, training, tests: `model.new_cache()`).
* `PagedRows`: a block table into a shared `BlockPool` (the serving engine: `SequenceCache(model, pools)`).
  Blocks hold `block_size` rows (positions for per-position kinds, entries for compressed kinds); `truncate`
  and `free` return whole trailing blocks to the pool.

Positions older than the window are kept because compressor rows may be re-pooled after a rollback
across a ratio boundary (and `Compressor.emit` indexes them by absolute position).
"""

from __future__ import annotations

import torch

COMPRESSED_KINDS = ("compressed", "idx_keys")  # one row per `ratio` positions; all other kinds: one per position


class OutOfBlocks(RuntimeError):
    """A BlockPool has no free block left (the engine sizes pools so this never happens to admitted requests)."""


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

    def free(self) -> None:
        self.n = 0


class BlockPool:
    """Preallocated storage for one cache kind of one layer, handed out a block at a time."""

    def __init__(self, num_blocks: int, block_rows: int, width: int, dtype: torch.dtype, device: torch.device):
        if num_blocks < 1 or block_rows < 1:
            raise ValueError(f"BlockPool(num_blocks={num_blocks}, block_rows={block_rows}): expected positive sizes")
        self.data = torch.zeros(num_blocks, block_rows, width, dtype=dtype, device=device)  # [N, block_rows, W]
        self.block_rows = block_rows
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out 0, 1, 2, ...

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def allocate(self) -> int:
        if not self.free_ids:
            raise OutOfBlocks(f"cache block pool {tuple(self.data.shape)} is exhausted ({self.num_blocks} blocks)")
        return self.free_ids.pop()

    def free(self, ids: list[int]) -> None:
        self.free_ids.extend(reversed(ids))


class PagedRows:
    """GrowingRows' interface over a block table into a BlockPool: row i lives in block_ids[i // block_rows]."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_ids: list[int] = []
        self._table: torch.Tensor | None = None  # block_ids on the device, rebuilt when the block list changes
        self.n = 0

    def write(self, start: int, rows: torch.Tensor) -> None:
        br, end = self.pool.block_rows, start + rows.shape[0]
        if start < self.n:
            self.truncate(start)  # like GrowingRows, a write ends the valid rows at `end`
        while len(self.block_ids) * br < end:
            self.block_ids.append(self.pool.allocate())
            self._table = None
        rows = rows.to(self.pool.data.dtype)
        pos = start
        while pos < end:  # one slice copy per block touched
            b, off = divmod(pos, br)
            stop = min(end, (b + 1) * br)
            self.pool.data[self.block_ids[b], off : off + stop - pos] = rows[pos - start : stop - start]
            pos = stop
        self.n = end

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)
        keep = -(-self.n // self.pool.block_rows)
        if len(self.block_ids) > keep:
            self.pool.free(self.block_ids[keep:])
            del self.block_ids[keep:]
            self._table = None

    def view(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) as one [end - start, W] tensor, gathered from the blocks covering them only."""
        end = self.n if end is None else end
        if end > self.n:
            raise IndexError(f"view({start}, {end}) past the {self.n} valid rows")
        if end <= start:
            return self.pool.data.new_zeros(0, self.pool.data.shape[2])
        br = self.pool.block_rows
        b0, b1 = start // br, -(-end // br)
        if b1 - b0 == 1:  # inside one block: a view, no copy
            return self.pool.data[self.block_ids[b0], start - b0 * br : end - b0 * br]
        if self._table is None:
            self._table = torch.tensor(self.block_ids, device=self.pool.data.device)  # [num blocks held]
        return self.pool.data[self._table[b0:b1]].flatten(0, 1)[start - b0 * br : end - b0 * br]

    def free(self) -> None:
        self.truncate(0)


def buffer_specs(layer) -> dict[str, tuple[int, bool]]:
    """This layer's cache kinds -> (row width, stored in the model dtype rather than fp32)."""
    attn = layer.attn
    specs = {"kv": (attn.head_dim, True)}
    if attn.compressor is not None:
        w = attn.compressor.wkv.out_features
        specs |= {"comp_kv": (w, False), "comp_score": (w, False), "compressed": (attn.head_dim, True)}
    if attn.indexer is not None:
        c = attn.indexer.compressor
        specs |= {"idx_kv": (c.wkv.out_features, False), "idx_score": (c.wkv.out_features, False),
                  "idx_keys": (c.head_dim, False)}
    return specs


class CachePools:
    """One BlockPool per cache kind per layer. `num_blocks(ratio)` sizes a pool: ratio 1 for per-position
    kinds, the layer's compress ratio for compressed kinds."""

    def __init__(self, model, block_size: int, num_blocks, device: torch.device | None = None):
        p = next(model.parameters())
        device = device or p.device
        self.block_size = block_size
        self.layers: list[dict[str, BlockPool]] = []
        for layer in model.layers:
            pools = {}
            for kind, (width, model_dtype) in buffer_specs(layer).items():
                ratio = layer.attn.ratio if kind in COMPRESSED_KINDS else 1
                pools[kind] = BlockPool(num_blocks(ratio), block_size, width, p.dtype if model_dtype else
                                        torch.float32, device)
            self.layers.append(pools)

    def all(self) -> list[BlockPool]:
        return [pool for pools in self.layers for pool in pools.values()]

    @property
    def nbytes(self) -> int:
        return sum(pool.nbytes for pool in self.all())

    @property
    def num_used_blocks(self) -> int:
        return sum(pool.num_blocks - pool.num_free_blocks for pool in self.all())


class LayerCache:
    def __init__(self, layer, dtype: torch.dtype, device: torch.device, pools: dict[str, BlockPool] | None = None):
        self.ratio = layer.attn.ratio
        self.kv = self.comp_kv = self.comp_score = self.compressed = None
        self.idx_kv = self.idx_score = self.idx_keys = None
        for kind, (width, model_dtype) in buffer_specs(layer).items():
            if pools is not None:
                buf = PagedRows(pools[kind])
            else:
                buf = GrowingRows(width, dtype if model_dtype else torch.float32, device,
                                  capacity=8 if kind in COMPRESSED_KINDS else 64)
            setattr(self, kind, buf)

    def buffers(self) -> list:
        bufs = (self.kv, self.comp_kv, self.comp_score, self.compressed, self.idx_kv, self.idx_score, self.idx_keys)
        return [b for b in bufs if b is not None]

    def truncate(self, num_tokens: int) -> None:
        for buf in (self.kv, self.comp_kv, self.comp_score, self.idx_kv, self.idx_score):
            if buf is not None:
                buf.truncate(num_tokens)
        for buf in (self.compressed, self.idx_keys):
            if buf is not None:
                buf.truncate(num_tokens // self.ratio)


class SequenceCache:
    """All layer caches of one sequence; `num_tokens` positions are committed. With `pools` the rows live in
    the shared block pools (call `free()` when the sequence leaves); without, in private growable buffers."""

    def __init__(self, model, device: torch.device | None = None, pools: CachePools | None = None):
        p = next(model.parameters())
        layer_pools = pools.layers if pools is not None else [None] * len(model.layers)
        self.layers = [LayerCache(layer, p.dtype, device or p.device, lp) for layer, lp in zip(model.layers,
                                                                                              layer_pools)]
        self.num_tokens = 0

    def truncate(self, num_tokens: int) -> None:
        """Roll back to the first `num_tokens` positions (exact: nothing of later positions is ever read)."""
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: the cache holds {self.num_tokens}")
        for layer in self.layers:
            layer.truncate(num_tokens)
        self.num_tokens = num_tokens

    def free(self) -> None:
        """Drop every position; paged storage returns all its blocks to the pools."""
        for layer in self.layers:
            for buf in layer.buffers():
                buf.free()
        self.num_tokens = 0
