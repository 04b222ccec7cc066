"""The flat batch one model forward runs on. Legend: T tokens, R requests, M entries emitted, L logits rows.

The runner builds one `ForwardBatch` per step from host integers with a single host->device copy: requests
are packed back to back (request r owns rows cu_seqlens_q[r]:cu_seqlens_q[r+1] at consecutive positions).
The model never sees a sequence object or a Python list of spans: every cache write and read goes through
the block tables (see `models/cache.py` for the pool layout), so a layer's forward is the same handful of
ops for one request or for a hundred.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sparkspec.models.cache import KVCache, entries_per_block
from sparkspec.ops.indices import emission_plan, entry_table, pool_rows, window_positions


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute positions
    req_idx: torch.Tensor  # [T] request row of each token
    cu_seqlens_q: torch.Tensor  # [R+1]
    seq_lens: torch.Tensor  # [R] positions held after this forward (start + tokens)
    block_tables: torch.Tensor  # [R, max_blocks] block ids (padded with the cache's scratch block)
    logits_rows: torch.Tensor | None  # [L] rows whose logits are returned; None = every row
    emit_rows: dict[int, torch.Tensor]  # ratio -> [M] rows whose position closes a compressed entry (-1 pads)
    cache: KVCache
    max_seq_len: int  # host copy of seq_lens.max(): widths of the compressed index lists
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    # ---- pool addressing (memoised per forward: every layer of one ratio shares them) ----
    def rows_of(self, positions: torch.Tensor, req: torch.Tensor, rows_per_block: int, fill: int = -1
                ) -> torch.Tensor:
        """Pool rows of raw positions [*] of requests req [*] (`fill` where position < 0)."""
        return pool_rows(self.block_tables, req, positions, self.block_size, rows_per_block, fill=fill)

    def entry_rows(self, entries: torch.Tensor, req: torch.Tensor, ratio: int, rows_per_block: int,
                   first_row: int, fill: int = -1) -> torch.Tensor:
        """Pool rows of compressed entries [*] of requests req [*] (`fill` where entry < 0)."""
        return pool_rows(self.block_tables, req, entries, self.block_size, rows_per_block, first_row, ratio, fill)

    def memo(self, key, fn):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def emission(self, ratio: int, span: int) -> Emission:
        """The compressed entries this step's rows close, for every layer of this ratio (memoised)."""
        return self.memo(("emission", ratio, span), lambda: Emission.plan(self, ratio, span))

    def token_rows(self, ratio: int) -> torch.Tensor:
        """[T] rows of this step's tokens in a layer's `attn` pool (raw K=V)."""
        return self._token_rows(self.block_size + entries_per_block(self.block_size, ratio))

    def state_rows(self) -> torch.Tensor:
        """[T] rows of this step's tokens in per-position pools (compressor / indexer state)."""
        return self._token_rows(self.block_size)

    def _token_rows(self, rows_per_block: int) -> torch.Tensor:
        """Tokens' rows in a pool with `rows_per_block` rows per block, once per distinct layout (sliding layers'
        `attn` pools and the state pools share one)."""
        return self.memo(("token_rows", rows_per_block), lambda: self.rows_of(self.positions, self.req_idx,
                                                                               rows_per_block))

    def sliding_rows(self, window: int, ratio: int) -> torch.Tensor:
        """[T, W] each query's sliding-window rows in a layer's `attn` pool (the window's positions shared by every
        ratio: only the rows per block differ)."""
        e = entries_per_block(self.block_size, ratio)
        return self.memo(("window", window, ratio), lambda: self.rows_of(
            self.memo(("window_positions", window), lambda: window_positions(self.positions, window)),
            self.req_idx.unsqueeze(1), self.block_size + e))

    def visible(self, ratio: int) -> torch.Tensor:
        """[T] compressed entries each query sees, (pos + 1) // ratio."""
        return self.memo(("visible", ratio), lambda: (self.positions + 1) // ratio)

    def visible_entry_rows(self, ratio: int) -> torch.Tensor:
        """[T, C] `attn`-pool rows of every entry j < C = max_seq_len // ratio that each query sees, -1 beyond (a
        heavily compressed layer reads them all)."""
        def rows():
            j = torch.arange(self.max_seq_len // ratio, device=self.positions.device).unsqueeze(0)  # [1, C]
            seen = torch.where(j < self.visible(ratio).unsqueeze(1), j, -1)
            e = entries_per_block(self.block_size, ratio)
            return self.entry_rows(seen, self.req_idx.unsqueeze(1), ratio, self.block_size + e, self.block_size)
        return self.memo(("visible_rows", ratio), rows)

    def entry_table(self, ratio: int) -> torch.Tensor:
        """[R, C + 1] `attn`-pool rows of each request's compressed entries j < C = max_seq_len // ratio, then -1."""
        return self.memo(("entry_table", ratio), lambda: entry_table(self.block_tables, self.block_size, ratio,
                                                                     self.max_seq_len // ratio))


@dataclass
class Emission:
    """Where the entries of one ratio come from and go to (shared by the compressor and the indexer's
    compressor of every layer with that ratio). Legend: M entry slots (emit rows, -1 padded), span pooled rows."""

    last: torch.Tensor  # [M] position closing each entry, (j+1)·ratio - 1 (-1 for pads)
    entry_ids: torch.Tensor  # [M] j (-1 for pads)
    first: torch.Tensor  # [M] the entry's first position j·ratio (last + 1 - ratio): its rotation
    gather: torch.Tensor  # [M, span] per-position pool rows pooled by each entry, oldest first (0 where none)
    missing: torch.Tensor  # [M, span] bool: that position is < 0
    attn_rows: torch.Tensor  # [M] rows of the `attn` pool the entries go to (the trash row for pads)
    key_rows: torch.Tensor  # [M] rows of the `idx_keys` pool (the trash row for pads)

    @classmethod
    def plan(cls, b: ForwardBatch, ratio: int, span: int) -> Emission:
        e = entries_per_block(b.block_size, ratio)
        return cls(*emission_plan(b.emit_rows[ratio], b.positions, b.req_idx, b.block_tables, b.block_size, ratio,
                                  span, b.cache.trash_row(b.block_size + e), b.cache.trash_row(e)))


def batch_parts(
    cache: KVCache,
    input_ids: list[int],  # [T]
    block_tables: list[list[int]],  # per request
    starts: list[int],  # per request: position of its first row
    num_tokens: list[int],  # per request: rows this forward
    logits_rows: list[int] | None,
    ratios: tuple[int, ...],
    width: int | None = None,  # block-table columns (default: the longest table)
    emit_every_row: bool = False,  # emit rows as one entry per row (the row, or -1): a static length
) -> list[list[int]]:
    """The host integers of a batch, part by part (ids, positions, request rows, cu_seqlens_q, seq_lens, block
    tables, logits rows, emit rows per ratio)."""
    positions, req_idx, cu = [], [], [0]
    for r, (s, n) in enumerate(zip(starts, num_tokens)):
        positions += range(s, s + n)
        req_idx += [r] * n
        cu.append(cu[-1] + n)
    seq_lens = [s + n for s, n in zip(starts, num_tokens)]
    width = width or max((len(t) for t in block_tables), default=0) or 1
    tables = [b for t in block_tables for b in list(t) + [cache.scratch_block] * (width - len(t))]
    if emit_every_row:
        emits = [[t if (p + 1) % ratio == 0 else -1 for t, p in enumerate(positions)] for ratio in ratios]
    else:
        emits = [[t for t, p in enumerate(positions) if (p + 1) % ratio == 0] for ratio in ratios]
    return [list(input_ids), positions, req_idx, cu, seq_lens, tables, logits_rows or [], *emits]


def batch_from_flat(flat: torch.Tensor, parts: list[list[int]], cache: KVCache, has_logits_rows: bool,
                    ratios: tuple[int, ...], max_seq_len: int) -> tuple[ForwardBatch, torch.Tensor]:
    """Slice a batch out of its device copy (laid out as `batch_parts`) -> (batch, what follows it in `flat`)."""
    out, off = [], 0
    for part in parts:
        out.append(flat[off : off + len(part)])
        off += len(part)
    ids_t, pos_t, req_t, cu_t, lens_t, tab_t, rows_t, *emit_t = out
    R = len(parts[4])
    batch = ForwardBatch(ids_t, pos_t, req_t, cu_t, lens_t, tab_t.view(R, -1), rows_t if has_logits_rows else None,
                         dict(zip(ratios, emit_t)), cache, max_seq_len)
    return batch, flat[off:]


PINNED_DEPTH = 4  # pinned host buffers kept per (device, dtype), handed out in turn


@dataclass
class _PinnedRing:
    buffers: list = field(default_factory=lambda: [None] * PINNED_DEPTH)
    events: list = field(default_factory=lambda: [None] * PINNED_DEPTH)  # each buffer's last copy
    turn: int = -1


_PINNED: dict[tuple[torch.device, torch.dtype], _PinnedRing] = {}


def pinned_buffer(device: torch.device, dtype: torch.dtype, n: int) -> torch.Tensor:
    """A pinned host buffer of n elements for an asynchronous copy to or from `device`, from `PINNED_DEPTH` kept
    per (device, dtype) and handed out in turn (allocating pinned memory costs milliseconds). The caller enqueues
    its copy and then calls `pinned_copied`; a buffer handed out again first waits for that copy (a step launched
    ahead uploads once per part: a mixed step's decode graph, then its prompts, while the step before it may not
    have started on the device)."""
    ring = _PINNED.setdefault((device, dtype), _PinnedRing())
    ring.turn = i = (ring.turn + 1) % PINNED_DEPTH
    buf, done = ring.buffers[i], ring.events[i]
    if done is not None:
        done.synchronize()  # (at once unless the device is PINNED_DEPTH copies behind)
        ring.events[i] = None
    if buf is None or buf.numel() < n:
        size = max(n, 2 * (buf.numel() if buf is not None else 1 << 14))
        with torch.inference_mode(False):  # a normal tensor: one made under inference mode is reused outside it
            buf = ring.buffers[i] = torch.empty(size, dtype=dtype, pin_memory=True)
    return buf[:n]


def pinned_copied(device: torch.device, dtype: torch.dtype):
    """The copy from or into the buffer `pinned_buffer` handed out last is enqueued -> its event (recorded now)."""
    ring = _PINNED[(device, dtype)]
    done = ring.events[ring.turn] = torch.cuda.Event() if device.type == "cuda" else torch.Event(device=device)
    done.record()
    return done


def to_device(values: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """The one host->device copy of a step, asynchronous from a kept pinned buffer (`pinned_buffer`)."""
    flat = torch.as_tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return flat
    staging = pinned_buffer(device, torch.long, flat.numel())
    staging.copy_(flat)
    out = staging.to(device, non_blocking=True)
    pinned_copied(device, torch.long)
    return out


def build_batch(
    cache: KVCache,
    input_ids: list[int] | torch.Tensor,  # [T]
    block_tables: list[list[int]],  # per request
    starts: list[int],  # per request: position of its first row
    num_tokens: list[int],  # per request: rows this forward
    logits_rows: list[int] | None = None,
    ratios: tuple[int, ...] = (),  # compress ratios of the model's layers (> 1)
    extra: list[int] | None = None,  # more host ints to ship in the same copy (returned as batch._memo["extra"])
) -> ForwardBatch:
    """Pack host integers into one int64 tensor, copy it to the device once, and slice the batch out of it."""
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    ratios = tuple(sorted(set(ratios)))
    parts = batch_parts(cache, ids, block_tables, starts, num_tokens, logits_rows, ratios)
    flat = to_device([x for part in parts for x in part] + (extra or []), cache.device)
    batch, rest = batch_from_flat(flat, parts, cache, logits_rows is not None, ratios,
                                  max((s + n for s, n in zip(starts, num_tokens)), default=0))
    batch._memo["extra"] = rest
    return batch


def sequences_batch(cache: KVCache, input_ids: torch.Tensor | np.ndarray, tables: list[list[int]],
                    lengths: list[int] | np.ndarray, logits_rows: list[int] | None, ratios: tuple[int, ...]
                    ) -> ForwardBatch:
    """`build_batch` for whole sequences from position 0, with numpy doing the per-token arithmetic (a training
    step packs ~10^5 tokens: Python lists would cost more than the step's kernels) -> the same ForwardBatch."""
    lens = np.asarray(lengths, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    req = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(cu[-1]) - cu[:-1][req]
    width = max((len(t) for t in tables), default=0) or 1
    table = np.full((len(tables), width), cache.scratch_block, dtype=np.int64)
    for r, t in enumerate(tables):
        table[r, : len(t)] = t
    ratios = tuple(sorted(set(ratios)))
    ids = input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids)
    parts = [ids.astype(np.int64), pos, req, cu, lens, table.ravel(), np.asarray(logits_rows or [], dtype=np.int64),
             *(np.flatnonzero((pos + 1) % r == 0) for r in ratios)]
    flat = to_device(np.concatenate(parts), cache.device)
    batch, _ = batch_from_flat(flat, parts, cache, logits_rows is not None, ratios, int(lens.max(initial=0)))
    return batch


def forward_sequences(model, input_ids: torch.Tensor | np.ndarray, lengths: list[int] | np.ndarray,
                      logits_rows: list[int] | None = None, **capture):
    """Whole sequences packed back to back from position 0, through a fresh cache sized for them (training,
    tests, timing probes: callers without a block manager) -> ModelOutput."""
    cache, tables = KVCache.for_lengths(model, lengths)
    return model(sequences_batch(cache, input_ids, tables, lengths, logits_rows, model.compress_ratios), **capture)
