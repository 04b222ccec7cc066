"""DSpark drafting at inference (DSpark paper, deepseek-ai/DeepSpec: parallel backbone + sequential Markov
head; the math lives in `sparkspec.models.dspark`). Legend: B requests, k drafts, W window, D latent, V vocab.

Per request the drafter keeps, for every stage, the context K=V rows of the last `sliding_window` COMMITTED
positions ("context window"). `observe` queues the committed rows' taps, and the next `propose` projects them
(main_x -> each stage's wkv / kv_norm / RoPE) in one batched pass; nothing else is ever written, so rejected
drafts need no rollback, and steps without drafts cost almost nothing. `propose` runs one block of k rows `[b, noise * (k-1)]`
at positions N..N+k-1 (N = committed tokens, b = pending token), then the Markov head left to right:
greedy requests take the argmax, sampled requests draw from the processed (temperature / top-k / top-p)
Markov-corrected distribution, which is returned as the exact q for verification.
"""

from __future__ import annotations

import torch

from sparkspec.generation import Sequence, sampling_tensors
from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.dspark import DSparkDraftModel
from sparkspec.ops import ops
from sparkspec.spec_decode.proposer import EMPTY_DRAFT, CommittedRows, Draft, Proposer


class DSparkState:
    """One request's drafter context. Committed rows arrive as raw taps and are projected to K=V rows lazily,
    on the next draft: a request the budget keeps at k = 0 pays only a slice of the taps per step."""

    def __init__(self, proposer: "DSparkProposer", empty: torch.Tensor, num_layers: int):
        self._proposer = proposer
        self._ctx_kv = [empty] * num_layers  # per stage [<= W, D] K=V rows of the last committed positions
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (taps [n, m, H], positions [n]), oldest first
        self.num_pending = 0
        self.num_committed = 0  # positions observed so far (= the target cache's committed tokens)

    @property
    def ctx_kv(self) -> list[torch.Tensor]:
        if self.pending:
            self._proposer.flush([self])
        return self._ctx_kv


class DSparkProposer(Proposer):
    method = "dspark"

    def __init__(self, target: DeepseekV4Model, drafter: DSparkDraftModel, num_spec_tokens: int):
        super().__init__(num_spec_tokens)
        self.target, self.drafter = target, drafter
        self.tap_layers = tuple(target.cfg.dspark_target_layer_ids)
        self.window = drafter.window
        self.states: dict[int, DSparkState] = {}

    def start(self, seqs: list[Sequence]) -> None:
        p = next(self.drafter.parameters())
        empty = torch.zeros(0, self.target.cfg.head_dim, dtype=p.dtype, device=p.device)
        for s in seqs:
            self.states[s.seq_id] = DSparkState(self, empty, self.drafter.num_layers)

    def observe(self, step: CommittedRows) -> None:
        """Queue the committed rows' taps (only the last `window` rows of a request can ever be read)."""
        if not step.seqs:
            return
        dev = step.input_ids.device
        for (s, e), start, seq in zip(step.spans, step.start_positions, step.seqs):
            state = self.states[seq.seq_id]
            if state.num_committed != start:
                raise RuntimeError(f"DSpark context of request {seq.seq_id} holds {state.num_committed} positions, "
                                   f"but rows start at position {start}")
            first = max(s, e - self.window)
            state.pending.append((step.taps[first:e], torch.arange(start + first - s, start + e - s, device=dev)))
            state.num_pending += e - first
            while state.num_pending - state.pending[0][1].numel() >= self.window:  # superseded rows
                state.num_pending -= state.pending.pop(0)[1].numel()
            state.num_committed = start + e - s

    def flush(self, states: list[DSparkState]) -> None:
        """Project every queued committed row to context K=V (one batched pass) and keep the last `window`."""
        states = [st for st in states if st.pending]
        if not states:
            return
        taps = torch.cat([t for st in states for t, _ in st.pending])  # [R, m, H]
        positions = torch.cat([p for st in states for _, p in st.pending])  # [R]
        ctx = self.drafter.context_kv(self.drafter.main_x(taps), positions)  # per stage [R, D]
        off = 0
        for st in states:
            n = st.num_pending
            st._ctx_kv = [torch.cat([old, new[off : off + n]])[-self.window :] for old, new in zip(st._ctx_kv, ctx)]
            st.pending, st.num_pending = [], 0
            off += n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        drafts = [EMPTY_DRAFT] * len(seqs)
        for k in sorted(set(num_tokens) - {0}):  # one block shape per forward: an effective block of k rows
            members = [r for r, n in enumerate(num_tokens) if n == k]
            for r, d in zip(members, self.propose_block([seqs[r] for r in members], k)):
                drafts[r] = d
        return drafts

    def propose_block(self, seqs: list[Sequence], k: int) -> list[Draft]:
        dev = next(self.drafter.parameters()).device
        states = [self.states[s.seq_id] for s in seqs]
        self.flush(states)
        for s, st in zip(seqs, states):
            if st.num_committed != s.cache.num_tokens:
                raise RuntimeError(f"DSpark context of request {s.seq_id} holds {st.num_committed} positions, "
                                   f"the target cache {s.cache.num_tokens}")
        anchors = torch.tensor([s.output_ids[-1] for s in seqs], device=dev)  # [B]
        block_ids = torch.full((len(seqs), k), self.drafter.noise_token_id, device=dev)
        block_ids[:, 0] = anchors
        starts = torch.tensor([s.cache.num_tokens for s in seqs], device=dev)
        sizes = torch.tensor([st.ctx_kv[0].shape[0] for st in states], device=dev)
        ends = sizes.cumsum(0)
        ctx_ranges = torch.stack([ends - sizes, ends], dim=1)  # [B, 2]
        ctx_kv = [torch.cat([st.ctx_kv[l] for st in states]) for l in range(self.drafter.num_layers)]
        out = self.drafter.forward_block(self.target.embed, self.target.head, block_ids, starts, ctx_kv, ctx_ranges)
        t, top_k, top_p = sampling_tensors(seqs, [1] * len(seqs), dev)
        generators = [s.generator for s in seqs]
        prev, tokens, probs, confs = anchors, [], [], []
        for i in range(k):  # the Markov head, strictly left to right
            logits = self.drafter.markov_logits(out.base_logits[:, i], prev)  # [B, V]
            conf = self.drafter.confidence_logits(out.hidden[:, i], prev)  # [B] or None
            q = ops.process_logits(logits, t, top_k, top_p)  # [B, V] exact draft distribution
            prev = ops.sample(q, generators)
            tokens.append(prev)
            probs.append(q)
            if conf is not None:
                confs.append(self.drafter.confidence(conf, i))
        tokens_bk = torch.stack(tokens, dim=1).tolist()  # [B, k]
        probs_bk = torch.stack(probs, dim=1)  # [B, k, V]
        confs_bk = torch.stack(confs, dim=1) if confs else None  # [B, k]
        return [Draft(tokens_bk[b], None if s.params.greedy else probs_bk[b],
                      None if confs_bk is None else confs_bk[b]) for b, s in enumerate(seqs)]
