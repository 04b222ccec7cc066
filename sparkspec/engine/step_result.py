"""What a step returns to the engine: the one device->host copy read back into per-request results (accepted
counts, emitted tokens, the next drafts with their confidences, logprobs). Pure Python over the host lists that
`step_io.Download.fetch` gives; `ModelRunner.execute` ends here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from sparkspec.engine.step_io import untag

if TYPE_CHECKING:
    from sparkspec.engine.packed_step import PackedStep
    from sparkspec.engine.scheduler import ScheduledSeq

# why a request fails alone when the step's flag says its row was not finite (`RejectionSampler.verify`)
NONFINITE_ERROR = "the model's distribution for this request is not finite (NaN/inf logits)"

Logprobs = list[dict[int, float]]  # per token: {id: logprob}, the top-N highest first, then the token if not among them


@dataclass(slots=True)
class SampledRow:
    """One sampling request's result, on the host."""

    num_accepted: int  # L: drafts accepted
    token_ids: list[int]  # the L + 1 emitted tokens
    next_drafts: list[int]  # drafts proposed for the next step (empty when none were asked for)
    next_confidences: list[float] | None
    logprobs: Logprobs | None = None  # [L + 1] when the request asks for logprobs
    error: str | None = None  # set: the request fails (its tokens are meaningless); the rest of the step commits


@dataclass
class StepResult:
    rows: dict[int, SampledRow]  # item index -> result, for the items that sample
    proposed_q: bool  # the step wrote the next drafts' q into the runner's `q_store` (row = `draft_row`)
    draft_row: dict[int, int]  # item index -> its row of the runner's `q_store`
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


def _host_ints(part, shape: tuple[int, ...]) -> list:
    """One part of the copy back (a host list or a float64 numpy slice) -> nested Python int lists of `shape`,
    converted in one numpy call instead of one int() per element."""
    return np.asarray(part, dtype=np.float64).astype(np.int64).reshape(shape).tolist()


def proposes_q(p: PackedStep, q_store: torch.Tensor | None) -> bool:
    """Step `p` writes its sampled drafts' q into `q_store` rows 0..S-1 (greedy and host drafts stay one-hot)."""
    return q_store is not None and bool(p.sampling) and bool(p.num_drafts) and p.mode != "greedy"


def read_step(p: PackedStep, host: dict, q_store: torch.Tensor | None) -> StepResult:
    """The host copy of step `p` -> per item: accepted count, emitted tokens, next drafts, logprobs. `q_store`:
    the runner's buffer of draft distributions, which the step rewrote when it proposed sampled drafts.

    Each part is converted as a whole ([S, K+1] tokens, [S, k] drafts): the only per-row Python work left is
    building the rows the engine commits."""
    prompt = read_prompt_logprobs(host.get("prompt", []), p.items, p.prompt_items, p.num_prompt_top)
    if not p.sampling:
        return StepResult({}, False, {}, prompt)
    S, K1, k, keep = len(p.sampling), p.K + 1, p.num_drafts, p.keep_drafts
    L = _host_ints(host["accepted"][0], (S,))  # [S]
    toks = _host_ints(host["tokens"][0], (S, K1))  # [S][K+1]
    finite = np.asarray(host["finite"][0], dtype=np.float64).reshape(S).tolist()  # [S] 0.0 = not finite
    has_drafts = k > 0 and "drafts" in host
    nxt = [d[:keep] for d in _host_ints(host["drafts"][0], (S, k))] if has_drafts else None  # [S][keep]
    conf = None
    if has_drafts and "confidences" in host:
        conf = np.asarray(host["confidences"][0], dtype=np.float64).reshape(S, k)[:, :keep].tolist()  # [S][keep]
    proposed_q = proposes_q(p, q_store)
    draft_row = {i: r for r, i in enumerate(p.sampling)}
    if nxt is None and not p.logprob_rows:  # no drafts to keep, no logprobs: one comprehension (most steps)
        rows = {i: SampledRow(n, t[: n + 1], [], None, None, None if ok else NONFINITE_ERROR)
                for i, n, t, ok in zip(p.sampling, L, toks, finite)}
        return StepResult(rows, proposed_q, draft_row, prompt)
    lp_of = {r: j for j, r in enumerate(p.logprob_rows)}
    rows = {}
    for r, i in enumerate(p.sampling):
        emitted = toks[r][: L[r] + 1]
        lps = None
        if r in lp_of:
            lps = logprob_dicts(emitted, host["sampled"], lp_of[r] * K1, min(p.params[r].logprobs, p.num_top),
                                p.num_top)
        rows[i] = SampledRow(L[r], emitted, nxt[r] if nxt is not None else [], conf[r] if conf is not None else None,
                             lps, None if finite[r] else NONFINITE_ERROR)
    return StepResult(rows, proposed_q, draft_row, prompt)


def read_parts(parts: list[tuple[list[int], PackedStep]], host: dict, q_store: torch.Tensor | None) -> StepResult:
    """A step run as parts (`ModelRunner.execute_split`, `ModelRunner.launch`), from its one copy back (each part's
    pieces under its index: `step_io.Download.absorb`) -> one result over the whole step's items. A part that
    proposed sampled drafts has its q rows at its requests' places among the whole step's sampling requests (parts
    in order), where `execute_split` laid them out; the others' drafts are one-hot (-1)."""
    rows, draft_row, prompt_lps, any_q, start = {}, {}, {}, False, 0
    for j, (group, p) in enumerate(parts):
        res = read_step(p, untag(host, str(j)), q_store)
        for i, row in res.rows.items():
            rows[group[i]] = row
        for i, lps in res.prompt_logprobs.items():
            prompt_lps[group[i]] = lps
        for r, i in enumerate(p.sampling):
            draft_row[group[i]] = start + r if res.proposed_q else -1
        any_q |= res.proposed_q
        start += len(p.sampling)
    return StepResult(rows, any_q, draft_row, prompt_lps)


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
