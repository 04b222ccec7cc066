"""Executes one scheduled step on the device: verify -> accept -> propose, then ONE device->host copy.
Legend: T tokens, R requests in the batch, S requests that sample this step, K most drafts verified, V vocab.

Every scheduled sequence contributes its chunk `all_ids[num_cached : num_cached + n]` (a prefill chunk, a
recompute chunk, or the pending token of a decode row), followed on decode rows by the drafts chosen for
verification. The host packs everything into one `ForwardBatch` (one host->device copy), the target runs once,
the rejection sampler turns the logits of every sampling row into emitted tokens on the device, a device
drafter proposes the next drafts from the same rows, and one copy brings back accepted counts, tokens and the
next drafts. Nothing in between waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sparkspec.engine.scheduler import ScheduledSeq
from sparkspec.engine.step_io import Download, Upload, float_bits
from sparkspec.models.cache import KVCache
from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.forward_batch import build_batch, to_device
from sparkspec.ops.sampling import SamplingTensors, gather_logprobs, logprobs_for
from sparkspec.spec_decode.proposer import StepRows
from sparkspec.spec_decode.rejection import RejectionSampler


Logprobs = list[dict[int, float]]  # per token: {id: logprob}, the top-N highest first, then the token if not among them


@dataclass
class SampledRow:
    """One sampling request's result, on the host."""

    num_accepted: int  # L: drafts accepted
    token_ids: list[int]  # the L + 1 emitted tokens
    next_drafts: list[int]  # drafts proposed for the next step (empty when none were asked for)
    next_confidences: list[float] | None
    logprobs: Logprobs | None = None  # [L + 1] when the request asks for logprobs


@dataclass
class StepResult:
    rows: dict[int, SampledRow]  # item index -> result, for the items that sample
    draft_probs: torch.Tensor | None  # [S, k, V] device q of the next drafts (row = `draft_row` of each item)
    draft_row: dict[int, int]  # item index -> row of draft_probs
    prompt_logprobs: dict[int, Logprobs] = field(default_factory=dict)  # item index -> its chunk's prompt tokens


def logprob_dicts(token_ids: list[int], pieces: list[list[float]], row: int, n: int, num_top: int) -> Logprobs:
    """Host copy of `gather_logprobs` (`pieces`: picked [R], then values and ids [R * num_top] when num_top),
    rows row.. for `token_ids`, of which the request shows n alternatives -> one dict per token."""
    picked, values, ids = (pieces + [[], []])[:3]
    out = []
    for r, tok in enumerate(token_ids, row):
        d = {int(ids[r * num_top + j]): values[r * num_top + j] for j in range(n)}
        d.setdefault(tok, picked[r])
        out.append(d)
    return out


def prompt_rows(seq, start: int, num_tokens: int) -> range:
    """Positions t of a chunk [start, start + num_tokens) whose row scores prompt token t + 1 and whose logprob
    the request still lacks (`seq.prompt_logprobs` holds tokens 0..m-1: row m - 1 comes next)."""
    if seq.params.prompt_logprobs is None or seq.prompt_logprobs is None:
        return range(0)
    return range(max(start, len(seq.prompt_logprobs) - 1), min(start + num_tokens, len(seq.prompt_ids) - 1))


@dataclass
class StepPlan:
    """The host side of one step."""

    items: list[ScheduledSeq]
    drafts: list[list[int]]
    item_ids: list[list[int]] = field(default_factory=list)  # per item: its chunk, then its drafts
    sampling: list[int] = field(default_factory=list)  # items whose last row yields a token (S of them)
    K: int = 0  # most drafts any sampling item verifies
    key: tuple[int, int] | None = None  # the captured graph shape (R, q) the step runs as; None = eager
    logits_rows: list[int] = field(default_factory=list)
    next_host: list[int] = field(default_factory=list)  # per row: the token after it (MTP only)
    prompt_items: list[tuple[int, int, int]] = field(default_factory=list)  # (item, first position, rows)
    logprob_rows: list[int] = field(default_factory=list)  # sampling rows whose requests want logprobs
    num_top: int = 0
    num_prompt_top: int = 0
    upload: Upload = field(default_factory=Upload)

    @property
    def params(self) -> list:
        return [self.items[i].seq.params for i in self.sampling]


