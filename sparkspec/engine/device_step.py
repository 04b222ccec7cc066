"""The device half of a step: the target forward, the rejection sampler and the device drafter, run eagerly or as
the body of a captured graph (`ModelRunner` plans, dispatches and reads the step; this is what it runs).
Legend: T tokens, R requests in the batch, S requests that sample this step, K most drafts verified, V vocab.

`decode` accepts on every sampling request at once, then the device drafter writes the step's rows into its
context and proposes the next drafts from the same rows (`spec_decode/proposer.py`); the results stay on the
device (`DecodeOutput`) for the one copy back (`add_fetch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from sparkspec.engine.config import DEFAULT_SAMPLING_SCHEME
from sparkspec.engine.cuda_graphs import GraphKey
from sparkspec.engine.packed_step import PackedStep
from sparkspec.engine.step_io import Download
from sparkspec.models.cache import KVCache
from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.forward_batch import build_batch
from sparkspec.ops.sampling import SamplingTensors, apply_token_bitmask, mask_draft_probs
from sparkspec.spec_decode.proposer import StepRows
from sparkspec.spec_decode.rejection import IndexedDraftProbs, RejectionSampler

# sampling mode (`cuda_graphs.SAMPLING_MODES`) -> (all greedy, any top-k, any top-p): the sampler's host flags
MODE_FLAGS = {"greedy": (True, False, False), "sample": (False, False, False), "filter": (False, True, True)}


@dataclass
class DecodeOutput:
    """What the device part of a sampling step leaves for the copy back (graph outputs when captured)."""

    tokens: torch.Tensor  # [S, K+1] emitted tokens, -1 after the L + 1 of each request
    num_accepted: torch.Tensor  # [S] L
    is_finite: torch.Tensor  # [S] bool: False = the request's distribution is not finite; it fails alone
    drafts: torch.Tensor | None = None  # [S, k] next drafts
    confidences: torch.Tensor | None = None  # [S, k]
    logits: torch.Tensor | None = None  # [S, K+1, V] (eager steps only: logprobs read them)
    sampling: SamplingTensors | None = None  # (eager steps only)


class DeviceStep:
    """What a step runs on the device, for one model and its drafter (`ModelRunner` adds the planning, the
    graphs and the copies around it)."""

    def __init__(self, model: DeepseekV4Model, proposer=None, sampling_scheme: str = DEFAULT_SAMPLING_SCHEME):
        self.model = model
        self.proposer = proposer
        self.device = next(model.parameters()).device
        self.cache: KVCache | None = None
        self.sampler = RejectionSampler()
        # "gumbel": every sampled row draws by Gumbel-max with noise keyed by (seed, position, token), the drafters
        # too, so the tokens do not depend on the drafter, k or the batch (ops/sampling.py); "auto": the rows of
        # requests with an explicit seed so (the step's "gumbel" part), the others by rejection sampling; else
        # rejection sampling for every row
        self.scheme = sampling_scheme
        self.ratios = model.compress_ratios
        self.capture = {} if proposer is None else {"tap_layers": proposer.tap_layers,
                                                    "capture_final_streams": proposer.needs_final_streams}
        self.drafts_on_device = proposer is not None and proposer.on_device
        # [max_num_seqs, k, V] fp32 q of the drafts the last step proposed (row = the request's place among that
        # step's sampling requests); one buffer that every step reads then rewrites, so graphs address it
        self.q_store: torch.Tensor | None = None

    def forward(self, p: PackedStep, context: bool = True):
        """The one host->device copy and the target forward, eagerly -> (batch, output, the uploaded parts).
        `context` False: no taps for the drafter (`ModelRunner.writes_context`)."""
        items = p.items
        ids = [t for row in p.item_ids for t in row]
        batch = build_batch(self.cache, ids, [it.seq.block_ids for it in items],
                            [it.seq.num_cached_tokens for it in items], [len(r) for r in p.item_ids], p.logits_rows,
                            self.ratios, p.upload.flat())
        return batch, self.model(batch, **(self.capture if context else {})), p.upload.split(batch._memo["extra"])

    def graph_step(self, key: GraphKey, batch, dev: dict) -> DecodeOutput:
        """The body of a captured step: forward, accept, draft (no logits kept: graph steps return no logprobs).

        A decode / verify graph needs logits on every row. A prefill graph samples one row per request out of its
        R·q (a mixed graph one per prompt, besides its decode rows), so the head runs on the gathered rows only: at
        R·q = 32k rows and a 129k vocabulary the logits of every row would be 17 GB and most of the step's FLOPs."""
        gathered = key.gathered
        if gathered:
            batch.logits_rows = dev["gather"]
        out = self.model(batch, **(self.capture if key.context else {}))
        res = self.decode(batch, out, dev, key.num_sampling, key.draft_cols, key.mode, key.num_drafts, gathered,
                          key.context)
        res.logits = res.sampling = None
        return res

    def decode(self, batch, out, dev: dict, S: int, K: int, mode: str, num_drafts: int,
               gathered: bool = False, context: bool = True) -> DecodeOutput:
        """Accept on every sampling request at once; the device drafter then writes the step's rows into its
        context, and proposes `num_drafts` after each new pending token (its q goes to `q_store`).

        The context is written on every step that proposes nothing too (a request that asks for no drafts, the
        adaptive budget's plain arm while it may switch or probe): the first drafts after a plain stretch read
        the `window` rows before their position, stale rows there would cost acceptance (lossless still, but on the
        H200 demo pair the budget's drafting arm then looked worse than plain decoding at c = 1 and was turned
        off). `context` False (a pure plain decode step, `writes_context`): no write; the budget lets drafting
        start again only after `window` steps that wrote (`VerificationBudget.context_window`)."""
        tokens, num_accepted, is_finite, st, logits = self.accept(out, dev, S, K, mode, gathered)
        res = DecodeOutput(tokens, num_accepted, is_finite, logits=logits, sampling=st)
        if self.drafts_on_device and context:
            step = self.step_rows(batch, out, dev, tokens, num_accepted, st, K)
            self.proposer.observe(step)
            if num_drafts:
                proposal = self.proposer.propose(step, num_drafts)
                res.drafts, res.confidences = proposal.token_ids, proposal.confidences
                if proposal.probs is not None:
                    self.q_store[:S, :num_drafts].copy_(proposal.probs)
        return res

    def accept(self, out, dev: dict, S: int, K: int, mode: str, gathered: bool = False):
        """The rejection sampler on every sampling request at once -> (tokens [S, K+1], num_accepted [S],
        is_finite [S], sampling tensors, logits [S, K+1, V]). Temperatures arrive packed by
        `SamplingParams.device_temperature` (0 for greedy requests). `gathered`: the forward computed the logits of
        the `gather` rows only, in that order (a prefill graph)."""
        all_greedy, any_top_k, any_top_p = MODE_FLAGS[mode]
        gumbel = dev["gumbel"].bool() if self.scheme == "auto" else self.scheme == "gumbel"  # [S] or all rows
        st = SamplingTensors(dev["temperature"].view(torch.float64).float(), dev["top_k"],
                             dev["top_p"].view(torch.float64).float(), dev["seeds"], all_greedy, any_top_k, any_top_p,
                             gumbel=gumbel)
        logits = (out.logits if gathered else out.logits[dev["gather"]]).view(S, K + 1, -1)  # [S, K+1, V]
        bitmask = dev.get("token_bitmask")  # [S, K+1, W] structured output (eager steps only)
        if bitmask is not None:  # -inf outside each verified row's grammar mask
            logits = apply_token_bitmask(logits, bitmask)
        draft_ids = dev["draft_ids"].view(S, K)
        q = None  # None: every draft one-hot (host drafters, greedy drafts), which the sampler handles as such
        if K and not all_greedy and self.q_store is not None:
            q_rows = dev["q_rows"]
            # requests with a q row read it in place; the rest are one-hot: no dense [S, K, V] copy
            q = IndexedDraftProbs(self.q_store, q_rows)
            if bitmask is not None:
                # a sampled draft under a grammar was drawn from q_m (engine/grammar.py): the masked, renormalised
                # q is dense (eager structured steps only); one-hot drafts stay one-hot (the grammar cut refused ones)
                one_hot = logits.new_zeros(S, K, logits.shape[-1]).scatter_(2, draft_ids.clamp(min=0).unsqueeze(2),
                                                                            1.0)
                dense = torch.where((q_rows >= 0).view(S, 1, 1), self.q_store[q_rows.clamp(min=0), :K], one_hot)
                q = mask_draft_probs(dense, bitmask[:, :K])
        tokens, num_accepted, is_finite = self.sampler.verify(logits, draft_ids, q, st, dev["positions"])
        return tokens, num_accepted, is_finite, st, logits

    @staticmethod
    def step_rows(batch, out, dev: dict, tokens, num_accepted, st, K: int) -> StepRows:
        """What the device drafter reads of a sampling step: its rows (every one is written into the drafter's
        context), the token after each row where it is known, and each request's new pending token."""
        pending_rows, next_ids = dev["pending_rows"], dev["next_ids"]
        if next_ids.numel():  # the token after a verify row is the token emitted there (past them: unread)
            verify_rows = pending_rows.unsqueeze(1) + torch.arange(K + 1, device=tokens.device)  # [S, K+1]
            ok = tokens >= 0  # j <= L: inside the request's own rows; the rest repeat column 0's write
            rows = torch.where(ok, verify_rows, pending_rows.unsqueeze(1))
            next_ids = next_ids.index_put((rows,), torch.where(ok, tokens, tokens[:, :1]))
        pending = tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [S] the new pending token
        return StepRows(batch, out, next_ids, dev["reqs"], pending, dev["positions"] + num_accepted,
                        pending_rows + num_accepted, st)

    def observe_context(self, batch, out, dev: dict) -> None:
        """A prefill chunk that samples nothing: the device drafter writes its rows into its context."""
        if self.drafts_on_device:
            empty = batch.positions[:0]
            self.proposer.observe(StepRows(batch, out, dev["next_ids"], empty, empty, empty, empty, None))

    @staticmethod
    def add_fetch(down: Download, res: DecodeOutput, S: int) -> None:
        """A sampling step's results, added to its copy back (rows past S are a graph's dummy requests)."""
        down.add("accepted", res.num_accepted[:S])
        down.add("tokens", res.tokens[:S])
        down.add("finite", res.is_finite[:S])
        if res.drafts is not None:
            down.add("drafts", res.drafts[:S])
            if res.confidences is not None:
                down.add("confidences", res.confidences[:S])

    @staticmethod
    def bitmask_rows(p: PackedStep, token_masks: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """-> [S, K+1, W] int32: each structured request's row masks, -1 (all allowed) everywhere else."""
        W = next(iter(token_masks.values())).shape[1]
        out = torch.full((len(p.sampling), p.K + 1, W), -1, dtype=torch.int32)
        for s, i in enumerate(p.sampling):
            if i in token_masks:
                out[s, : token_masks[i].shape[0]] = token_masks[i]
        return out
