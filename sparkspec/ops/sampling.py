"""Sampling: temperature / top-k / top-p processing and seeded, batch-independent sampling. Legend: R rows,
V vocabulary.

Everything runs on all rows at once on the device with no host sync. Randomness comes from the counter RNG
(`sparkspec.ops.rng`): the uniform a row uses is a function of (seed, offset, stream) only, so a seeded
request gets the same tokens whatever else is in the batch.

Terms:
* **offset** — the absolute position of the token being produced (the index it will have in the sequence).
* **stream** — which use of randomness at that position; independent streams keep drafts, accept tests and
  recovered tokens of speculative decoding (Leviathan et al., arXiv 2211.17192) mutually independent:
  STREAM_TARGET (plain decoding and bonus tokens), STREAM_DRAFT (drafters), STREAM_ACCEPT (accept tests),
  STREAM_RESIDUAL (recovered tokens); STREAM_GUMBEL is the drafter-invariant scheme's one noise, shared on
  purpose by the target and every drafter at a position (`spec_decode/rejection.py`).
* **scheme** — how a sampled row draws: "rejection" (inverse-CDF draws, rejection-sampling verification) or
  "gumbel" (Gumbel-max: token at t = argmax_v(log p_t(v) + G(seed, t, v)); verification accepts a draft iff it
  equals that token, so the output is plain decoding's whatever the drafter). `SamplingTensors.gumbel` says which.
* **greedy row** — temperature below `MIN_TEMPERATURE` (0 included): the argmax, one-hot distribution.
* **finite row** — a row whose distribution is a real one: its logits have no NaN or +inf and not all are
  -inf, and (sampled rows) the processed probabilities are finite with positive mass. Whatever the row holds,
  every id this module returns is in [0, V); the engine fails a request whose row is not finite
  (`RejectionSampler.verify`), and drafters replace such a draft (`sample_draft`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkspec.ops.registry import native, ops
from sparkspec.ops.rng import gumbel, uniform
from sparkspec.sampling_params import MIN_TEMPERATURE

STREAM_TARGET = 0
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_RESIDUAL = 3
STREAM_GRAMMAR = 4  # structured output: redraws of sampled drafts the grammar refuses (engine/grammar.py)
STREAM_GUMBEL = 5  # the Gumbel-max scheme's noise G(seed, t, v): the target's AND the drafters' at position t


@native("process_logits")
def process_logits(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # [R] fp32; rows below MIN_TEMPERATURE are greedy (one-hot on the argmax)
    top_k: torch.Tensor,  # [R] int; <= 0 disables
    top_p: torch.Tensor,  # [R] fp32; 1 disables
    any_top_k: bool = True,  # host flags: False promises no row uses top-k / top-p (skips the sort)
    any_top_p: bool = True,
) -> torch.Tensor:
    """The distribution a request samples from -> probs [R, V] fp32 (rows sum to 1).

    top-k keeps every logit >= the k-th largest (ties at the k-th value are all kept); top-p then keeps the
    smallest prefix of the sorted distribution whose mass reaches top_p, and renormalises.
    """
    logits = logits.float()
    R, V = logits.shape
    greedy = (temperature < MIN_TEMPERATURE).unsqueeze(1)  # [R, 1]
    x = logits / torch.where(greedy, 1.0, temperature.float().unsqueeze(1))
    if any_top_k or any_top_p:  # one descending sort serves both masks
        xs, idx = torch.sort(x, dim=-1, descending=True)  # [R, V]
        k = torch.where(top_k > 0, top_k.clamp(max=V), V).long().unsqueeze(1)  # [R, 1]
        xs = xs.masked_fill(xs < xs.gather(1, k - 1), float("-inf"))
        ps = torch.softmax(xs, dim=-1)  # [R, V] sorted descending
        before = ps.double().cumsum(-1) - ps.double()  # fp64: a long fp32 sum drifts by ~V * 2^-24
        drop = (before >= top_p.double().unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop[:, 0] = False  # mass strictly above an entry reaches top_p: drop it (never the first)
        ps = ps.masked_fill(drop, 0.0)
        ps = ps / ps.sum(-1, keepdim=True)
        probs = torch.empty_like(ps).scatter_(1, idx, ps)
    else:
        probs = torch.softmax(x, dim=-1)
    top = logits.argmax(-1, keepdim=True)  # [R, 1]
    return probs.masked_fill(greedy, 0.0).scatter_(1, top, torch.where(greedy, 1.0, probs.gather(1, top)))


def inverse_cdf(
    probs: torch.Tensor,  # [R, V] >= 0, each row with positive mass (need not sum to 1)
    u: torch.Tensor,  # [R] in the open interval (0, 1)
) -> torch.Tensor:
    """Inverse-CDF draw -> [R] int64: the first token whose cumulative mass exceeds u * (row mass).

    The cumulative sum is in fp64, so each token's chance matches its probability to ~1e-16 (with fp64 u).
    A zero-probability token is never chosen: its cumulative mass equals its predecessor's, so the first
    one above the target is never it; the target is > 0 (u > 0) and kept below the total.
    """
    cdf = probs.double().cumsum(-1)  # [R, V]
    total = cdf[:, -1]
    target = torch.minimum(u.double() * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
    # a row with no mass or a NaN finds no token (index V): clamped, so no id leaves [0, V) (the caller flags it)
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


@native("sample")
def sample(
    probs: torch.Tensor,  # [R, V]
    seeds: torch.Tensor,  # [R] int64
    offsets: torch.Tensor,  # [R] int64: absolute position of the token being produced
    stream: int,
) -> torch.Tensor:
    """One categorical draw per row -> [R] int64; row r depends only on (probs[r], seeds[r], offsets[r],
    stream)."""
    return inverse_cdf(probs, uniform(seeds, offsets, stream, 1, torch.float64).squeeze(1))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device, plus host flags that let kernels skip work.

    Every row has a seed: a request's own `SamplingParams.seed`, else one the caller chose (the engine
    draws one at random when the request arrives).

    `gumbel` picks the scheme of sampled rows: False (every row: rejection sampling), True (every row: the
    Gumbel-max scheme, `EngineConfig.sampling_scheme = "gumbel"`), or a [R] bool tensor (per request; both are
    computed and `torch.where` picks, so a captured graph serves any mix). Greedy rows are the argmax in both.
    """

    temperature: torch.Tensor  # [R] fp32
    top_k: torch.Tensor  # [R] int64
    top_p: torch.Tensor  # [R] fp32
    seeds: torch.Tensor  # [R] int64
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    gumbel: torch.Tensor | bool = False  # bool for all rows, or [R] bool

    def index_select(self, index: torch.Tensor) -> SamplingTensors:  # index [M] int64
        """Rows `index` (e.g. a per-row request index). Flags are kept: still true of any subset."""
        g = self.gumbel[index] if isinstance(self.gumbel, torch.Tensor) else self.gumbel
        return SamplingTensors(self.temperature[index], self.top_k[index], self.top_p[index],
                               self.seeds[index], self.all_greedy, self.any_top_k, self.any_top_p, g)

    def repeat_interleave(self, n: int) -> SamplingTensors:
        """Each row n times in a row ([R] -> [R * n]), e.g. for the K + 1 verify rows of every request."""

        def rep(x):  # expand + reshape: no output-size computation, so no sync
            return x.unsqueeze(1).expand(-1, n).reshape(-1)

        g = rep(self.gumbel) if isinstance(self.gumbel, torch.Tensor) else self.gumbel
        return SamplingTensors(rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.seeds),
                               self.all_greedy, self.any_top_k, self.any_top_p, g)

    @property
    def greedy(self) -> torch.Tensor:  # [R] bool
        return self.temperature < MIN_TEMPERATURE

    @property
    def all_gumbel(self) -> bool:
        """Every row uses the Gumbel-max scheme (host flag): no draft q is needed, none is computed."""
        return self.gumbel is True

    @property
    def any_gumbel(self) -> bool:
        return self.gumbel is not False


