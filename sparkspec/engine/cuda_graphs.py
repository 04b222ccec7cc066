"""CUDA (and HIP, through the same torch API) graphs of whole decode and verify steps: the target forward, the
rejection sampler and the device drafter, replayed as one graph.

Legend: R requests padded to a captured size, q rows per request (1 for plain decode, 1 + k to verify k
drafts), T = R·q rows, W block-table columns.

A step whose every request is a decode row (its pending token plus up to q - 1 drafts), or that prefills the
prompts (or last chunks) of up to R requests of at most q tokens each and samples after each, runs as the graph
of its `GraphKey`: requests are padded with dummy requests whose block tables hold only the cache's scratch block, and
a request with fewer drafts is padded with dummy rows. Every padded row writes only into the scratch block, or
into positions past the request's committed length, which the step that commits them rewrites before anything
reads them (the same argument that makes rejected drafts free). Dummy requests sample greedily with no drafts.
All shapes are static: block tables have W columns (`width_for`), emit rows have one entry per row (-1 where
the position closes no compressed entry), the compressed index widths use W·bs positions, and logits are
computed for every row.

A key also fixes what a step's host flags decide eagerly: the sampling mode (`greedy`: every request at
temperature 0; `sample`: no top-k / top-p; `filter`: some request filters) and how many drafts the drafter
proposes at the end (0, or the configured k: a step that wants fewer keeps the first ones, which do not depend
on how many follow).

Inputs live in one static int64 buffer per graph, laid out as the batch, then the step's named parts
(`step_io.Upload`): a step packs its integers on the host, copies them to the device once and then into the
buffer, and replays (the decode / verify steps from the persistent batch of `input_batch.py`, numpy over slot
arrays; prefills from `pack`'s lists: both lay it out the same way). Prefill graphs hold R·q rows up to
`prefill_rows` (the step's token budget); more prompts than one graph holds run as several (`prefill_groups`),
and the scheduler does not split a prompt that one graph holds (`SchedulerConfig.unsplit_prompt_len`). Chunks
that do not sample, prompts longer than the longest prefill length, and steps that return logprobs run eagerly.

Mixed graphs: requests join a running batch on most steps of a busy server, and a step of decode rows plus a
joining prompt used to replay two graphs (the decode graph, then a prefill graph), each a full pass over the
model's kernels. A mixed key adds, after the R·q decode / verify rows, `prompt_rows` rows shared by
`MIXED_PROMPTS` prompt slots (`prompt_slot_rows`: back to back, ragged; the model reads rows, positions and
request ids, never a fixed query length), so that such a step replays one graph; the head runs on the sampled
rows only (`GraphKey.gathered`). The packer orders the sampling requests real ones first (decode, then prompts)
and dummies last, so a step's outputs read as any other's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from sparkspec.engine.step_io import Upload
from sparkspec.models.cache import KVCache
from sparkspec.models.forward_batch import ForwardBatch, batch_from_flat, batch_parts

log = logging.getLogger("sparkspec.engine")

SAMPLING_MODES = ("greedy", "sample", "filter")


# prompt slots of a mixed graph (`GraphKey.num_prompts`): on the H200 demo pair at c = 64 with output lengths that
# vary, half the steps carried a joining prompt, and 1-3 of them most of the time
MIXED_PROMPTS = 4


class GraphKey(NamedTuple):
    num_reqs: int  # R, a captured batch size (of decode / verify requests in a mixed graph)
    q: int  # rows per request
    mode: str  # one of SAMPLING_MODES
    num_drafts: int  # drafts proposed at the end of the step (0 = the drafter does not run)
    draft_cols: int  # K, drafts a request may verify: q - 1 for decode / verify rows, 0 for a prefill
    prompt_rows: int = 0  # Tp: a mixed graph's prompt rows after the R·q decode rows (0: not mixed)
    num_prompts: int = 0  # P: its prompt slots, which share those rows (`prompt_slot_rows`)
    context: bool = True  # the device drafter writes the step's rows into its context (False: a plain step's rows
    # while the adaptive budget's plain arm holds, `GraphRunner.decode_context`: the plain engine's graph)

    @property
    def num_sampling(self) -> int:
        """Requests that sample: R, and a mixed graph's P prompt slots."""
        return self.num_reqs + self.num_prompts

    @property
    def gathered(self) -> bool:
        """The head runs on the sampled rows only (prefill and mixed graphs), not on every row."""
        return self.q > self.draft_cols + 1 or self.num_prompts > 0


