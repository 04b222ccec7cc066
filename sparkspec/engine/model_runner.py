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
import torch.nn.functional as F

from sparkspec.engine.scheduler import ScheduledSeq
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


def _as_int64_bits(values: list[float]) -> list[int]:
    """Floats shipped inside the int64 batch copy (read back with `.view(torch.float64)`)."""
    return np.asarray(values, dtype=np.float64).view(np.int64).tolist()


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
        """Logprobs (only when a request of the step asks; host flags): rows 0..L of a request that wants them
        go through `logprobs_for` (the distribution it samples from, never the drafter's), and prompt rows that
        score prompt tokens for `prompt_logprobs` (the raw log-softmax: those tokens were not sampled) are added
        to `logits_rows`; both ride in the step's one copy."""
        # ---- host: pack the step ----
        ids, tables, starts, nums, logits_rows, sampling, next_host, item_ids = [], [], [], [], [], [], [], []
        first_lrow, prompt_lrows, prompt_next, prompt_items = {}, [], [], []
        for i, (it, d) in enumerate(zip(items, drafts)):
            seq, nc = it.seq, it.seq.num_cached_tokens
            chunk = seq.token_ids(nc, nc + it.num_tokens)
            scored = prompt_rows(seq, nc, it.num_tokens)
            if scored:
                prompt_items.append((i, scored.start, len(scored)))
                prompt_lrows += range(len(logits_rows), len(logits_rows) + len(scored))
                prompt_next += seq.prompt_ids[scored.start + 1 : scored.stop + 1]
                logits_rows += range(len(ids) + scored.start - nc, len(ids) + scored.stop - nc)
            if it.samples:
                sampling.append(i)
                first_lrow[i] = len(logits_rows)
                logits_rows += range(len(ids) + it.num_tokens - 1, len(ids) + it.num_tokens + len(d))
            ids += chunk
            ids += d
            item_ids.append(chunk + d)
            if self.capture.get("capture_final_streams"):  # MTP reads the token after every row
                after = seq.token_ids(nc + 1, nc + it.num_tokens + 1)
                next_host += after + [0] * (it.num_tokens + len(d) - len(after))
            tables.append(seq.block_ids)
            starts.append(nc)
            nums.append(it.num_tokens + len(d))
        S = len(sampling)
        K = max((len(drafts[i]) for i in sampling), default=0)
        key = self.graph_key(items, drafts, prompt_items)
        if key is not None:  # the static layout: request i owns rows i·q .. i·q + q - 1, logits for every row
            R_pad, q = key
            first_lrow = {i: i * q for i in sampling}
            if next_host:
                next_host = [0] * (R_pad * q)  # decode rows: the token after each row is emitted this step
        gather, draft_ids, qrow = [], [], []
        for i in sampling:
            k = len(drafts[i])
            gather += [first_lrow[i] + min(j, k) for j in range(K + 1)]  # pad with the last row: never read
            draft_ids += drafts[i] + [-1] * (K - k)
            qrow.append(draft_rows[i] if k else -1)
        params = [items[i].seq.params for i in sampling]
        seeds = [items[i].seq.seed for i in sampling]
        positions = [items[i].seq.num_cached_tokens + items[i].num_tokens for i in sampling]  # where d_0 sits
        req_rows = list(sampling)
        first = np.cumsum([0] + nums).tolist() if key is None else [i * key[1] for i in range(len(items) + 1)]
        row_of_pending = [first[i] + items[i].num_tokens - 1 for i in sampling]  # first forward row of every item
        floats = _as_int64_bits([p.temperature for p in params] + [p.top_p for p in params])
        lp_sel = [r for r, p in enumerate(params) if p.logprobs is not None]  # sampling rows that want logprobs
        extra = gather + draft_ids + qrow + [p.top_k for p in params] + seeds + positions + req_rows \
            + row_of_pending + floats + next_host + lp_sel + prompt_lrows + prompt_next
        if key is None:
            batch = build_batch(self.cache, ids, tables, starts, nums, logits_rows, self.ratios, extra)
            out = self.model(batch, **self.capture)
            ex = batch._memo["extra"]
        else:
            head = self.graphs.pack(key, item_ids, tables, starts)
            flat = to_device(head + extra, self.device)
            batch, out = self.graphs.run(key, flat)
            ex = flat[len(head):]
        parts, o = [], 0
        for n in (S * (K + 1), S * K, S, S, S, S, S, S, 2 * S, len(next_host), len(lp_sel), len(prompt_lrows),
                  len(prompt_next)):
            parts.append(ex[o : o + n])
            o += n
        gather_t, draft_t, qrow_t, top_k, seeds_t, pos_t, req_t, pend_row_t, float_t, next_t, lp_t, plr_t, pnx_t = parts
        V = out.logits.shape[-1]
        num_top = min(max((p.logprobs for p in params if p.logprobs is not None), default=0), V)
        num_ptop = min(max((items[i].seq.params.prompt_logprobs for i, _, _ in prompt_items), default=0), V)
        results, sizes = [], {}

        def ship(name: str, pieces: list[torch.Tensor]) -> None:
            sizes[name] = [p.numel() for p in pieces]
            results.extend(p.double().flatten() for p in pieces)

        if prompt_lrows:  # prompt tokens: the model's raw distribution
            ship("prompt", gather_logprobs(torch.log_softmax(out.logits[plr_t].float(), -1), pnx_t, num_ptop))
        if not S:
            if self.proposer is not None and self.proposer.on_device:  # a prefill chunk: context only
                empty = batch.positions[:0]
                self.proposer.observe(StepRows(batch, out, next_t, empty, empty, empty, empty, None))
            host = torch.cat(results).cpu().tolist() if results else []
            return StepResult({}, None, {}, self.read_prompt_logprobs(host, sizes, items, prompt_items, num_ptop))

        # ---- device: accept ----
        temp_top_p = float_t.view(torch.float64).float()
        st = SamplingTensors(temp_top_p[:S], top_k, temp_top_p[S:], seeds_t, all(p.greedy for p in params),
                             any(p.top_k > 0 and not p.greedy for p in params),
                             any(p.top_p < 1 and not p.greedy for p in params))
        logits = out.logits[gather_t].view(S, K + 1, -1)  # [S, K+1, V]
        draft_t = draft_t.view(S, K)
        q = None
        if K and not st.all_greedy:
            onehot = F.one_hot(draft_t.clamp(min=0), logits.shape[-1]).float()  # [S, K, V]
            if draft_probs is not None:
                prev = draft_probs[qrow_t.clamp(min=0), :K].float()
                q = torch.where((qrow_t >= 0).view(S, 1, 1), prev, onehot)
            else:
                q = onehot
        tokens, num_accepted = self.sampler(logits, draft_t, q, st, pos_t)  # [S, K+1], [S]
        results += [num_accepted.double(), tokens.double().flatten()]
        if lp_sel:  # rows 0..K of the requests that ask (rows past L are read back but dropped)
            lp = logprobs_for(logits[lp_t].view(-1, V), st.index_select(lp_t).repeat_interleave(K + 1))
            ship("sampled", gather_logprobs(lp, tokens[lp_t].flatten(), num_top))  # [S_lp * (K+1), ...]

        # ---- device: draft for the next step ----
        next_probs, k_next, n_conf = None, 0, 0
        if self.proposer is not None and self.proposer.on_device:
            # the token after each row: the next input, or on verify rows the emitted token (past them: garbage;
            # only MTP reads it)
            next_ids = next_t
            if len(next_host):
                verify_rows = pend_row_t.unsqueeze(1) + torch.arange(K + 1, device=tokens.device)  # [S, K+1]
                ok = tokens >= 0  # j <= L: inside the request's own rows; the rest repeat column 0's write
                rows = torch.where(ok, verify_rows, pend_row_t.unsqueeze(1))
                next_ids = next_t.index_put((rows,), torch.where(ok, tokens, tokens[:, :1]))
            pending = tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [S] the new pending token
            step = StepRows(batch, out, next_ids, req_t, pending, pos_t + num_accepted, pend_row_t + num_accepted, st)
            self.proposer.observe(step)
            k_next = num_next_drafts
            if k_next:
                proposal = self.proposer.propose(step, k_next)
                results.append(proposal.token_ids.double().flatten())
                if proposal.confidences is not None:
                    results.append(proposal.confidences.double().flatten())
                    n_conf = S * k_next
                next_probs = proposal.probs

        # ---- the one device->host copy ----
        host = torch.cat(results).cpu().tolist()
        prompt = self.read_prompt_logprobs(host, sizes, items, prompt_items, num_ptop)
        o = sum(sizes.get("prompt", []))
        L = [int(x) for x in host[o : o + S]]
        toks = host[o + S : o + S + S * (K + 1)]
        o += S + S * (K + 1)
        lp_host = []
        for n in sizes.get("sampled", []):
            lp_host.append(host[o : o + n])
            o += n
        nxt = host[o : o + S * k_next]
        conf = host[o + S * k_next : o + S * k_next + n_conf]
        rows, lp_of = {}, {r: j for j, r in enumerate(lp_sel)}
        for r, i in enumerate(sampling):
            emitted = [int(t) for t in toks[r * (K + 1) : r * (K + 1) + L[r] + 1]]
            lps = None
            if r in lp_of:
                lps = logprob_dicts(emitted, lp_host, lp_of[r] * (K + 1), min(params[r].logprobs, num_top), num_top)
            rows[i] = SampledRow(L[r], emitted, [int(t) for t in nxt[r * k_next : (r + 1) * k_next]],
                                 conf[r * k_next : (r + 1) * k_next] if conf else None, lps)
        return StepResult(rows, next_probs, {i: r for r, i in enumerate(sampling)}, prompt)

    @staticmethod
    def read_prompt_logprobs(host: list[float], sizes: dict, items: list[ScheduledSeq],
                             prompt_items: list[tuple[int, int, int]], num_top: int) -> dict[int, Logprobs]:
        """The prompt part at the head of the copy -> item index -> dicts of the prompt tokens its chunk scored."""
        if not prompt_items:
            return {}
        pieces, o = [], 0
        for n in sizes["prompt"]:
            pieces.append(host[o : o + n])
            o += n
        out, row = {}, 0
        for i, start, n in prompt_items:  # the rows from position `start` score prompt tokens start + 1..
            seq = items[i].seq
            out[i] = logprob_dicts(seq.prompt_ids[start + 1 : start + 1 + n], pieces, row,
                                   min(seq.params.prompt_logprobs, num_top), num_top)
            row += n
        return out

    def synchronize(self) -> None:
        """Wait for the accelerator (timings only; the step itself never waits)."""
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
