"""CUDA (and HIP, through the same torch API) graphs of the target forward for decode and verify steps.

Legend: R requests padded to a captured size, q rows per request (1 for plain decode, 1 + k to verify k
drafts), T = R·q rows, W block-table columns.

A step whose every request is a decode row (its pending token plus up to q - 1 drafts) runs as a graph of
shape (R, q): requests are padded with dummy requests whose block tables hold only the cache's scratch block,
and a request with fewer drafts is padded with dummy rows. Every padded row writes only into the scratch block,
or into positions past the request's committed length, which the step that commits them rewrites before
anything reads them (the same argument that makes rejected drafts free). All shapes are static: block tables
have W columns, emit rows have one entry per row (-1 where the position closes no compressed entry), the
compressed index widths use W·bs positions, and logits are computed for every row.

Inputs live in one static int64 buffer per graph: a step packs its integers on the host, copies them to the
device once and then into the buffer, and replays. Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from sparkspec.models.cache import KVCache
from sparkspec.models.forward_batch import ForwardBatch, batch_from_flat, batch_parts

log = logging.getLogger("sparkspec.engine")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 64, 128, 256 up to max_num_seqs, and max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s < max_num_seqs]
    return sizes + [max_num_seqs]


class StaticGraph:
    """One captured (R, q) forward: its input buffer, its batch (views of the buffer) and its outputs."""

    def __init__(self, key: tuple[int, int], flat: torch.Tensor, batch: ForwardBatch, parts_len: int):
        self.key, self.flat, self.batch, self.parts_len = key, flat, batch, parts_len
        self.graph = None  # torch.cuda.CUDAGraph once captured (None: the static batch runs eagerly)
        self.output = None
        self.memo_keys: set = set()


class GraphRunner:
    """Captures and replays the target forward at padded batch sizes x query lengths."""

    def __init__(self, model, cache: KVCache, capture: dict, max_num_seqs: int, max_model_len: int,
                 query_lens: tuple[int, ...], eager: bool = False):
        """`eager`: build the same static, padded batches but run them eagerly (tests on CPU use it to check the
        padding; on a GPU it is only slower)."""
        self.model, self.cache, self.capture = model, cache, capture
        self.sizes = capture_sizes(max_num_seqs)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.width = -(-(max_model_len + max(self.query_lens)) // cache.block_size) + 1
        self.ratios = model.compress_ratios
        self.eager = eager
        self.graphs: dict[tuple[int, int], StaticGraph] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.graph_bytes = 0

    # ---- shapes ----
    def key_for(self, num_reqs: int, num_rows: int) -> tuple[int, int] | None:
        """The captured (R, q) for `num_reqs` decode requests of at most `num_rows` rows each, if any."""
        q = next((q for q in self.query_lens if q >= num_rows), None)
        R = next((s for s in self.sizes if s >= num_reqs), None)
        return None if q is None or R is None else (R, q)

    def pack(self, key, ids: list[list[int]], block_tables: list[list[int]], starts: list[int]) -> list[int]:
        """Host integers of a padded step: request r has ids[r] (its pending token and drafts) at starts[r]."""
        R, q = key
        n = len(ids)
        flat_ids = [t for row in ids for t in row + [0] * (q - len(row))] + [0] * ((R - n) * q)
        tables = block_tables + [[]] * (R - n)
        parts = batch_parts(self.cache, flat_ids, tables, starts + [0] * (R - n), [q] * R, None, self.ratios,
                            self.width, emit_every_row=True)
        return [x for part in parts for x in part]

    def static(self, key) -> StaticGraph:
        g = self.graphs.get(key)
        if g is None:
            R, q = key
            parts = batch_parts(self.cache, [0] * (R * q), [[]] * R, [0] * R, [q] * R, None, self.ratios,
                                self.width, emit_every_row=True)
            flat = torch.tensor([x for p in parts for x in p], dtype=torch.long, device=self.cache.device)
            batch, _ = batch_from_flat(flat, parts, self.cache, False, self.ratios, self.width * self.cache.block_size)
            g = self.graphs[key] = StaticGraph(key, flat, batch, flat.numel())
        return g

    # ---- capture ----
    def capture_all(self) -> None:
        """Capture every (R, q), largest first so that smaller graphs reuse the memory pool."""
        if self.eager:
            return
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.cache.device)[0]
        self.pool = torch.cuda.graph_pool_handle()
        for q in self.query_lens:
            for R in sorted(self.sizes, reverse=True):
                self.capture_one((R, q))
        torch.cuda.synchronize(self.cache.device)
        self.capture_seconds = time.perf_counter() - t0
        self.graph_bytes = max(free_before - torch.cuda.mem_get_info(self.cache.device)[0], 0)
        log.info("captured %d CUDA graphs (R in %s, q in %s) in %.1f s, %.0f MiB", len(self.graphs), self.sizes,
                 self.query_lens, self.capture_seconds, self.graph_bytes / 2**20)

    @torch.inference_mode()
    def capture_one(self, key) -> None:
        g = self.static(key)
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the kernels and settle the allocator outside the capture
                g.batch._memo.clear()
                self.model(g.batch, **self.capture)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        g.batch._memo.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            g.output = self.model(g.batch, **self.capture)
        g.graph, g.memo_keys = graph, set(g.batch._memo)

    # ---- replay ----
    def run(self, key, flat_step: torch.Tensor):
        """flat_step: the device copy of `pack(...)` (then anything else the step shipped) -> (batch, output)."""
        g = self.static(key)
        g.flat.copy_(flat_step[: g.parts_len], non_blocking=True)
        if g.graph is None:
            g.batch._memo.clear()
            g.output = self.model(g.batch, **self.capture)
        else:
            for k in set(g.batch._memo) - g.memo_keys:  # computed eagerly from an earlier step's inputs
                del g.batch._memo[k]
            g.graph.replay()
        return g.batch, g.output