def mixed_rows_needed(num_prompt_tokens: int, num_prompts: int) -> int:
    """Prompt rows a mixed graph needs for `num_prompts` chunks of `num_prompt_tokens` tokens in all: theirs, and
    a row for each empty slot (`prompt_slot_rows`)."""
    return num_prompt_tokens + MIXED_PROMPTS - num_prompts


def prompt_slot_rows(key: GraphKey, lengths: list[int]) -> list[int]:
    """Rows of each prompt slot of mixed graph `key` holding prompt chunks of `lengths` tokens (then dummies): each
    chunk its own rows, a dummy one row, and the last slot every row left over (its rows past a real chunk's end
    are padding, written past the request's length as a verify step's rejected rows are)."""
    rows = list(lengths) + [1] * (key.num_prompts - len(lengths))
    rows[-1] += key.prompt_rows - sum(rows)
    return rows


def request_rows(key: GraphKey, lengths: list[int] = ()) -> list[int]:
    """Rows of every request of `key`'s graph, in batch order: R·[q], then the prompt slots (mixed graphs)."""
    return [key.q] * key.num_reqs + (prompt_slot_rows(key, lengths) if key.num_prompts else [])


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 64, 128, 256 up to max_num_seqs, and max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s < max_num_seqs]
    return sizes + [max_num_seqs]


class StaticGraph:
    """One captured step: its input buffer, its batch and parts (views of the buffer) and its outputs."""

    def __init__(self, key: GraphKey, flat: torch.Tensor, batch: ForwardBatch, parts: dict[str, torch.Tensor],
                 length: int):
        self.key, self.flat, self.batch, self.parts, self.length = key, flat, batch, parts, length
        self.graph = None  # torch.cuda.CUDAGraph once captured (None: the static step runs eagerly)
        self.output = None
        self.memo_keys: set = set()


StepFn = Callable[[GraphKey, ForwardBatch, dict], object]  # (key, batch, parts) -> the step's device outputs
UploadFn = Callable[[GraphKey], Upload]  # key -> the parts of an all-dummy step (their lengths are the key's)


