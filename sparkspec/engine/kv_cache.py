"""How many KV blocks the engine may hand out: bytes per cached position for every cache kind, and a memory budget.

The budget is real memory: the engine preallocates one block pool per cache kind per target layer
(`sparkspec/models/cache.py`: `CachePools`, `BlockPool`) and every sequence's caches are block tables into them
(`PagedRows`). A block holds `block_size` rows: positions for the per-position kinds, entries for the compressed
kinds (one entry per `ratio` positions). Rollback (`truncate`), preemption, finish, abort and disconnect return
blocks to the pools.

One source of truth: the `BlockManager` (pure Python) decides admission and preemption. It charges a sequence
`ceil(positions / block_size)` blocks of `bytes_per_block` (every kind of every layer for `block_size` positions)
plus `blocks_per_seq` for drafter state that does not grow with the sequence (the drafters keep that themselves).
`num_pool_blocks` sizes each pool so that whatever the BlockManager admits always fits, so a pool never runs out
for an admitted request (`OutOfBlocks` would be a bug). Per-position pools get `num_blocks - blocks_per_seq` blocks
(at most that many position blocks are ever charged); compressed pools get one block per `ratio` position blocks,
plus one per resident sequence for rounding (capped at the per-position count). So what is allocated differs from
what is charged by: + up to `max_num_seqs` rounding blocks per compressed pool, - `blocks_per_seq` position
blocks, and the drafters' own state (charged, allocated by the drafter). Rows older than the sliding window are
kept (the compressor re-pools them after a rollback, see `models/cache.py`); they are charged, not hidden.

Cache kinds per target layer and position (`ModelConfig` names):
  * sliding-window KV latent       head_dim x dtype                         every layer
  * compressor partial state       2 x width x fp32 (kv + gate score)      compressed layers (CSA / HCA)
  * compressed KV entries          head_dim x dtype / ratio                compressed layers
  * indexer partial state + keys   2 x index width x fp32 + index_head_dim x fp32 / ratio   CSA layers
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sparkspec.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def cache_bytes_per_token(cfg: ModelConfig) -> dict[str, int]:
    """Bytes one cached position costs, per cache kind, summed over the target layers."""
    elt = DTYPE_BYTES[cfg.torch_dtype]
    kinds = {"swa_kv": 0, "compressor_state": 0, "compressed_kv": 0, "indexer": 0}
    for layer in range(cfg.num_hidden_layers):
        kinds["swa_kv"] += cfg.head_dim * elt
        ratio = cfg.compress_ratio(layer)
        if ratio > 1:
            width = cfg.head_dim * (2 if ratio == 4 else 1)
            kinds["compressor_state"] += 2 * width * 4
            kinds["compressed_kv"] += -(-cfg.head_dim * elt // ratio)
            if cfg.layer_types[layer] == "compressed_sparse_attention":
                iwidth = cfg.index_head_dim * (2 if ratio == 4 else 1)
                kinds["indexer"] += 2 * iwidth * 4 + -(-cfg.index_head_dim * 4 // ratio)
    return kinds


def drafter_bytes_per_seq(cfg: ModelConfig, method: str, num_spec_tokens: int) -> int:
    """Per-request drafter state that does not grow with the sequence (context windows of the draft layers)."""
    elt = DTYPE_BYTES[cfg.torch_dtype]
    if method == "dspark":
        rows = cfg.sliding_window + num_spec_tokens + 1
        return cfg.num_dspark_layers * rows * cfg.head_dim * elt
    if method == "mtp":
        return max(cfg.num_nextn_predict_layers, 1) * (cfg.sliding_window + num_spec_tokens + 1) * cfg.head_dim * elt
    return 0


@dataclass
class KVCachePlan:
    block_size: int  # positions per block
    num_blocks: int
    bytes_per_block: int
    blocks_per_seq: int  # fixed per-request charge (drafter state)
    bytes_per_token: dict[str, int]  # per cache kind
    budget_bytes: int
    source: str  # how the budget was chosen

    def num_pool_blocks(self, ratio: int, max_num_seqs: int) -> int:
        """Blocks for one pool: per-position kinds (ratio 1) or compressed kinds of a layer with this ratio.
        S resident sequences holding k_i position blocks need sum ceil(k_i / ratio) <= K / ratio + S compressed
        blocks, and never more than K (K = position blocks charged <= num_blocks - blocks_per_seq)."""
        positions = self.num_blocks - self.blocks_per_seq
        if ratio <= 1:
            return positions
        return min(positions, -(-positions // ratio) + max_num_seqs)

    def describe(self) -> str:
        kinds = ", ".join(f"{k} {v} B" for k, v in self.bytes_per_token.items() if v)
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} positions = "
                f"{self.num_blocks * self.block_size} positions, {self.budget_bytes / 2**20:.1f} MiB "
                f"({self.source}); per position: {kinds}; +{self.blocks_per_seq} blocks per request for drafter state")


def available_memory_bytes(device: str = "cpu") -> int:
    """Free memory on the device (accelerators) or available RAM (CPU)."""
    if device != "cpu":
        import torch

        backend = torch.xpu if device.startswith("xpu") else torch.cuda  # ROCm is torch.cuda too
        free, _ = backend.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_kv_cache(cfg: ModelConfig, *, block_size: int = 16, max_num_seqs: int = 64, max_model_len: int | None = None,
                  kv_cache_memory: int | None = None, memory_fraction: float | None = None, device: str = "cpu",
                  spec_method: str = "none", num_spec_tokens: int = 0) -> KVCachePlan:
    """Size the block pool. Precedence: an explicit byte budget (`--kv-cache-memory`), else a fraction of the
    free memory (`memory_fraction`), else enough for `max_num_seqs` requests of `max_model_len` positions,
    capped at 90% of the free memory."""
    if block_size < 1:
        raise ValueError(f"block_size = {block_size}: expected a positive integer")
    per_token = cache_bytes_per_token(cfg)
    bytes_per_block = block_size * sum(per_token.values())
    per_seq = drafter_bytes_per_seq(cfg, spec_method, num_spec_tokens)
    blocks_per_seq = -(-per_seq // bytes_per_block)
    max_len = max_model_len or cfg.max_position_embeddings
    if kv_cache_memory is not None:
        if kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory = {kv_cache_memory}: expected a positive number of bytes")
        budget, source = int(kv_cache_memory), "--kv-cache-memory"
    elif memory_fraction is not None:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction = {memory_fraction}: expected a number in (0, 1]")
        budget, source = int(available_memory_bytes(device) * memory_fraction), f"{memory_fraction:.0%} of free memory"
    else:
        need = max_num_seqs * (-(-max_len // block_size) + blocks_per_seq) * bytes_per_block
        cap = int(0.9 * available_memory_bytes(device))
        if need <= cap:
            budget, source = need, f"{max_num_seqs} sequences x {max_len} positions"
        else:
            budget, source = cap, "90% of free memory"
    num_blocks = budget // bytes_per_block
    if num_blocks < 1 + blocks_per_seq:
        raise ValueError(f"KV cache budget {budget} bytes holds {num_blocks} blocks of {bytes_per_block} bytes; "
                         f"at least {1 + blocks_per_seq} are needed for one request")
    return KVCachePlan(block_size, int(num_blocks), bytes_per_block, blocks_per_seq, per_token, budget, source)


def parse_memory(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1000000' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    try:
        if t and t[-1] in scale:
            return int(float(t[:-1]) * scale[t[-1]])
        return int(float(t))
    except ValueError:
        raise ValueError(f"memory size {text!r}: expected a number of bytes with an optional K/M/G/T suffix") from None