def probs_for(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:  # logits [R, V] -> [R, V]
    """process_logits with the rows' parameters and host flags."""
    return process_logits(logits, st.temperature, st.top_k, st.top_p, st.any_top_k, st.any_top_p)


def logprobs_for(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:  # logits [R, V] -> [R, V] fp32
    """Log-probabilities of the distribution each row samples from: log_softmax(logits / temperature) renormalised
    over the tokens top-k / top-p keep (-inf elsewhere), i.e. the log of `probs_for` computed without its
    rounding. Greedy rows (below MIN_TEMPERATURE), whose distribution is one-hot, give the log-softmax of the raw logits
    instead, as vLLM does: the logprobs a client asks for at temperature 0 are the model's own."""
    if st.all_greedy:
        return torch.log_softmax(logits.float(), -1)
    return torch.log_softmax(scaled_logits(logits, st), -1)


def scaled_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:  # [R, V] -> [R, V] fp32
    """logits / temperature with -inf outside the tokens top-k / top-p keep: log p up to a per-row constant, p
    the distribution `probs_for` gives (greedy rows: the raw logits)."""
    logits = logits.float()
    greedy = st.greedy.unsqueeze(1)  # [R, 1]
    x = logits / torch.where(greedy, 1.0, st.temperature.float().unsqueeze(1))
    if st.any_top_k or st.any_top_p:
        x = x.masked_fill((probs_for(logits, st) <= 0) & ~greedy, float("-inf"))
    return x


@native("gumbel_argmax")
def gumbel_argmax(
    x: torch.Tensor,  # [R, V] fp32 log p up to a per-row constant (-inf: excluded token)
    seeds: torch.Tensor,  # [R] int64
    offsets: torch.Tensor,  # [R] int64: absolute position of the token being produced
) -> torch.Tensor:
    """The Gumbel-max draw -> [R] int64: argmax_v(x[r, v] + G(seeds[r], offsets[r], v)), G from STREAM_GUMBEL.
    It is a draw from softmax(x[r]) (Gumbel 1954; the max of log p + Gumbel noise lands on v with chance p(v)),
    and depends only on (x[r], seeds[r], offsets[r])."""
    return (x + gumbel(seeds, offsets, STREAM_GUMBEL, x.shape[-1])).argmax(-1)


def is_finite_scaled(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [R, V], [R, V] -> [R] bool
    """`is_finite_dist` from the scaled logits instead of the probabilities: the raw row has no NaN / +inf and is
    not all -inf, and logits / T neither overflows to +inf nor leaves every kept token at -inf."""
    return torch.isfinite(logits.amax(-1)) & torch.isfinite(x.amax(-1))


def gumbel_sample(
    logits: torch.Tensor,  # [R, V]
    st: SamplingTensors,  # R rows
    offsets: torch.Tensor,  # [R] int64: absolute position of the token being produced
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gumbel-max scheme's token per row -> (ids [R] int64: the argmax on greedy rows, else `gumbel_argmax` of
    the processed distribution; is_finite [R] bool, as `is_finite_dist`). Plain decoding, verification and the
    drafters all call this, so a position's token is a function of (logits, seed, position) alone."""
    x = scaled_logits(logits, st)  # [R, V]
    ids = torch.where(st.greedy, logits.argmax(-1), ops.gumbel_argmax(x, st.seeds, offsets))
    return ids, is_finite_scaled(logits, x)


def gather_logprobs(
    logprobs: torch.Tensor,  # [R, V]
    token_ids: torch.Tensor,  # [R] int64 (negative ids read as 0: padding rows)
    num_top: int,  # N alternatives per row (host int)
) -> list[torch.Tensor]:
    """-> [token logprob [R], top values [R, N], top ids [R, N]] (each row's N most likely tokens, highest
    first); without N, the token logprobs only."""
    picked = logprobs.gather(1, token_ids.clamp(min=0).unsqueeze(1)).squeeze(1)
    if not num_top:
        return [picked]
    values, ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return [picked, values, ids]


def is_finite_dist(
    logits: torch.Tensor,  # [..., V]
    probs: torch.Tensor | None = None,  # [..., V] the processed distribution (sampled rows), or None (greedy)
) -> torch.Tensor:
    """-> [...] bool: the row's distribution is a real one (see "finite row" above). NaN and +inf propagate
    through the max, and all -inf leaves it -inf; a finite logit row can still overflow `logits / T`, which the
    mass of `probs` shows (greedy rows there are one-hot: mass 1)."""
    ok = torch.isfinite(logits.amax(-1))
    if probs is not None:
        mass = probs.sum(-1)
        ok &= torch.isfinite(mass) & (mass > 0)
    return ok


def bitmask_allowed(
    bitmask: torch.Tensor,  # [..., W] int32, W = ceil(V / 32): bit j of word w allows token 32·w + j (xgrammar's)
    vocab_size: int,
) -> torch.Tensor:
    """-> [..., V] bool: the tokens a grammar bitmask allows."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(-2)[..., :vocab_size]


def apply_token_bitmask(
    logits: torch.Tensor,  # [..., V]
    bitmask: torch.Tensor,  # [..., W] int32 (see `bitmask_allowed`)
) -> torch.Tensor:
    """-> logits [..., V] with -inf where the bitmask disallows the token (structured output's grammar mask)."""
    return logits.masked_fill(~bitmask_allowed(bitmask, logits.shape[-1]), float("-inf"))


def mask_draft_probs(
    q: torch.Tensor,  # [..., V] draft distributions
    bitmask: torch.Tensor,  # [..., W] int32: the grammar mask at each draft's position
) -> torch.Tensor:
    """-> [..., V] q restricted to the allowed tokens and renormalised (q_m of `engine/grammar.py`); a row with no
    allowed mass keeps its q (its draft is refused, kept, and rejected by the masked target)."""
    qm = q * bitmask_allowed(bitmask, q.shape[-1])
    mass = qm.sum(-1, keepdim=True)
    return torch.where(mass > 0, qm / torch.where(mass > 0, mass, 1.0), q)


# the Gumbel rows' proposal rule s (`sample_draft`): the best measured on the demo pair (`sparkspec eval
# --gumbel-draft-temperature`)
DEFAULT_GUMBEL_DRAFT_TEMPERATURE = 1.0


def sample_draft(
    logits: torch.Tensor,  # [R, V] a drafter's logits
    st: SamplingTensors,  # R rows
    offsets: torch.Tensor,  # [R] int64: absolute position of the draft
    stream: int,
    gumbel_temperature: float = DEFAULT_GUMBEL_DRAFT_TEMPERATURE,  # s of the Gumbel rows' proposal rule (host)
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft per row and the exact q it was drawn from -> (ids [R] int64, q [R, V] fp32, or None when every row
    uses the Gumbel-max scheme: its verification needs no q).

    Rejection rows draw from q with `stream` at `offsets`; Gumbel rows draw argmax(log q_s + G) with the target's
    own noise at the draft's position (`gumbel_sample`, STREAM_GUMBEL), which is what makes a good drafter's
    draft equal the target's token there. q_s is the drafter's distribution with its logits divided by
    `gumbel_temperature` before the request's processing (s < 1 sharpens, s > 1 flattens): any rule is lossless
    under the Gumbel scheme (verification never reads q), only the acceptance changes. s = 1 is the default: when
    the drafter's log q errs on log p alike for every token, argmax(log q + G) is the token most likely to be the
    target's argmax(log p + G); on the demo pair (DSpark k = 7, T = 0.7 and 1) every other s tried accepts less, as
    do cutting q's tail by top-p and replacing log q by a calibrated log E[p | q].

    A row whose distribution is not finite (a numerically broken drafter) drafts deterministically instead: the
    argmax of its non-NaN logits, with q one-hot on it. Verification stays lossless (it is for any draft whose q is
    exact, and for any draft at all under the Gumbel scheme), the id is in range, and the target, not the drafter,
    decides the request's tokens."""
    fallback = logits.float().masked_fill(torch.isnan(logits), float("-inf")).argmax(-1)  # [R], 0 if all NaN
    # a positive scale keeps every argmax (greedy rows) and every non-finite value's finiteness (the checks)
    proposal = logits if gumbel_temperature == 1.0 else logits.float() / gumbel_temperature
    if st.all_gumbel:
        ids, ok = gumbel_sample(proposal, st, offsets)
        return torch.where(ok, ids, fallback), None
    q = probs_for(logits, st)
    ok = is_finite_dist(logits, q)  # [R]
    ids = sample(q, st.seeds, offsets, stream)
    if st.any_gumbel:
        ids = torch.where(st.gumbel, gumbel_sample(proposal, st, offsets)[0], ids)
    ids = torch.where(ok, ids, fallback)
    one_hot = torch.zeros_like(q).scatter_(1, fallback.unsqueeze(1), 1.0)
    return ids, torch.where(ok.unsqueeze(1), q, one_hot)