class GraphRunner:
    """Captures and replays whole steps at padded batch sizes x query lengths x modes."""

    def __init__(self, cache: KVCache, ratios: tuple[int, ...], step: StepFn, dummy_upload: UploadFn,
                 max_num_seqs: int, max_model_len: int, query_lens: tuple[int, ...], eager: bool = False,
                 preserve: tuple[torch.Tensor, ...] = (), prefill_lens: tuple[int, ...] = (), prefill_rows: int = 0):
        """`step` runs one step on the device (captured as is); `eager`: build the same static, padded batches
        but run them eagerly (tests on CPU use it to check the padding; on a GPU it is only slower). `preserve`:
        state a step reads before it writes it (the drafter's q of the last proposal): a capture while serving
        runs dummy steps, so it is restored afterwards. `prefill_rows`: most padded rows R·q of a prefill graph
        (its R are the captured sizes that fit; one request always fits)."""
        self.cache, self.ratios, self.step, self.dummy_upload = cache, ratios, step, dummy_upload
        self.preserve = preserve
        self.sizes = capture_sizes(max_num_seqs)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.prefill_lens = tuple(sorted(q for q in set(prefill_lens) if q > max(self.query_lens)))
        # block-table columns: positions up to max_model_len, plus a padded step's rows past a request's end, plus
        # the scratch block. Decode / verify graphs (the ones every step uploads) pad by at most max(query_lens);
        # prefill graphs by their q, so they get a wider table of their own rather than widening every decode step
        self.width = self.columns(max_model_len + max(self.query_lens))
        self.prefill_width = self.columns(max_model_len + max(self.prefill_lens, default=0))
        # q -> the request counts R captured for prefills of q rows each: R·q <= prefill_rows
        self.prefill_sizes = {q: [R for R in self.sizes if R == 1 or R * q <= prefill_rows] for q in self.prefill_lens}
        # prompt rows of mixed graphs (decode / verify rows and joining prompts in one graph): the longest prefill
        # length, a half and an eighth of it, so that three graphs per batch size hold one to `MIXED_PROMPTS`
        # prompts with at most ~4x their rows (one prompt of a typical chat turn, ~130 tokens, pads to 256)
        longest = max(self.prefill_lens, default=0)
        self.mixed_rows = tuple(t for t in self.prefill_lens if t in (longest // 8, longest // 2, longest))
        self.eager = eager
        # whether the plain graphs (decode, prefill and mixed ones that verify and propose nothing) that `key_for`
        # and `mixed_key_for` name write the device drafter's context (`ModelRunner.context_writes`)
        self.decode_context = True
        self.graphs: dict[GraphKey, StaticGraph] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.graph_bytes = 0

    # ---- shapes ----
    def columns(self, num_positions: int) -> int:
        return -(-num_positions // self.cache.block_size) + 1

    def width_for(self, key: GraphKey) -> int:
        """Block-table columns of `key`'s graph: decode / verify graphs `width`, prefill and mixed graphs
        `prefill_width`."""
        return self.width if key.q <= max(self.query_lens) and not key.num_prompts else self.prefill_width

    def key_for(self, num_reqs: int, num_rows: int, mode: str, num_drafts: int) -> GraphKey | None:
        """The captured key for `num_reqs` requests of at most `num_rows` rows each, if any: decode / verify
        rows at any captured batch size, or prompts (or last chunks) at a prefill length and size."""
        q = next((q for q in self.query_lens if q >= num_rows), None)
        if q is not None:
            R = next((s for s in self.sizes if s >= num_reqs), None)
            context = self.decode_context or q > 1 or num_drafts > 0
            return None if R is None else GraphKey(R, q, mode, num_drafts, q - 1, context=context)
        q = next((q for q in self.prefill_lens if q >= num_rows), None)
        R = None if q is None else next((s for s in self.prefill_sizes[q] if s >= num_reqs), None)
        return None if R is None else GraphKey(R, q, mode, num_drafts, 0, context=self.decode_context or num_drafts > 0)

    def mixed_key_for(self, num_reqs: int, num_rows: int, mode: str, num_drafts: int, prompt_lens: list[int]
                      ) -> GraphKey | None:
        """The mixed graph for `num_reqs` decode / verify requests of at most `num_rows` rows each beside prompt
        chunks of `prompt_lens` tokens that sample, if one holds them: at most `MIXED_PROMPTS` chunks, whose rows
        (and a row for each empty slot) fit the smallest of `mixed_rows` that does."""
        if not num_reqs or not prompt_lens or len(prompt_lens) > MIXED_PROMPTS:
            return None
        q = next((q for q in self.query_lens if q >= num_rows), None)
        R = next((s for s in self.sizes if s >= num_reqs), None)
        need = mixed_rows_needed(sum(prompt_lens), len(prompt_lens))
        rows = next((t for t in self.mixed_rows if t >= need), None)
        if q is None or R is None or rows is None:
            return None
        key = GraphKey(R, q, mode, num_drafts, q - 1, rows, MIXED_PROMPTS)
        if not (self.decode_context or q > 1 or num_drafts):  # the skipping twin, where captured (never on first use)
            twin = key._replace(context=False)
            return twin if self.ready(twin) else key
        return key

    def mixed_keys(self, query_lens: list[tuple[int, int]], modes: tuple[str, ...]) -> list[GraphKey]:
        """Every mixed graph of (q, drafts proposed) in `query_lens`, at every batch size and prompt-row count."""
        return [GraphKey(R, q, mode, d, q - 1, rows, MIXED_PROMPTS) for R in self.sizes for q, d in query_lens
                for rows in self.mixed_rows for mode in modes]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(R, q) of every prefill graph."""
        return [(R, q) for q in self.prefill_lens for R in self.prefill_sizes[q]]

    def prefill_groups(self, lengths: list[int]) -> list[list[int]]:
        """Prompts of `lengths` tokens (each at most the longest prefill length) -> groups of their indices, each
        one prefill graph: shortest first, a group grows while a captured (R, q) still holds it, so prompts of
        similar length share a graph and the padding stays small."""
        groups: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lengths.__getitem__):  # i: the longest of its group so far
            if groups and self.key_for(len(groups[-1]) + 1, lengths[i], "greedy", 0) is not None:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def pack(self, key: GraphKey, ids: list[list[int]], block_tables: list[list[int]], starts: list[int]
             ) -> list[int]:
        """Host integers of a padded batch: request r has ids[r] (its pending token and drafts) at starts[r]
        (decode, verify and prefill graphs: a mixed one is packed by `InputBatch.pack_mixed`)."""
        R, q = key.num_reqs, key.q
        n = len(ids)
        flat_ids = [t for row in ids for t in row + [0] * (q - len(row))] + [0] * ((R - n) * q)
        tables = block_tables + [[]] * (R - n)
        parts = batch_parts(self.cache, flat_ids, tables, starts + [0] * (R - n), [q] * R, None, self.ratios,
                            self.width_for(key), emit_every_row=True)
        return [x for part in parts for x in part]

    def static(self, key: GraphKey) -> StaticGraph:
        g = self.graphs.get(key)
        if g is None:
            rows = request_rows(key)
            n = len(rows)
            width = self.width_for(key)
            parts = batch_parts(self.cache, [0] * sum(rows), [[]] * n, [0] * n, rows, None, self.ratios, width,
                                emit_every_row=True)
            up = self.dummy_upload(key)
            flat = torch.tensor([x for p in parts for x in p] + up.flat(), dtype=torch.long, device=self.cache.device)
            batch, rest = batch_from_flat(flat, parts, self.cache, False, self.ratios, width * self.cache.block_size)
            g = self.graphs[key] = StaticGraph(key, flat, batch, up.split(rest), flat.numel())
        return g

    # ---- capture ----
    def capture_all(self, keys: list[GraphKey]) -> None:
        """Capture `keys`, largest batches first so that smaller graphs reuse the memory pool."""
        if self.eager:
            return
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.cache.device)[0]
        for key in sorted(keys, key=lambda k: (-k.num_reqs, -k.q)):
            self.capture_one(key)
        torch.cuda.synchronize(self.cache.device)
        self.capture_seconds += time.perf_counter() - t0
        self.graph_bytes += max(free_before - torch.cuda.mem_get_info(self.cache.device)[0], 0)
        log.info("captured %d CUDA graphs (R in %s, q in %s; prefills: q in %s, R·q <= %d; mixed: prompt rows in %s)"
                 " in %.1f s, %.0f MiB", len(self.graphs), self.sizes, self.query_lens, self.prefill_lens,
                 max((R * q for R, q in self.prefill_shapes()), default=0), self.mixed_rows, self.capture_seconds,
                 self.graph_bytes / 2**20)

    @torch.inference_mode()
    def capture_one(self, key: GraphKey) -> None:
        g = self.static(key)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the kernels and settle the allocator outside the capture
                g.batch._memo.clear()
                self.step(key, g.batch, g.parts)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        g.batch._memo.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            g.output = self.step(key, g.batch, g.parts)
        g.graph, g.memo_keys = graph, set(g.batch._memo)

    def ready(self, key: GraphKey) -> bool:
        """`key` runs now without a capture first (captured at start-up or since, or every step runs eagerly)."""
        g = self.graphs.get(key)
        return self.eager or (g is not None and g.graph is not None)

    # ---- replay ----
    def run(self, key: GraphKey, flat_step: torch.Tensor):
        """flat_step: the device copy of `pack(...)` followed by the step's parts -> (batch, step outputs). A key
        not captured at start-up (a sampling mode first met while serving) is captured now."""
        g = self.static(key)
        if g.graph is None and not self.eager:
            t0 = time.perf_counter()
            saved = [t.clone() for t in self.preserve]
            self.capture_one(key)
            for t, s in zip(self.preserve, saved):
                t.copy_(s)
            self.capture_seconds += time.perf_counter() - t0
            log.info("captured the CUDA graph of %s on first use", key)
        g.flat.copy_(flat_step[: g.length], non_blocking=True)
        if g.graph is None:
            g.batch._memo.clear()
            out = self.step(key, g.batch, g.parts)
            if g.output is None:
                g.output = out
            else:  # the same output tensors every run, as a replayed graph has (a later run overwrites them)
                for f in dataclasses.fields(out):
                    dst, src = getattr(g.output, f.name), getattr(out, f.name)
                    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
                        dst.copy_(src)
                    else:
                        setattr(g.output, f.name, src)
        else:
            for k in set(g.batch._memo) - g.memo_keys:  # computed eagerly from an earlier step's inputs
                del g.batch._memo[k]
            g.graph.replay()
        return g.batch, g.output