class ModelRunner:
    def __init__(self, model: DeepseekV4Model, proposer=None):
        self.model = model
        self.proposer = proposer
        self.device = next(model.parameters()).device
        self.cache: KVCache | None = None
        self.sampler = RejectionSampler()
        self.ratios = model.compress_ratios
        self.capture = {} if proposer is None else {"tap_layers": proposer.tap_layers,
                                                    "capture_final_streams": proposer.needs_final_streams}
        self.graphs = None  # GraphRunner: decode / verify steps as CUDA graphs (see `cuda_graphs.py`)

    def use_graphs(self, max_num_seqs: int, max_model_len: int, num_spec_tokens: int, eager: bool = False) -> None:
        """Decode (q = 1) and verify (q = 1 + num_spec_tokens) steps run as graphs captured now; `eager` builds
        the same static batches and runs them eagerly (tests of the padding on CPU)."""
        from sparkspec.engine.cuda_graphs import GraphRunner

        query_lens = (1, 1 + num_spec_tokens) if num_spec_tokens else (1,)
        self.graphs = GraphRunner(self.model, self.cache, self.capture, max_num_seqs, max_model_len, query_lens,
                                  eager=eager)
        self.graphs.capture_all()

    def graph_key(self, items: list[ScheduledSeq], drafts: list[list[int]], prompt_items: list):
        """The captured shape a pure decode / verify step runs as, or None (eager)."""
        if self.graphs is None or prompt_items or not all(it.num_tokens == 1 and it.samples for it in items):
            return None
        return self.graphs.key_for(len(items), 1 + max((len(d) for d in drafts), default=0))

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The pools every block id of the engine's block manager addresses (target and drafter)."""
        self.cache = KVCache(self.model, num_blocks, block_size)
        if self.proposer is not None:
            self.proposer.allocate(num_blocks, block_size, self.device, next(self.model.parameters()).dtype)

    @torch.inference_mode()
    def execute(
        self,
        items: list[ScheduledSeq],
        drafts: list[list[int]],  # per item: draft tokens verified behind its pending token
        draft_probs: torch.Tensor | None,  # [S', k', V] q of the drafts from the previous step, or None
        draft_rows: list[int],  # per item: its row in draft_probs, -1 = one-hot q (greedy or host drafter)
        num_next_drafts: int,  # k for the device drafter at the end of this step (0 = do not draft)
    ) -> StepResult:
        """plan (host) -> forward -> accept -> draft -> the one copy back -> read.

        Logprobs (only when a request of the step asks; host flags): rows 0..L of a request that wants them go
        through `logprobs_for` (the distribution it samples from, never the drafter's), and prompt rows that
        score prompt tokens for `prompt_logprobs` (the raw log-softmax: those tokens were not sampled) are added
        to `logits_rows`; both ride in the step's one copy."""
        plan = self.plan(items, drafts, draft_rows)
        batch, out, dev = self.forward(plan)
        down = Download()
        if plan.prompt_items:  # prompt tokens: the model's raw distribution
            lp = torch.log_softmax(out.logits[dev["prompt_rows"]].float(), -1)
            down.add("prompt", *gather_logprobs(lp, dev["prompt_next"], plan.num_prompt_top))
        if not plan.sampling:
            if self.proposer is not None and self.proposer.on_device:  # a prefill chunk: context only
                empty = batch.positions[:0]
                self.proposer.observe(StepRows(batch, out, dev["next_ids"], empty, empty, empty, empty, None))
            return self.read(plan, down.fetch(), None, 0)
        tokens, num_accepted, st, logits = self.accept(plan, out, dev, draft_probs)
        down.add("accepted", num_accepted)
        down.add("tokens", tokens)
        if plan.logprob_rows:  # rows 0..K of the requests that ask (rows past L are read back but dropped)
            lp_t, K1 = dev["logprob_rows"], plan.K + 1
            lp = logprobs_for(logits[lp_t].flatten(0, 1), st.index_select(lp_t).repeat_interleave(K1))
            down.add("sampled", *gather_logprobs(lp, tokens[lp_t].flatten(), plan.num_top))
        next_probs, k_next = None, 0
        if self.proposer is not None and self.proposer.on_device:
            proposal = self.draft(plan, batch, out, dev, tokens, num_accepted, st, num_next_drafts)
            if proposal is not None:
                k_next, next_probs = num_next_drafts, proposal.probs
                down.add("drafts", proposal.token_ids)
                if proposal.confidences is not None:
                    down.add("confidences", proposal.confidences)
        return self.read(plan, down.fetch(), next_probs, k_next)

    def plan(self, items: list[ScheduledSeq], drafts: list[list[int]], draft_rows: list[int]) -> StepPlan:
        """Host side of a step: rows, logits rows, and every int the device needs, packed by name."""
        p = StepPlan(items, drafts)
        logits_rows, first_lrow, rows = [], {}, 0
        prompt_lrows, prompt_next = [], []
        for i, (it, d) in enumerate(zip(items, drafts)):
            seq, nc = it.seq, it.seq.num_cached_tokens
            scored = prompt_rows(seq, nc, it.num_tokens)
            if scored:
                p.prompt_items.append((i, scored.start, len(scored)))
                prompt_lrows += range(len(logits_rows), len(logits_rows) + len(scored))
                prompt_next += seq.prompt_ids[scored.start + 1 : scored.stop + 1]
                logits_rows += range(rows + scored.start - nc, rows + scored.stop - nc)
            if it.samples:
                p.sampling.append(i)
                first_lrow[i] = len(logits_rows)
                logits_rows += range(rows + it.num_tokens - 1, rows + it.num_tokens + len(d))
            p.item_ids.append(seq.token_ids(nc, nc + it.num_tokens) + d)
            if self.capture.get("capture_final_streams"):  # MTP reads the token after every row
                after = seq.token_ids(nc + 1, nc + it.num_tokens + 1)
                p.next_host += after + [0] * (it.num_tokens + len(d) - len(after))
            rows += it.num_tokens + len(d)
        p.logits_rows = logits_rows
        p.K = max((len(drafts[i]) for i in p.sampling), default=0)
        p.key = self.graph_key(items, drafts, p.prompt_items)
        first = np.cumsum([0] + [len(ids) for ids in p.item_ids]).tolist()  # first forward row of every item
        if p.key is not None:  # the static layout: request i owns rows i·q .. i·q + q - 1, logits for every row
            R_pad, q = p.key
            first = [i * q for i in range(len(items) + 1)]
            first_lrow = {i: i * q for i in p.sampling}
            if p.next_host:
                p.next_host = [0] * (R_pad * q)  # decode rows: the token after each row is emitted this step
        params = p.params
        V = self.model.cfg.vocab_size
        p.logprob_rows = [r for r, sp in enumerate(params) if sp.logprobs is not None]
        p.num_top = min(max((sp.logprobs for sp in params if sp.logprobs is not None), default=0), V)
        p.num_prompt_top = min(max((items[i].seq.params.prompt_logprobs for i, _, _ in p.prompt_items), default=0), V)
        up = p.upload
        up.add("gather", [first_lrow[i] + min(j, len(drafts[i])) for i in p.sampling for j in range(p.K + 1)])
        up.add("draft_ids", [t for i in p.sampling for t in drafts[i] + [-1] * (p.K - len(drafts[i]))])
        up.add("q_rows", [draft_rows[i] if drafts[i] else -1 for i in p.sampling])
        up.add("top_k", [sp.top_k for sp in params])
        up.add("seeds", [items[i].seq.seed for i in p.sampling])
        up.add("positions", [items[i].seq.num_cached_tokens + items[i].num_tokens for i in p.sampling])  # d_0's
        up.add("reqs", p.sampling)
        up.add("pending_rows", [first[i] + items[i].num_tokens - 1 for i in p.sampling])
        up.add("floats", float_bits([sp.temperature for sp in params] + [sp.top_p for sp in params]))
        up.add("next_ids", p.next_host)
        up.add("logprob_rows", p.logprob_rows)
        up.add("prompt_rows", prompt_lrows)
        up.add("prompt_next", prompt_next)
        return p

    def forward(self, p: StepPlan):
        """The one host->device copy and the target forward (a graph replay for decode steps) ->
        (batch, output, the uploaded parts by name)."""
        items = p.items
        tables = [it.seq.block_ids for it in items]
        starts = [it.seq.num_cached_tokens for it in items]
        if p.key is None:
            ids = [t for row in p.item_ids for t in row]
            batch = build_batch(self.cache, ids, tables, starts, [len(r) for r in p.item_ids], p.logits_rows,
                                self.ratios, p.upload.flat())
            return batch, self.model(batch, **self.capture), p.upload.split(batch._memo["extra"])
        head = self.graphs.pack(p.key, p.item_ids, tables, starts)
        flat = to_device(head + p.upload.flat(), self.device)
        batch, out = self.graphs.run(p.key, flat)
        return batch, out, p.upload.split(flat[len(head):])

    def accept(self, p: StepPlan, out, dev: dict, draft_probs: torch.Tensor | None):
        """The rejection sampler on every sampling request at once -> (tokens [S, K+1], num_accepted [S],
        sampling tensors, logits [S, K+1, V])."""
        S, K, params = len(p.sampling), p.K, p.params
        temp_top_p = dev["floats"].view(torch.float64).float()
        st = SamplingTensors(temp_top_p[:S], dev["top_k"], temp_top_p[S:], dev["seeds"],
                             all(sp.greedy for sp in params), any(sp.top_k > 0 and not sp.greedy for sp in params),
                             any(sp.top_p < 1 and not sp.greedy for sp in params))
        logits = out.logits[dev["gather"]].view(S, K + 1, -1)  # [S, K+1, V]
        draft_ids = dev["draft_ids"].view(S, K)
        q = None
        if K and not st.all_greedy:
            # q of host drafters and greedy drafts: one-hot (a scatter: F.one_hot checks its range on the host)
            onehot = logits.new_zeros(S, K, logits.shape[-1]).scatter_(2, draft_ids.clamp(min=0).unsqueeze(2), 1.0)
            q = onehot
            if draft_probs is not None:
                q_rows = dev["q_rows"]
                q = torch.where((q_rows >= 0).view(S, 1, 1), draft_probs[q_rows.clamp(min=0), :K].float(), onehot)
        tokens, num_accepted = self.sampler(logits, draft_ids, q, st, dev["positions"])  # [S, K+1], [S]
        return tokens, num_accepted, st, logits

    def draft(self, p: StepPlan, batch, out, dev: dict, tokens, num_accepted, st, k: int):
        """The device drafter sees the step's rows (all written into its context) and drafts k tokens after each
        new pending token -> its DraftBatch, or None when k = 0."""
        pending_rows, next_ids = dev["pending_rows"], dev["next_ids"]
        if p.next_host:  # the token after a verify row is the token emitted there (past them: garbage, unread)
            verify_rows = pending_rows.unsqueeze(1) + torch.arange(p.K + 1, device=tokens.device)  # [S, K+1]
            ok = tokens >= 0  # j <= L: inside the request's own rows; the rest repeat column 0's write
            rows = torch.where(ok, verify_rows, pending_rows.unsqueeze(1))
            next_ids = next_ids.index_put((rows,), torch.where(ok, tokens, tokens[:, :1]))
        pending = tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [S] the new pending token
        step = StepRows(batch, out, next_ids, dev["reqs"], pending, dev["positions"] + num_accepted,
                        pending_rows + num_accepted, st)
        self.proposer.observe(step)
        return self.proposer.propose(step, k) if k else None

    def read(self, p: StepPlan, host: dict, next_probs, k_next: int) -> StepResult:
        """The host copy -> per item: accepted count, emitted tokens, next drafts, logprobs."""
        prompt = self.read_prompt_logprobs(host.get("prompt", []), p.items, p.prompt_items, p.num_prompt_top)
        if not p.sampling:
            return StepResult({}, None, {}, prompt)
        K1 = p.K + 1
        L = [int(x) for x in host["accepted"][0]]
        toks = host["tokens"][0]
        nxt = host["drafts"][0] if "drafts" in host else []
        conf = host["confidences"][0] if "confidences" in host else None
        lp_of = {r: j for j, r in enumerate(p.logprob_rows)}
        rows = {}
        for r, i in enumerate(p.sampling):
            emitted = [int(t) for t in toks[r * K1 : r * K1 + L[r] + 1]]
            lps = None
            if r in lp_of:
                lps = logprob_dicts(emitted, host["sampled"], lp_of[r] * K1, min(p.params[r].logprobs, p.num_top),
                                    p.num_top)
            rows[i] = SampledRow(L[r], emitted, [int(t) for t in nxt[r * k_next : (r + 1) * k_next]],
                                 conf[r * k_next : (r + 1) * k_next] if conf else None, lps)
        return StepResult(rows, next_probs, {i: r for r, i in enumerate(p.sampling)}, prompt)

    @staticmethod
    def read_prompt_logprobs(pieces: list[list[float]], items: list[ScheduledSeq],
                             prompt_items: list[tuple[int, int, int]], num_top: int) -> dict[int, Logprobs]:
        """The prompt part of the copy -> item index -> dicts of the prompt tokens its chunk scored."""
        out, row = {}, 0
        for i, start, n in prompt_items:  # the rows from position `start` score prompt tokens start + 1..
            seq = items[i].seq
            out[i] = logprob_dicts(seq.prompt_ids[start + 1 : start + 1 + n], pieces, row,
                                   min(seq.params.prompt_logprobs, num_top), num_top)
            row += n
        return out
