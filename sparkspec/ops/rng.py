"""Counter-based random numbers in plain torch ops: Philox-4x32-10 (Salmon et al., "Parallel random numbers:
as easy as 1, 2, 3", SC 2011), the generator behind cuRAND and torch's CUDA RNG.

A counter-based generator is a keyed bijection: the value at (seed, offset, stream, j) is computed directly,
with no state to carry. So every row of a batch draws from its own request's numbers, whatever else is in
the batch, on CPU and CUDA alike (integer ops only, so the bits are identical), with no host sync.

Terms:
* **seed** — int64 per row: the Philox key (two 32-bit words).
* **offset** — int64 per row: for sampling, the absolute position of the token being produced.
* **stream** — a small int that separates independent uses at the same offset (see `sampling.STREAM_*`).
* **j** — the index of a value within one (seed, offset, stream) triple.
The Philox counter is (offset low word, offset high word, j, stream).

All arithmetic is on 32-bit words held in int64 tensors. A 32 x 32-bit product may overflow int64; torch
wraps it (two's complement, on CPU and CUDA), so its bits are right, and masking after the arithmetic right
shift discards the sign. The known-answer tests (tests/test_sampler.py) check this on each device.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox-4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * m for a 32-bit word tensor `a` and a 32-bit constant `m`."""
    prod = a * m  # the 64-bit product, wrapped into int64: its bits are right, its sign may not be
    return (prod >> 32) & MASK32, prod & MASK32


def philox(c0, c1, c2, c3, k0, k1, rounds: int = ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 of counter (c0..c3) under key (k0, k1); all 32-bit words in broadcastable int64 tensors
    (c1..c3 may be Python ints). Returns the 4 output words, each an int64 tensor in [0, 2^32)."""
    k0, k1 = torch.as_tensor(k0), torch.as_tensor(k1)
    bumps = torch.arange(rounds, dtype=torch.int64, device=k0.device)
    ks0 = (k0.unsqueeze(-1) + bumps * _W0) & MASK32  # [..., rounds] every round's key at once
    ks1 = (k1.unsqueeze(-1) + bumps * _W1) & MASK32
    for r in range(rounds):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ ks0[..., r], lo1, hi0 ^ c3 ^ ks1[..., r], lo0
    return c0, c1, c2, c3


def _words(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 -> its (low, high) 32-bit words."""
    return x & MASK32, (x >> 32) & MASK32


def uniform_at(
    seeds: torch.Tensor,  # int64, broadcastable with the others
    offsets: torch.Tensor,  # int64
    streams: torch.Tensor | int,  # int64 or int
    j: torch.Tensor | int,  # int64 or int
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Elementwise uniform in the open interval (0, 1) at (seed, offset, stream, j), broadcast over the inputs
    (see `to_unit`)."""
    s0, s1 = _words(seeds)
    o0, o1 = _words(offsets)
    streams, j = streams & MASK32, j & MASK32  # Python ints stay ints: no host-to-device copy
    w0, w1, _, _ = philox(o0, o1, j, streams, s0, s1)
    return to_unit(w0, w1, dtype)


def to_unit(w0: torch.Tensor, w1: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Two random 32-bit words -> a uniform in the open interval (0, 1) (float32 uses w0 only).

    float32: (2k + 1) / 2^24 for a 23-bit k (the largest value is 1 - 2^-24 < 1);
    float64: (2k + 1) / 2^53 for a 52-bit k. Both are exact: no rounding can reach 0 or 1.
    """
    if dtype == torch.float32:
        return (2 * (w0 >> 9) + 1).to(torch.float32) * 2.0**-24
    if dtype == torch.float64:
        k = ((w0 >> 6) << 26) | (w1 >> 6)
        return (2 * k + 1).to(torch.float64) * 2.0**-53
    raise ValueError(f"dtype {dtype}: expected torch.float32 or torch.float64")


def uniform(
    seeds: torch.Tensor,  # [R] int64
    offsets: torch.Tensor,  # [R] int64
    stream: int,
    n: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """-> [R, n] uniforms in (0, 1); value (r, j) depends only on (seeds[r], offsets[r], stream, j)."""
    j = torch.arange(n, dtype=torch.int64, device=seeds.device)
    return uniform_at(seeds.unsqueeze(1), offsets.unsqueeze(1), stream, j, dtype)


def gumbel(
    seeds: torch.Tensor,  # [R] int64
    offsets: torch.Tensor,  # [R] int64
    stream: int,
    n: int,
) -> torch.Tensor:
    """-> [R, n] fp32 standard Gumbel noise; value (r, v) depends only on (seeds[r], offsets[r], stream, v).

    One Philox call gives two values: v = 2c + h uses counter j = c and words (w0, w1) for h = 0, (w2, w3) for
    h = 1. The high word and the low word make a uniform w with a 2^-64 floor, so the Gumbel tail reaches ~44
    (an fp32 uniform would cap it at 16.6, which the maximum over a 100k vocabulary crosses in ~1 % of rows);
    w is kept <= 1 - 2^-24 (rounding must never give w = 1, i.e. noise -inf, which would make a token of
    probability ~1 lose). Then E = -log1p(-w) ~ Exp(1) and G = -log E. fp32 only, so a Triton kernel can
    compute the same values."""
    c = torch.arange((n + 1) // 2, dtype=torch.int64, device=seeds.device)
    s0, s1 = _words(seeds.unsqueeze(1))
    o0, o1 = _words(offsets.unsqueeze(1))
    w0, w1, w2, w3 = philox(o0, o1, c, stream & MASK32, s0, s1)  # each [R, ceil(n / 2)]
    hi = torch.stack([w0, w2], -1).flatten(-2)[:, :n]  # [R, n]
    lo = torch.stack([w1, w3], -1).flatten(-2)[:, :n]
    w = hi.float() * 2.0**-32 + (lo.float() + 0.5) * 2.0**-64
    w = w.clamp(max=1.0 - 2.0**-24)
    return -torch.log(-torch.log1p(-w))
