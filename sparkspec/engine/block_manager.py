"""The one allocator of the KV caches, with prefix caching (pure Python).

A sequence owns `seq.block_ids`, in position order: block b of the list holds its positions b·bs .. (b+1)·bs - 1
in every pool (`models/cache.py` and the drafters' pools), so the ids handed out here ARE the storage; no
second accounting has to agree with this one. `blocks_per_seq` charges a constant number of extra blocks per
resident sequence (none of the shipped drafters needs it: their context lives in the pools). `kv_plan.py`
decides how many bytes one block stands for.

Verbs come in pairs: `can_allocate` / `allocate` / `trim` / `free`; `lookup` / `take` for prefix hits, `register`.

Every change to a sequence's list stamps it with a new `table_version` (one counter for the whole manager), so
a copy of the list kept elsewhere (the runner's persistent block tables, `engine/input_batch.py`) is current
exactly when it was taken at the stamp the sequence holds now: one int compare per step instead of a list
compare.

Prefix caching. Since every cache kind (raw sliding-window KV, the compressors' and the indexer's per-position
state, compressed entries and indexer keys, DSpark's taps, MTP's rows) is paged by absolute position through the
one block table, sharing a block shares all of it. (The drafter's rows as they are: a block prefilled or decoded
while the adaptive budget's settled plain arm skipped the drafter's context write holds stale rows there, and a
request that takes it reads them in its window until it has computed a window of its own, which costs acceptance,
never a token; `VerificationBudget.context_window`.)
A block's hash chains its parent's hash with its token ids (vLLM's scheme; sha256, so every tensor-parallel rank
computes the same hashes and takes the same hits). Terms:

* G, the hit granularity: lcm(block size, every compress ratio). Compressed entry j of ratio r (positions
  j·r .. (j+1)·r - 1) is stored in the block of position j·r and written when its LAST position is processed;
  a ratio-4 entry also reads the previous window's state. A hit h that is a multiple of G leaves every entry
  whose rows lie in the shared blocks complete (closed by a position < h), and every write of the request that
  takes the hit (raw rows, states and entries closed at positions >= h) lands in its own blocks >= h / bs.
* A group: G / bs consecutive blocks ending at a multiple of G. Blocks are registered (given their hash) a whole
  group at a time, once the sequence's committed positions cover the group: then nothing writes them again
  (a draft row at a later position closes only entries stored at or after the group's end).
* `key_next_token` (MTP): the MTP row of position p is computed from the target's streams at p AND the token at
  p + 1, so the row of h - 1 is right for a request only if its token at h is the registering one's. The block
  hash then also covers the token after the block.
* A hit: h = floor(min(matched, num_tokens - 1) / G) · G, matched = tokens of the leading blocks found in the
  cache; at least the last token is computed (its logits give the next token).

Blocks are shared by reference count. A freed block whose hash is registered stays cached (evictable, LRU: the
tail of a freed sequence is evicted first); the allocator hands out never-cached free blocks first, then evicts
the least recently used cached block and forgets its hash. A block is registered under one hash only: a second
block computed with the same content stays unregistered (freed as a plain block).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict, deque

from sparkspec.engine.sequence import Sequence


def hit_granularity(block_size: int, ratios) -> int:
    """G = lcm(block_size, every compress ratio > 1): the positions a prefix hit is a multiple of."""
    return math.lcm(block_size, *(r for r in ratios if r > 1))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, blocks_per_seq: int = 0, *,
                 enable_prefix_caching: bool = False, granularity: int | None = None, key_next_token: bool = False):
        if num_blocks < 1 or block_size < 1 or blocks_per_seq < 0:
            raise ValueError(f"BlockManager(num_blocks={num_blocks}, block_size={block_size}, "
                             f"blocks_per_seq={blocks_per_seq}): expected positive sizes")
        granularity = granularity or block_size
        if granularity % block_size:
            raise ValueError(f"granularity = {granularity}: expected a multiple of block_size {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks_per_seq = blocks_per_seq
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # free and never (or no longer) cached
        self.table_versions: dict[int, int] = {}  # seq_id -> stamp of its last block-list change
        self._clock = 0
        # prefix caching
        self.enable_prefix_caching = enable_prefix_caching
        self.granularity = granularity  # G (tokens)
        self.key_next_token = key_next_token
        self.ref_counts = [0] * num_blocks  # sequences holding each block
        self.cached: dict[bytes, int] = {}  # hash -> registered block
        self.block_hashes: dict[int, bytes] = {}  # registered block -> its hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recent first
        self.chains: dict[int, list[bytes]] = {}  # seq_id -> hashes of its leading full blocks (computed lazily)
        self.num_registered: dict[int, int] = {}  # seq_id -> tokens of its blocks already registered (groups)

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
        """Blocks an allocation may take: free ones and cached ones nobody holds (evicted when taken)."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (cached blocks nobody holds count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def can_allocate(self, seq: Sequence, num_tokens: int, hit_blocks: list[int] | None = None) -> bool:
        """Can `seq` grow to `num_tokens` positions (after taking `hit_blocks`, if given)?"""
        held = len(seq.block_ids) + len(hit_blocks or ())
        revived = sum(1 for b in hit_blocks if b in self.evictable) if hit_blocks else 0
        return self.blocks_for(num_tokens) - held <= self.num_free_blocks - revived

    def _pop_free(self) -> int:
        if self.free_block_ids:
            return self.free_block_ids.popleft()
        b, _ = self.evictable.popitem(last=False)  # the least recently used cached block: forget its hash
        del self.cached[self.block_hashes.pop(b)]
        return b

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(seq.block_ids)
        if need > self.num_free_blocks:
            raise RuntimeError(f"sequence {seq.seq_id}: needs {need} blocks, {self.num_free_blocks} free")
        if need > 0:
            refs = self.ref_counts
            for _ in range(need):
                b = self._pop_free()
                refs[b] = 1
                seq.block_ids.append(b)
            self._changed(seq)

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            if b in self.block_hashes:
                self.evictable[b] = None  # most recently used end
            else:
                self.free_block_ids.append(b)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back blocks beyond what `num_tokens` positions need (after rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        if len(seq.block_ids) > keep:
            while len(seq.block_ids) > keep:
                self._release(seq.block_ids.pop())
            self._changed(seq)

    def free(self, seq: Sequence) -> None:
        """Give back every block of `seq`; registered ones stay cached (the tail becomes least recent)."""
        for b in reversed(seq.block_ids):
            self._release(b)
        seq.block_ids.clear()
        self.table_versions.pop(seq.seq_id, None)  # a later allocate stamps it anew
        self.chains.pop(seq.seq_id, None)
        self.num_registered.pop(seq.seq_id, None)

    # ---- prefix caching ----
    def _chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of `seq`'s first `num_blocks` full blocks (fewer where its tokens do not yet cover them),
        extended from those already computed."""
        chain = self.chains.setdefault(seq.seq_id, [])
        bs, extra = self.block_size, int(self.key_next_token)
        n = min(num_blocks, (seq.num_tokens - extra) // bs)
        if len(chain) < n:
            parent = chain[-1] if chain else b""
            ids = seq.token_ids(len(chain) * bs, n * bs + extra)
            for i in range(n - len(chain)):
                h = hashlib.sha256(parent)
                h.update(array("q", ids[i * bs : (i + 1) * bs + extra]).tobytes())
                parent = h.digest()
                chain.append(parent)
        return chain[:n] if len(chain) > n else chain

    def lookup(self, seq: Sequence) -> tuple[int, list[int]]:
        """The prefix hit of a sequence that holds no blocks -> (hit tokens h, the h / bs cached blocks to take).
        (0, []) when prefix caching is off."""
        if not self.enable_prefix_caching:
            return 0, []
        G, bs = self.granularity, self.block_size
        most = (seq.num_tokens - 1) // G * G  # a hit leaves at least the last token to compute
        blocks = []
        for h in self._chain(seq, most // bs):
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        hit = len(blocks) * bs // G * G
        return hit, blocks[: hit // bs]

    def take(self, seq: Sequence, blocks: list[int]) -> None:
        """Share the cached `blocks` (from `lookup`) as the first blocks of `seq`, which holds none yet."""
        if seq.block_ids:
            raise RuntimeError(f"sequence {seq.seq_id}: takes a prefix hit while holding blocks")
        if not blocks:
            return
        refs = self.ref_counts
        for b in blocks:
            if refs[b] == 0:
                del self.evictable[b]
            refs[b] += 1
        seq.block_ids.extend(blocks)
        self.num_registered[seq.seq_id] = len(blocks) * self.block_size
        self._changed(seq)

    def register(self, seq: Sequence) -> None:
        """Give their hashes to the blocks of every whole group that `seq`'s committed positions now cover."""
        if not self.enable_prefix_caching:
            return
        done = self.num_registered.get(seq.seq_id, 0)
        G = self.granularity
        upto = min(seq.num_cached_tokens, seq.num_tokens - int(self.key_next_token)) // G * G
        if upto <= done:
            return
        bs = self.block_size
        chain = self._chain(seq, upto // bs)
        for k in range(done // bs, upto // bs):
            h, b = chain[k], seq.block_ids[k]
            if h not in self.cached and b not in self.block_hashes:
                self.cached[h] = b
                self.block_hashes[b] = h
        self.num_registered[seq.seq_id] = upto

    def will_cover(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Would `seq` (waiting) get a longer hit once a running sequence has computed its prompt? True when the
        block after its current hit is one a running sequence will register (the samples of one request, or
        requests sharing a system prompt, admitted while the first one's prefill is under way)."""
        if not self.enable_prefix_caching:
            return False
        hit, _ = self.lookup(seq)
        G, bs = self.granularity, self.block_size
        if hit + G > seq.num_tokens - 1:
            return False
        want = self._chain(seq, (hit + G) // bs)
        if len(want) * bs < hit + G:
            return False
        target = want[-1]  # the last block of the next group: computed by whoever computes the group
        for other in running:
            if other.num_cached_tokens < hit + G <= len(other.prompt_ids):
                chain = self._chain(other, (hit + G) // bs)
                if len(chain) * bs >= hit + G and chain[(hit + G) // bs - 1] == target:
                    return True
        return False
