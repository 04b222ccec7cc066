"""MTP drafting at inference (DeepSeek-V3 report §2.2 multi-token prediction used as a drafter; the layer
math lives in `sparkspec.models.mtp`). Legend: B requests, W window, D latent, n hc streams, H hidden.

MTP state per request and layer: the K=V rows of the last `sliding_window` committed positions, and the
layer's output streams at the last committed row (layer 0's predicts d_0; layer j's feeds layer j+1).
`observe` runs every layer over the committed rows (layer 0 on the target's final streams). Draft steps
j >= 1 run on the MTP's own previous output at positions N.., keeping their K=V rows in local variables
only: the stored state never sees a draft, so rollback is exact by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkspec.generation import Sequence, sampling_tensors
from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.mtp import MTPDraftModel
from sparkspec.ops import ops
from sparkspec.spec_decode.proposer import EMPTY_DRAFT, CommittedRows, Draft, Proposer


@dataclass
class MTPState:
    kv: list[torch.Tensor]  # per layer [<= W, D] K=V rows of the last committed positions
    pos: list[torch.Tensor]  # per layer [<= W] their positions
    last_out: list[torch.Tensor | None]  # per layer [n·H] output streams of the last committed row
    num_committed: int = 0


class MTPProposer(Proposer):
    method = "mtp"
    needs_final_streams = True

    def __init__(self, target: DeepseekV4Model, drafter: MTPDraftModel, num_spec_tokens: int):
        super().__init__(num_spec_tokens)
        self.target, self.drafter = target, drafter
        self.window = drafter.window
        self.states: dict[int, MTPState] = {}

    def start(self, seqs: list[Sequence]) -> None:
        p = next(self.drafter.parameters())
        n = self.drafter.num_layers
        kv = torch.zeros(0, self.target.cfg.head_dim, dtype=p.dtype, device=p.device)
        pos = torch.zeros(0, dtype=torch.long, device=p.device)
        for s in seqs:
            self.states[s.seq_id] = MTPState([kv] * n, [pos] * n, [None] * n)

    def observe(self, step: CommittedRows) -> None:
        if not step.seqs:
            return
        dev = step.input_ids.device
        states = [self.states[s.seq_id] for s in step.seqs]
        for st, start, seq in zip(states, step.start_positions, step.seqs):
            if st.num_committed != start:
                raise RuntimeError(f"MTP state of request {seq.seq_id} holds {st.num_committed} positions, "
                                   f"but rows start at position {start}")
        rows = torch.cat([torch.arange(s, e, device=dev) for s, e in step.spans])
        positions = torch.cat([torch.arange(st, st + e - s, device=dev)
                               for (s, e), st in zip(step.spans, step.start_positions)])
        next_ids = torch.cat([step.next_ids(r) for r in range(len(step.seqs))])
        spans, off = [], 0
        for s, e in step.spans:
            spans.append((off, off + e - s))
            off += e - s
        prev = step.final_streams[rows]  # [T, n·H] layer 0 reads the target
        outs, kvs = [], []
        for j in range(self.drafter.num_layers):
            if j > 0:  # layer j at row i reads layer j-1's output at row i-1
                prev = torch.cat([torch.cat([self.previous(st, j - 1, outs[-1]), outs[-1][s : e - 1]])
                                  for st, (s, e) in zip(states, spans)])
            pools = [(st.kv[j], st.pos[j]) for st in states]
            out, kv = self.drafter.forward_rows(j, self.target.embed, prev, next_ids, positions, pools, spans)
            outs.append(out)
            kvs.append(kv)
        for st, (s, e), start in zip(states, spans, step.start_positions):
            for j in range(self.drafter.num_layers):
                st.kv[j] = torch.cat([st.kv[j], kvs[j][s:e]])[-self.window :]
                st.pos[j] = torch.cat([st.pos[j], positions[s:e]])[-self.window :]
                st.last_out[j] = outs[j][e - 1]
            st.num_committed = start + e - s

    @staticmethod
    def previous(st: MTPState, layer: int, like: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s output at the row before this step's first row -> [1, n·H] (zeros at position 0)."""
        last = st.last_out[layer]
        return torch.zeros_like(like[:1]) if last is None else last.unsqueeze(0)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        members = [r for r, k in enumerate(num_tokens) if k > 0]
        drafts = [EMPTY_DRAFT] * len(seqs)
        if not members:
            return drafts
        group = [seqs[r] for r in members]
        ks = [num_tokens[r] for r in members]
        states = [self.states[s.seq_id] for s in group]
        for s, st in zip(group, states):
            if st.num_committed != s.cache.num_tokens:
                raise RuntimeError(f"MTP state of request {s.seq_id} holds {st.num_committed} positions, "
                                   f"the target cache {s.cache.num_tokens}")
        dev = states[0].kv[0].device
        t, top_k, top_p = sampling_tensors(group, [1] * len(group), dev)
        streams = torch.stack([st.last_out[0] for st in states])  # [B, n·H] layer 0 at row N-1
        spec = [{} for _ in group]  # per request: layer -> (kv rows, positions) of this chain only
        tokens = [[] for _ in group]
        probs = [[] for _ in group]
        active = list(range(len(group)))
        for j in range(max(ks)):
            active = [b for b in active if ks[b] > j]
            if j > 0:
                layer = min(j, self.drafter.num_layers - 1)
                ids = torch.tensor([tokens[b][-1] for b in active], device=dev)
                pos = torch.tensor([group[b].cache.num_tokens - 1 + j for b in active], device=dev)
                pools = []
                for b in active:
                    kv, p = spec[b].get(layer, (states[b].kv[layer][:0], states[b].pos[layer][:0]))
                    pools.append((torch.cat([states[b].kv[layer], kv]), torch.cat([states[b].pos[layer], p])))
                streams, kv_new = self.drafter.forward_rows(j, self.target.embed, streams, ids, pos, pools,
                                                            [(i, i + 1) for i in range(len(active))])
                for i, b in enumerate(active):
                    kv, p = spec[b].get(layer, (states[b].kv[layer][:0], states[b].pos[layer][:0]))
                    spec[b][layer] = (torch.cat([kv, kv_new[i : i + 1]]), torch.cat([p, pos[i : i + 1]]))
            logits = self.drafter.logits(j, streams, self.target.norm, self.target.head)  # [len(active), V]
            rows = torch.tensor(active, device=dev)
            q = ops.process_logits(logits, t[rows], top_k[rows], top_p[rows])
            tok = ops.sample(q, [group[b].generator for b in active]).tolist()
            for i, b in enumerate(active):
                tokens[b].append(tok[i])
                probs[b].append(q[i])
            if j + 1 < max(ks):  # the next step continues only the requests that need more drafts
                keep = [i for i, b in enumerate(active) if ks[b] > j + 1]
                streams = streams[keep]
        for i, r in enumerate(members):
            drafts[r] = Draft(tokens[i], None if group[i].params.greedy else torch.stack(probs[i]))
        return drafts
