"""How many KV blocks the engine may hand out: bytes per cached position for every cache kind, and a memory budget.

One allocator: the `BlockManager` (pure Python) hands out block ids, and a block id IS a row range in every
pool of `models/cache.py` (`KVCache`: every cache kind of every target layer) and of the drafter's pools, so
whatever it admits fits by construction. A block costs `bytes_per_block` = every kind of every layer for
`block_size` positions (a block's compressed entries are charged to it). Rows older than the sliding window
are kept (the compressor re-pools them after a rollback); they are charged, not hidden.

Cache kinds per target layer and position (`ModelConfig` names):
  * sliding-window KV latent       head_dim x dtype                         every layer
  * compressor partial state       2 x width x fp32 (kv + gate score)      compressed layers (CSA / HCA)
  * compressed KV entries          head_dim x dtype / ratio                compressed layers
  * indexer partial state + keys   2 x index width x fp32 + index_head_dim x fp32 / ratio   CSA layers
  * drafter context                draft layers x head_dim x dtype          DSpark / MTP
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sparkspec.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def cache_bytes_per_token(cfg: ModelConfig, block_size: int = 16) -> dict[str, int]:
    """Bytes one cached position costs, per cache kind, summed over the target layers (the pool layout of
    `models/cache.py`; a block's compressed entries are charged to its positions, rounded up per block)."""
    elt = DTYPE_BYTES[cfg.torch_dtype]
    kinds = {"swa_kv": 0, "compressor_state": 0, "compressed_kv": 0, "indexer": 0}
    for layer in range(cfg.num_hidden_layers):
        kinds["swa_kv"] += cfg.head_dim * elt
        ratio = cfg.compress_ratio(layer)
        if ratio > 1:
            entries = -(-block_size // ratio)  # per block
            width = cfg.head_dim * (2 if ratio == 4 else 1)
            kinds["compressor_state"] += 2 * width * 4
            kinds["compressed_kv"] += -(-entries * cfg.head_dim * elt // block_size)
            if cfg.layer_types[layer] == "compressed_sparse_attention":
                iwidth = cfg.index_head_dim * (2 if ratio == 4 else 1)
                kinds["indexer"] += 2 * iwidth * 4 + -(-entries * cfg.index_head_dim * 4 // block_size)
    return kinds


@dataclass
class KVCachePlan:
    block_size: int  # positions per block
    num_blocks: int
    bytes_per_block: int
    bytes_per_token: dict[str, int]  # per cache kind
    budget_bytes: int
    source: str  # how the budget was chosen

    def describe(self) -> str:
        kinds = ", ".join(f"{k} {v} B" for k, v in self.bytes_per_token.items() if v)
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} positions = "
                f"{self.num_blocks * self.block_size} positions, {self.budget_bytes / 2**20:.1f} MiB "
                f"({self.source}); per position: {kinds}")


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
                  drafter_bytes_per_token: int = 0) -> KVCachePlan:
    """Size the pools. Precedence: an explicit byte budget (`--kv-cache-memory`), else a fraction of the
    free memory (`memory_fraction`), else enough for `max_num_seqs` requests of `max_model_len` positions,
    capped at 90% of the free memory."""
    if block_size < 1:
        raise ValueError(f"block_size = {block_size}: expected a positive integer")
    per_token = cache_bytes_per_token(cfg, block_size)
    if drafter_bytes_per_token:
        per_token["drafter"] = drafter_bytes_per_token
    bytes_per_block = block_size * sum(per_token.values())
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
        need = max_num_seqs * -(-max_len // block_size) * bytes_per_block
        cap = int(0.9 * available_memory_bytes(device))
        if need <= cap:
            budget, source = need, f"{max_num_seqs} sequences x {max_len} positions"
        else:
            budget, source = cap, "90% of free memory"
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget {budget} bytes holds no block of {bytes_per_block} bytes")
    return KVCachePlan(block_size, int(num_blocks), bytes_per_block, per_token, budget, source)


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
