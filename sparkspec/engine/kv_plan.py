"""How many KV blocks the engine may hand out: what a block costs in every pool, what the engine allocates
besides the blocks, and a memory budget.

One allocator: the `BlockManager` (pure Python) hands out block ids, and a block id IS a row range in every
pool of `models/cache.py` (`KVCache`: every cache kind of every target layer) and of the drafter's pools, so
whatever it admits fits by construction. A block costs `bytes_per_block` = every pool of every layer for
`block_size` positions (a block's compressed entries are charged to it), priced from the same layout
(`models.cache.cache_layout`) that `KVCache` allocates, in the dtype it allocates in. Rows older than the
sliding window are kept (the compressor re-pools them after a rollback); they are charged, not hidden.

Besides the blocks (`overhead_bytes`): every pool's scratch block (one block more than handed out) and trash row,
and the runner's buffers (`ModelRunner.buffers`: `q_store`, [max_num_seqs + 4, k, V] fp32, with on-device drafts).
`total_bytes` = blocks + overhead is what the engine allocates for its caches.

Cache kinds per target layer and position (`bytes_per_token`, for the startup line):
  * sliding-window KV latent       head_dim x dtype                         every layer
  * compressor partial state       2 x width x fp32 (kv + gate score)      compressed layers (CSA / HCA)
  * compressed KV entries          head_dim x dtype / ratio                compressed layers
  * indexer partial state + keys   2 x index width x fp32 + index_head_dim x fp32 / ratio   CSA layers
  * drafter context                draft layers x head_dim x dtype          DSpark / MTP
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from sparkspec.config import ModelConfig
from sparkspec.models.cache import cache_layout

# pool kind (`models.cache.Pool.kind`) -> the cache kind it is reported under ("attn" splits into the raw rows
# and the block's compressed entries)
KIND_NAMES = {"comp_kv": "compressor_state", "comp_score": "compressor_state", "idx_kv": "indexer",
              "idx_score": "indexer", "idx_keys": "indexer"}


def latent_dtype(cfg: ModelConfig, dtype: torch.dtype | None) -> torch.dtype:
    """The latent pools' dtype: the model's (what `KVCache` allocates in); None: the config's `torch_dtype`."""
    return dtype if dtype is not None else getattr(torch, cfg.torch_dtype)


def cache_bytes_per_block(cfg: ModelConfig, block_size: int = 16, dtype: torch.dtype | None = None
                          ) -> dict[str, int]:
    """Bytes one block costs, per cache kind, summed over the target layers' pools (`cache_layout`)."""
    kinds = {"swa_kv": 0, "compressor_state": 0, "compressed_kv": 0, "indexer": 0}
    for pools in cache_layout(cfg, block_size, latent_dtype(cfg, dtype)):
        for p in pools:
            if p.kind == "attn":
                kinds["swa_kv"] += block_size * p.bytes_per_row
                kinds["compressed_kv"] += p.bytes_per_block - block_size * p.bytes_per_row
            else:
                kinds[KIND_NAMES[p.kind]] += p.bytes_per_block
    return kinds


def cache_bytes_per_token(cfg: ModelConfig, block_size: int = 16, dtype: torch.dtype | None = None
                          ) -> dict[str, int]:
    """Bytes one cached position costs, per cache kind (a block's compressed entries are charged to its
    positions, rounded up). `dtype`: the latent pools' (the loaded model's); None: the config's."""
    return {k: -(-v // block_size) for k, v in cache_bytes_per_block(cfg, block_size, dtype).items()}


@dataclass
class KVCachePlan:
    block_size: int  # positions per block
    num_blocks: int
    bytes_per_block: int
    bytes_per_token: dict[str, int]  # per cache kind
    budget_bytes: int
    source: str  # how the budget was chosen
    overhead_bytes: dict[str, int] = field(default_factory=dict)  # allocated besides the blocks, by name

    @property
    def total_bytes(self) -> int:
        """Everything the engine allocates for its caches: the blocks and the overhead."""
        return self.num_blocks * self.bytes_per_block + sum(self.overhead_bytes.values())

    def describe(self) -> str:
        kinds = ", ".join(f"{k} {v} B" for k, v in self.bytes_per_token.items() if v)
        extra = ", ".join(f"{k} {v / 2**20:.1f} MiB" if v >= 2**20 else f"{k} {v / 2**10:.1f} KiB"
                          for k, v in self.overhead_bytes.items() if v)
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} positions = "
                f"{self.num_blocks * self.block_size} positions, {self.total_bytes / 2**20:.1f} MiB allocated "
                f"({self.source}; besides the blocks: {extra}); per position: {kinds}")


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


def plan_kv_cache(cfg: ModelConfig, *, dtype: torch.dtype | None = None, block_size: int = 16,
                  max_num_seqs: int = 64, max_model_len: int | None = None, kv_cache_memory: int | None = None,
                  memory_fraction: float | None = None, device: str = "cpu", drafter_bytes_per_token: int = 0,
                  buffer_bytes: dict[str, int] | None = None) -> KVCachePlan:
    """Size the pools. Precedence: an explicit byte budget for the blocks (`--kv-cache-memory`; the overhead
    comes on top), else a fraction of the free memory (`memory_fraction`), else enough for `max_num_seqs`
    requests of `max_model_len` positions, capped at 90% of the free memory; a share of free memory covers the
    overhead too. `dtype`: the latent pools' (the loaded model's, which may differ from the config's);
    `drafter_bytes_per_token`: the drafter's pools (`Proposer.bytes_per_position`); `buffer_bytes`: the runner's
    other buffers (`ModelRunner.buffers`)."""
    if block_size < 1:
        raise ValueError(f"block_size = {block_size}: expected a positive integer")
    per_token = cache_bytes_per_token(cfg, block_size, dtype)
    if drafter_bytes_per_token:
        per_token["drafter"] = drafter_bytes_per_token
    pools = [p for layer in cache_layout(cfg, block_size, latent_dtype(cfg, dtype)) for p in layer]
    bytes_per_block = sum(p.bytes_per_block for p in pools) + block_size * drafter_bytes_per_token
    # a drafter's bytes_per_position is one row of each of its pools: its trash rows
    overhead = {"scratch block": bytes_per_block,
                "trash rows": sum(p.bytes_per_row for p in pools) + drafter_bytes_per_token, **(buffer_bytes or {})}
    fixed = sum(overhead.values())
    max_len = max_model_len or cfg.max_position_embeddings
    if kv_cache_memory is not None:
        if kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory = {kv_cache_memory}: expected a positive number of bytes")
        budget, source, blocks_budget = int(kv_cache_memory), "--kv-cache-memory", int(kv_cache_memory)
    elif memory_fraction is not None:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction = {memory_fraction}: expected a number in (0, 1]")
        budget, source = int(available_memory_bytes(device) * memory_fraction), f"{memory_fraction:.0%} of free memory"
        blocks_budget = budget - fixed
    else:
        need = max_num_seqs * -(-max_len // block_size) * bytes_per_block + fixed
        cap = int(0.9 * available_memory_bytes(device))
        if need <= cap:
            budget, source = need, f"{max_num_seqs} sequences x {max_len} positions"
        else:
            budget, source = cap, "90% of free memory"
        blocks_budget = budget - fixed
    num_blocks = max(blocks_budget, 0) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget {budget} bytes holds no block of {bytes_per_block} bytes"
                         + (f" besides the {fixed} bytes allocated with the blocks" if blocks_budget < budget else ""))
    return KVCachePlan(block_size, int(num_blocks), bytes_per_block, per_token, budget, source, overhead)


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
