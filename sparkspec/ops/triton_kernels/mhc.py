"""Fused mHC kernels (Triton): mhc_pre (RMS + mixing matmul + sigmoids + Sinkhorn + stream collapse),
mhc_post (stream update) and hc_head (final collapse).

Legend: T tokens, n hc streams (NP = next power of two), H hidden, K = n·H, M = (2+n)·n mixes (BLOCK_M >= 16
with `tl.dot`).
mhc_pre / hc_head run in two launches:
  1. `_mix_partial_kernel`, grid (token blocks, SPLIT): each program streams one K chunk of x·fnᵀ (from 16
     tokens through `tl.dot`, exact fp32; a decode step's tokens one per program as a product summed over the
     chunk) and Σx², writing fp32 partials — split-K, so a few tokens still fill the GPU;
  2. a finish kernel, grid (token blocks, H chunks): sums the partials in a fixed order (deterministic),
     applies the weight-free RMS, the sigmoids and the n×n Sinkhorn in registers (recomputed per H chunk:
     a few hundred flops per token; one token of 4 streams on 16 register scalars), and collapses its H chunk of
     the streams.
mhc_post_pre (a sublayer's post, then the next sublayer's pre) runs in two: `_mhc_post_mix_kernel` writes the new
streams and, from the rounded values it stores, the split-K partials of step 1 (one split per H chunk); then 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkspec.ops.batch_invariant import pinned
from sparkspec.ops.registry import accelerated
from sparkspec.ops.triton_kernels.common import check, next_pow2, on_interpreter, same_device


@triton.jit
def _mix_partial_kernel(
    x_ptr,  # [T, K] (row stride stride_xt, unit inner stride)
    fn_ptr,  # [M, K] fp32
    part_ptr,  # [SPLIT, T, BLOCK_M] fp32 partial x·fnᵀ
    sumsq_ptr,  # [SPLIT, T] fp32 partial Σx²
    num_tokens,
    num_mix,
    width,  # K
    chunk,  # K columns per split (a multiple of BLOCK_K)
    stride_xt,
    stride_fm,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,  # the mixes by tl.dot (BLOCK_T >= 16), else as a product summed over the chunk
):
    """Without DOT a program holds a few tokens (one for a decode step) and no padding rows, as in
    `_mhc_post_mix_kernel`: at one token `tl.dot`'s 16-row tile is what the launch waits on."""
    split = tl.program_id(1)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mixes = tl.arange(0, BLOCK_M)
    tok_ok = toks < num_tokens
    k_lo = split * chunk
    k_hi = tl.minimum(k_lo + chunk, width)
    acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_ptr + toks[:, None].to(tl.int64) * stride_xt + ks[None, :],
                    mask=tok_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_K]
        w = tl.load(fn_ptr + mixes[:, None] * stride_fm + ks[None, :],
                    mask=(mixes[:, None] < num_mix) & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        if DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        sumsq += tl.sum(x * x, axis=1)
    row = split.to(tl.int64) * num_tokens + toks
    tl.store(part_ptr + row[:, None] * BLOCK_M + mixes[None, :], acc, mask=tok_ok[:, None])
    tl.store(sumsq_ptr + row, sumsq, mask=tok_ok)


@triton.jit
def _mix_total(part_ptr, sumsq_ptr, toks, num_tokens, num_splits, width, rms_eps,
               BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """Σ over splits (fixed order) · rsqrt(mean x² + eps) -> mix [BLOCK_T, BLOCK_M] fp32. One token (BLOCK_S > 1)
    sums BLOCK_S splits a step as a tile: one round of loads, where a split at a time waits out an L2 round trip
    per 4 splits (the loop unrolled), 32 of them for 128 splits. Token tiles keep the loop: summed as a tile, their
    mix comes in a layout that makes the Sinkhorn's tile loop ~20x the instructions (sm_90 SASS)."""
    mixes = tl.arange(0, BLOCK_M)
    tok_ok = toks < num_tokens
    acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    if BLOCK_S > 1:
        for s0 in range(0, num_splits, BLOCK_S):
            splits = s0 + tl.arange(0, BLOCK_S)
            ok = tok_ok[:, None] & (splits < num_splits)[None, :]  # [BLOCK_T, BLOCK_S]
            row = splits[None, :].to(tl.int64) * num_tokens + toks[:, None]
            part = tl.load(part_ptr + row[:, :, None] * BLOCK_M + mixes[None, None, :], mask=ok[:, :, None],
                           other=0.0)
            acc += tl.sum(part, axis=1)
            sumsq += tl.sum(tl.load(sumsq_ptr + row, mask=ok, other=0.0), axis=1)
    else:
        for split in range(0, num_splits):
            row = split * num_tokens + toks.to(tl.int64)
            acc += tl.load(part_ptr + row[:, None] * BLOCK_M + mixes[None, :], mask=tok_ok[:, None], other=0.0)
            sumsq += tl.load(sumsq_ptr + row, mask=tok_ok, other=0.0)
    return acc * tl.rsqrt(sumsq / width + rms_eps)[:, None]


def _sum_block(splits: int, block_t: int, block_m: int) -> int:
    """BLOCK_S of `_mix_total`: one token's splits in one step, up to a [BLOCK_S, BLOCK_M] tile of 4,096 entries
    (32 registers a thread at 4 warps); 1 for token tiles. Batch-invariant mode fixes all three (one token, the
    split count by the width), so each token's order of sums."""
    return min(next_pow2(splits), 4096 // block_m) if block_t == 1 else 1


@triton.jit
def _take(mix, start, count, BLOCK_M: tl.constexpr, NP: tl.constexpr):
    """Columns start .. start+count-1 of mix [BLOCK_T, BLOCK_M] -> [BLOCK_T, NP] (0 beyond count)."""
    j = tl.arange(0, NP)
    c = tl.arange(0, BLOCK_M)
    sel = (c[None, :] == start + j[:, None]) & (j[:, None] < count)  # [NP, BLOCK_M]
    return tl.sum(mix[:, None, :] * sel[None, :, :].to(tl.float32), axis=2)


@triton.jit
def _collapse_chunk(x_ptr, out_ptr, pre, toks, num_tokens, num_streams, hidden,
                    NP: tl.constexpr, BLOCK_HD: tl.constexpr):
    """out[t, chunk] = Σ_i pre[t, i] · x[t, i, chunk] for this program's H chunk (x, out contiguous)."""
    hs = tl.program_id(1) * BLOCK_HD + tl.arange(0, BLOCK_HD)
    streams = tl.arange(0, NP)
    tok_ok = toks < num_tokens
    t64 = toks.to(tl.int64)
    mask = tok_ok[:, None, None] & (streams[None, :, None] < num_streams) & (hs[None, None, :] < hidden)
    x = tl.load(x_ptr + t64[:, None, None] * num_streams * hidden + streams[None, :, None] * hidden
                + hs[None, None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, NP, BLOCK_HD]
    y = tl.sum(pre[:, :, None] * x, axis=1)
    tl.store(out_ptr + t64[:, None] * hidden + hs[None, :], y.to(out_ptr.dtype.element_ty),
             mask=tok_ok[:, None] & (hs[None, :] < hidden))


@triton.jit
def _collapse_norm(x_ptr, out_ptr, out32_ptr, w_ptr, pre, toks, num_tokens, num_streams, hidden, eps,
                   BLOCK_T: tl.constexpr, NP: tl.constexpr, BLOCK_HD: tl.constexpr, OUT32: tl.constexpr):
    """out[t] = rms_norm(round(Σ_i pre[t, i] · x[t, i])) · w over whole rows: a first pass over H sums the squares
    of the rounded collapse, a second recomputes it (x is re-read: n·H values a token) and stores it normalised."""
    streams = tl.arange(0, NP)
    tok_ok = toks < num_tokens
    t64 = toks.to(tl.int64)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_HD):
        hs = h0 + tl.arange(0, BLOCK_HD)
        mask = tok_ok[:, None, None] & (streams[None, :, None] < num_streams) & (hs[None, None, :] < hidden)
        x = tl.load(x_ptr + t64[:, None, None] * num_streams * hidden + streams[None, :, None] * hidden
                    + hs[None, None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, NP, BLOCK_HD]
        y = tl.sum(pre[:, :, None] * x, axis=1).to(out_ptr.dtype.element_ty).to(tl.float32)
        sumsq += tl.sum(y * y, axis=1)
    rstd = 1.0 / tl.sqrt(sumsq / hidden + eps)
    for h0 in range(0, hidden, BLOCK_HD):
        hs = h0 + tl.arange(0, BLOCK_HD)
        h_ok = hs < hidden
        mask = tok_ok[:, None, None] & (streams[None, :, None] < num_streams) & h_ok[None, None, :]
        x = tl.load(x_ptr + t64[:, None, None] * num_streams * hidden + streams[None, :, None] * hidden
                    + hs[None, None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.sum(pre[:, :, None] * x, axis=1).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + hs, mask=h_ok, other=0.0).to(tl.float32)
        normed = (y * rstd[:, None] * w[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t64[:, None] * hidden + hs[None, :], normed, mask=tok_ok[:, None] & h_ok[None, :])
        if OUT32:  # the same rounded values in fp32: what `.float()` of the layer input gives
            tl.store(out32_ptr + t64[:, None] * hidden + hs[None, :], normed.to(tl.float32),
                     mask=tok_ok[:, None] & h_ok[None, :])


@triton.jit
def _norm4(v0, v1, v2, v3, eps):
    """v / (Σv + eps) for 4 scalars: Σ as a tree of register adds, the division as a product by rsqrt(Σv + eps)²,
    one MUFU op and a multiply (the sum lies in [eps, n + eps]). `/` compiles to a full-range division (range
    tests and rescaling around the reciprocal): ~180 instructions a Sinkhorn iteration instead of ~80, as many as
    the tile's shuffles cost. A few fp32 ulps (rsqrt.approx) where the reference rounds once."""
    r = tl.math.rsqrt((v0 + v1) + (v2 + v3) + eps)
    r = r * r
    return v0 * r, v1 * r, v2 * r, v3 * r


@triton.jit
def _unpack4(v):
    """The entries of a [4] tensor as 4 scalars."""
    lo, hi = tl.split(tl.reshape(v, [2, 2]))  # (v0, v2), (v1, v3)
    v0, v2 = tl.split(lo)
    v1, v3 = tl.split(hi)
    return v0, v1, v2, v3


@triton.jit
def _pack4(v0, v1, v2, v3):
    """The inverse of `_unpack4`, as [2, 2] (reshaped to [4]: v0 .. v3); of 4 [..] tensors [.., 2, 2]."""
    return tl.join(tl.join(v0, v2), tl.join(v1, v3))


@triton.jit
def _sinkhorn(comb, iters, eps, BLOCK_T: tl.constexpr, NP: tl.constexpr):
    """comb [BLOCK_T, NP(a), NP(b)] (0 outside n×n) -> its columns normalised, then iters - 1 passes of rows then
    columns, each x / (Σ + eps): the reference's order. One token of 4 streams (a decode step's programs, and every
    program in batch-invariant mode) runs on 16 register scalars (`_norm4`): a sum is then 3 adds in a thread, where
    the tile's `tl.sum`s cross threads (two dependent shuffles each), four a serial iteration: ~2 µs of the
    finish's ~6 at 20 iterations."""
    if BLOCK_T == 1 and NP == 4:
        lo, hi = tl.split(tl.reshape(comb, [4, 2, 2]))  # [a, b_hi, b_lo]: columns (0, 2), (1, 3)
        c0, c2 = tl.split(lo)
        c1, c3 = tl.split(hi)
        x00, x10, x20, x30 = _unpack4(c0)
        x01, x11, x21, x31 = _unpack4(c1)
        x02, x12, x22, x32 = _unpack4(c2)
        x03, x13, x23, x33 = _unpack4(c3)
        x00, x10, x20, x30 = _norm4(x00, x10, x20, x30, eps)
        x01, x11, x21, x31 = _norm4(x01, x11, x21, x31, eps)
        x02, x12, x22, x32 = _norm4(x02, x12, x22, x32, eps)
        x03, x13, x23, x33 = _norm4(x03, x13, x23, x33, eps)
        for _ in range(iters - 1):
            x00, x01, x02, x03 = _norm4(x00, x01, x02, x03, eps)
            x10, x11, x12, x13 = _norm4(x10, x11, x12, x13, eps)
            x20, x21, x22, x23 = _norm4(x20, x21, x22, x23, eps)
            x30, x31, x32, x33 = _norm4(x30, x31, x32, x33, eps)
            x00, x10, x20, x30 = _norm4(x00, x10, x20, x30, eps)
            x01, x11, x21, x31 = _norm4(x01, x11, x21, x31, eps)
            x02, x12, x22, x32 = _norm4(x02, x12, x22, x32, eps)
            x03, x13, x23, x33 = _norm4(x03, x13, x23, x33, eps)
        cols = _pack4(_pack4(x00, x10, x20, x30), _pack4(x01, x11, x21, x31), _pack4(x02, x12, x22, x32),
                      _pack4(x03, x13, x23, x33))  # [a_hi, a_lo, b_hi, b_lo]
        comb = tl.reshape(cols, [1, 4, 4])
    else:
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    return comb


@triton.jit
def _mhc_pre_finish_kernel(
    x_ptr,  # [T, n, H] contiguous
    part_ptr,  # [SPLIT, T, BLOCK_M] fp32
    sumsq_ptr,  # [SPLIT, T] fp32
    scale_ptr,  # [3] fp32 (pre, post, comb)
    base_ptr,  # [M] fp32
    out_ptr,  # [T, H] x.dtype   layer input (normalised with NORM)
    post_ptr,  # [T, n] fp32
    comb_ptr,  # [T, n, n] fp32
    norm_w_ptr,  # [H] the sublayer's RMSNorm weight (read only with NORM)
    out32_ptr,  # [T, H] fp32 copy of the normalised layer input (written only with OUT32)
    num_tokens,
    num_streams,
    hidden,
    num_splits,
    rms_eps,
    hc_eps,
    sinkhorn_iters,
    norm_eps,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits summed a step
    BLOCK_HD: tl.constexpr,
    NP: tl.constexpr,
    NORM: tl.constexpr,  # one program per token block over all of H (grid (token blocks, 1))
    OUT32: tl.constexpr,  # with NORM: also store the layer input in fp32
):
    n = num_streams
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    num_owned = tl.where(tl.program_id(1) == 0, num_tokens, 0)  # the first H chunk stores post and comb
    mix = _mix_total(part_ptr, sumsq_ptr, toks, num_tokens, num_splits, n * hidden, rms_eps, BLOCK_T, BLOCK_M,
                     BLOCK_S)
    s_pre = tl.load(scale_ptr + 0)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    j = tl.arange(0, NP)
    j_ok = j < n

    pre_b = tl.load(base_ptr + j, mask=j_ok, other=0.0)
    pre = tl.sigmoid(_take(mix, 0, n, BLOCK_M, NP) * s_pre + pre_b[None, :]) + hc_eps
    pre = tl.where(j_ok[None, :], pre, 0.0)  # [BLOCK_T, NP]
    post_b = tl.load(base_ptr + n + j, mask=j_ok, other=0.0)
    post = 2.0 * tl.sigmoid(_take(mix, n, n, BLOCK_M, NP) * s_post + post_b[None, :])
    tl.store(post_ptr + toks[:, None].to(tl.int64) * n + j[None, :], post,
             mask=(toks < num_owned)[:, None] & j_ok[None, :])

    # comb[t, a, b] = mix[t, 2n + a·n + b]; flat column k = a·NP + b of an [NP·NP] block
    k = tl.arange(0, NP * NP)
    a_k = k // NP
    b_k = k % NP
    k_ok = (a_k < n) & (b_k < n)
    cols = tl.arange(0, BLOCK_M)
    sel = (cols[None, :] == 2 * n + a_k[:, None] * n + b_k[:, None]) & k_ok[:, None]  # [NP*NP, BLOCK_M]
    comb_w = tl.sum(mix[:, None, :] * sel[None, :, :].to(tl.float32), axis=2)  # [BLOCK_T, NP*NP]
    comb_b = tl.load(base_ptr + 2 * n + a_k * n + b_k, mask=k_ok, other=0.0)
    logits = tl.where(k_ok[None, :], comb_w * s_comb + comb_b[None, :], float("-inf"))
    logits = tl.reshape(logits, [BLOCK_T, NP, NP])
    a3 = tl.arange(0, NP)[None, :, None]
    b3 = tl.arange(0, NP)[None, None, :]
    valid = (a3 < n) & (b3 < n)  # [1, NP, NP]
    row_max = tl.max(logits, axis=2)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    e = tl.exp(logits - row_max[:, :, None])
    row_sum = tl.sum(e, axis=2)
    comb = e / tl.where(row_sum == 0.0, 1.0, row_sum)[:, :, None]
    comb = tl.where(valid, comb + hc_eps, 0.0)  # softmax over b, + eps
    comb = _sinkhorn(comb, sinkhorn_iters, hc_eps, BLOCK_T, NP)
    tl.store(comb_ptr + toks[:, None, None].to(tl.int64) * n * n + a3 * n + b3, comb,
             mask=(toks < num_owned)[:, None, None] & valid)

    if NORM:
        _collapse_norm(x_ptr, out_ptr, out32_ptr, norm_w_ptr, pre, toks, num_tokens, n, hidden, norm_eps, BLOCK_T, NP,
                       BLOCK_HD, OUT32)
    else:
        _collapse_chunk(x_ptr, out_ptr, pre, toks, num_tokens, n, hidden, NP, BLOCK_HD)


@triton.jit
def _hc_head_finish_kernel(
    x_ptr,  # [T, n, H] contiguous
    part_ptr,  # [SPLIT, T, BLOCK_M] fp32
    sumsq_ptr,  # [SPLIT, T] fp32
    scale_ptr,  # [1] fp32
    base_ptr,  # [n] fp32
    out_ptr,  # [T, H] x.dtype
    num_tokens,
    num_streams,
    hidden,
    num_splits,
    rms_eps,
    hc_eps,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits summed a step
    BLOCK_HD: tl.constexpr,
    NP: tl.constexpr,
):
    n = num_streams
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mix = _mix_total(part_ptr, sumsq_ptr, toks, num_tokens, num_splits, n * hidden, rms_eps, BLOCK_T, BLOCK_M,
                     BLOCK_S)
    j = tl.arange(0, NP)
    base = tl.load(base_ptr + j, mask=j < n, other=0.0)
    pre = tl.sigmoid(_take(mix, 0, n, BLOCK_M, NP) * tl.load(scale_ptr) + base[None, :]) + hc_eps
    pre = tl.where((j < n)[None, :], pre, 0.0)
    _collapse_chunk(x_ptr, out_ptr, pre, toks, num_tokens, n, hidden, NP, BLOCK_HD)


@triton.jit
def _mhc_post_kernel(
    y_ptr,  # [T, H]
    x_ptr,  # [T, n, H]
    post_ptr,  # [T, n] fp32
    comb_ptr,  # [T, n, n] fp32
    out_ptr,  # [T, n, H] x.dtype
    num_streams,
    hidden,
    stride_yt,
    stride_xt,
    stride_xn,
    stride_pt,
    stride_ct,
    stride_ca,
    NP: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_HD + tl.arange(0, BLOCK_HD)
    i = tl.arange(0, NP)
    n = num_streams
    h_ok = hs < hidden
    i_ok = i < n
    x = tl.load(x_ptr + t * stride_xt + i[:, None] * stride_xn + hs[None, :],
                mask=i_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)  # [NP(i), BLOCK_HD]
    y = tl.load(y_ptr + t * stride_yt + hs, mask=h_ok, other=0.0).to(tl.float32)  # [BLOCK_HD]
    post = tl.load(post_ptr + t * stride_pt + i, mask=i_ok, other=0.0).to(tl.float32)  # [NP(j)]
    comb = tl.load(comb_ptr + t * stride_ct + i[:, None] * stride_ca + i[None, :],
                   mask=i_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)  # [NP(i), NP(j)]
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [NP(j), BLOCK_HD]
    out = post[:, None] * y[None, :] + mixed
    tl.store(out_ptr + t * n * hidden + i[:, None] * hidden + hs[None, :], out.to(out_ptr.dtype.element_ty),
             mask=i_ok[:, None] & h_ok[None, :])


@triton.jit
def _mhc_post_mix_kernel(
    y_ptr,  # [T, H] (row stride stride_yt, unit inner stride)
    x_ptr,  # [T, n, H] contiguous: the streams entering the sublayer
    post_ptr,  # [T, n] fp32 contiguous
    comb_ptr,  # [T, n, n] fp32 contiguous
    fn_ptr,  # [M, n·H] fp32 (row stride stride_fm): the next sublayer's mixes
    out_ptr,  # [T, n, H] x.dtype: the new streams
    part_ptr,  # [SPLIT, T, BLOCK_M] fp32 partial mixes of the rounded new streams (split = H chunk)
    sumsq_ptr,  # [SPLIT, T] fp32 partial Σ of their squares
    num_tokens,
    num_streams,
    hidden,
    num_mix,
    stride_yt,
    stride_fm,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    NP: tl.constexpr,
    DOT: tl.constexpr,  # the mixes by tl.dot (BLOCK_T >= 16), else as a product summed over the chunk
):
    """`_mhc_post_kernel` over a (token block, H chunk) tile, and the next mhc_pre's split-K pass on the streams it
    writes: split s holds columns j·H + s·BLOCK_HD .. of every stream j (the rounded values, as mhc_pre reads them),
    so the finish launch follows with no `_mix_partial_kernel` between. Without DOT a program holds a few tokens
    (one for a decode step) and no padding rows: `tl.dot` needs 16, and at one token its 16-row tile is what the
    launch waits on."""
    split = tl.program_id(1)
    n = num_streams
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens
    t64 = toks.to(tl.int64)
    hs = split * BLOCK_HD + tl.arange(0, BLOCK_HD)
    h_ok = hs < hidden
    i = tl.arange(0, NP)
    i_ok = i < n
    mixes = tl.arange(0, BLOCK_M)
    x = tl.load(x_ptr + t64[:, None, None] * n * hidden + i[None, :, None] * hidden + hs[None, None, :],
                mask=tok_ok[:, None, None] & i_ok[None, :, None] & h_ok[None, None, :],
                other=0.0).to(tl.float32)  # [BLOCK_T, NP(i), BLOCK_HD]
    y = tl.load(y_ptr + t64[:, None] * stride_yt + hs[None, :], mask=tok_ok[:, None] & h_ok[None, :],
                other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_HD]
    acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(NP):  # output stream j
        live = tok_ok & ((toks * 0 + j) < n)  # [BLOCK_T]: stream j exists (a block mask, compiled or interpreted)
        post_j = tl.load(post_ptr + t64 * n + j, mask=live, other=0.0)  # [BLOCK_T]
        comb_j = tl.load(comb_ptr + t64[:, None] * n * n + i[None, :] * n + j,
                         mask=live[:, None] & i_ok[None, :], other=0.0)  # [BLOCK_T, NP(i)]
        s = post_j[:, None] * y + tl.sum(comb_j[:, :, None] * x, axis=1)  # [BLOCK_T, BLOCK_HD]
        s = s.to(out_ptr.dtype.element_ty)
        ok = live[:, None] & h_ok[None, :]
        tl.store(out_ptr + t64[:, None] * n * hidden + j * hidden + hs[None, :], s, mask=ok)
        r = tl.where(ok, s.to(tl.float32), 0.0)
        w = tl.load(fn_ptr + mixes[:, None] * stride_fm + j * hidden + hs[None, :],
                    mask=((mixes < num_mix) & ((mixes * 0 + j) < n))[:, None] & h_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_HD]
        if DOT:
            acc = tl.dot(r, tl.trans(w), acc, input_precision="ieee")
        else:
            acc += tl.sum(r[:, None, :] * w[None, :, :].to(tl.float32), axis=2)
        sumsq += tl.sum(r * r, axis=1)
    row = split.to(tl.int64) * num_tokens + toks
    tl.store(part_ptr + row[:, None] * BLOCK_M + mixes[None, :], acc, mask=tok_ok[:, None])
    tl.store(sumsq_ptr + row, sumsq, mask=tok_ok)


_TILE_MIN_T = 16  # from this many tokens the launches take token tiles (and tl.dot, which needs 16 rows)


def _one_token_programs(T: int) -> bool:
    """Whether the mHC launches run one token per program: a decode step's few tokens (a token tile would be mostly
    padding), and every T in batch-invariant mode (a token's sums then never depend on the others)."""
    return pinned() or T < _TILE_MIN_T


_MIX_TILE = (16, 128)  # (tokens per program, K columns per loop step) of the split-K pass with tl.dot (>= 16 rows)
_MIX_ROWS = (1, 128)  # the same without tl.dot: a decode step's tokens, and batch-invariant mode
_MIX_PROGRAMS = 256  # split-K programs to aim for: ~2 waves of a large GPU


def mix_partial_config(T: int, width: int, interpreted: bool = False) -> tuple[int, int, int, bool]:
    """(tokens per program, K columns per split, K columns per loop step, tl.dot) of `_mix_partial_kernel` for T
    tokens of width K. A decode step's few tokens go one per program without `tl.dot`, as in `post_mix_config` (the
    16-row tile is mostly padding at one token, and is what the launch waits on); from 16 tokens the dot tile. K is
    split so that ~2 waves of programs fill the GPU. Batch-invariant mode takes the one-token programs at every T
    and a split fixed by the width (a token's order of partial sums then never depends on the others)."""
    rows = _one_token_programs(T)
    block_t, block_k = _MIX_ROWS if rows else _MIX_TILE
    block_k = 64 if interpreted else block_k
    programs = 4 if interpreted else _MIX_PROGRAMS  # the interpreter just exercises the split
    token_blocks = 1 if pinned() else triton.cdiv(T, block_t)
    splits = max(1, min(triton.cdiv(width, block_k), triton.cdiv(programs, token_blocks)))
    return block_t, triton.cdiv(triton.cdiv(width, splits), block_k) * block_k, block_k, not rows


def _mixes(x: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Launch the split-K pass -> (partials [SPLIT, T, BLOCK_M], Σx² partials [SPLIT, T], SPLIT, BLOCK_M)."""
    T, n, H = x.shape
    width, num_mix = n * H, fn.shape[0]
    block_t, chunk, block_k, dot = mix_partial_config(T, width, on_interpreter(x))
    block_m = max(next_pow2(num_mix), 16) if dot else next_pow2(num_mix)
    splits = triton.cdiv(width, chunk)
    part = torch.empty((splits, T, block_m), dtype=torch.float32, device=x.device)
    sumsq = torch.empty((splits, T), dtype=torch.float32, device=x.device)
    _mix_partial_kernel[(triton.cdiv(T, block_t), splits)](
        x, fn, part, sumsq, T, num_mix, width, chunk, width, fn.stride(0),
        BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_K=block_k, DOT=dot, num_warps=4,
    )
    return part, sumsq, splits, block_m


_NORM_FINISH_ROWS = (1, 1024, 4)  # (tokens, H columns per loop step, warps) of a decode step's normed finish
_NORM_FINISH_TILE = (8, 256, 4)  # the same from 16 tokens


def norm_finish_config(T: int, H: int, interpreted: bool = False) -> tuple[int, int, int]:
    """(tokens per program, H columns per loop step, warps) of the finish launch with the sublayer's norm (one
    program per token block, over all of H). A decode step's tokens take one program each with wide H steps: at
    one token the 8-token tile left 7/8 of every load and of the Sinkhorn masked, over H / 256 serial steps twice.
    Batch-invariant mode takes the one-token programs at every T (a token's sums then never depend on others)."""
    block_t, block_hd, warps = _NORM_FINISH_ROWS if _one_token_programs(T) else _NORM_FINISH_TILE
    return block_t, min(64 if interpreted else block_hd, max(next_pow2(H), 16)), warps


_FINISH_ROWS = (1, 256)  # (tokens, H columns) per program of a decode step's finish without the norm
_FINISH_TILE = (8, 256)  # the same from 16 tokens


def finish_config(T: int, H: int, interpreted: bool = False) -> tuple[int, int]:
    """(tokens, H columns) per program of the finish launches without the norm (hc_head's, mhc_pre's without
    `norm_weight`; grid token blocks × H chunks). As in `norm_finish_config`, a decode step's tokens take one program
    each (the 8-token tile left 7/8 of every load masked, and one token runs the Sinkhorn on register scalars), and
    batch-invariant mode does at every T."""
    block_t, block_hd = _FINISH_ROWS if _one_token_programs(T) else _FINISH_TILE
    return block_t, min(64 if interpreted else block_hd, max(next_pow2(H), 16))


def _check_mix(name: str, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, num_mix: int) -> None:
    check(x.dim() == 3, f"{name}: x must be [T, n, H], got {tuple(x.shape)}")
    T, n, H = x.shape
    check(tuple(fn.shape) == (num_mix, n * H), f"{name}: fn must be [{num_mix}, {n * H}], got {tuple(fn.shape)}")
    check(base.numel() == num_mix, f"{name}: base must have {num_mix} entries, got {base.numel()}")
    check(same_device(x, fn, base), f"{name}: all tensors must share a device")


def _check_pre(name: str, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
               sinkhorn_iters: int) -> None:
    n = x.shape[1] if x.dim() == 3 else 0
    _check_mix(name, x, fn, base, (2 + n) * n)
    check(scale.numel() == 3, f"{name}: scale must have 3 entries (pre, post, comb), got {scale.numel()}")
    check(sinkhorn_iters >= 1, f"{name}: sinkhorn_iters must be >= 1, got {sinkhorn_iters}")


def _check_post(name: str, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    check(x.dim() == 3, f"{name}: x must be [T, n, H], got {tuple(x.shape)}")
    T, n, H = x.shape
    check(tuple(y.shape) == (T, H), f"{name}: y must be [{T}, {H}], got {tuple(y.shape)}")
    check(tuple(post.shape) == (T, n), f"{name}: post must be [{T}, {n}], got {tuple(post.shape)}")
    check(tuple(comb.shape) == (T, n, n), f"{name}: comb must be [{T}, {n}, {n}], got {tuple(comb.shape)}")
    check(same_device(y, x, post, comb), f"{name}: all tensors must share a device")


@accelerated("mhc_pre", "cuda", "rocm", "xpu")
def mhc_pre(
    x: torch.Tensor,  # [T, n, H]
    fn: torch.Tensor,  # [M, n*H]
    scale: torch.Tensor,  # [3]
    base: torch.Tensor,  # [M]
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,  # [H]
    norm_eps: float | None = None,
    fp32_copy: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Triton twin of `ops.mhc.mhc_pre` -> (layer_input [T, H] x.dtype, post [T, n] fp32, comb [T, n, n] fp32
    [, layer_input in fp32 with `fp32_copy`]); with `norm_weight` the sublayer's RMSNorm in the finish launch (one
    program per token block over all of H: no rms_norm launch after it), which stores the fp32 copy too."""
    _check_pre("mhc_pre", x, fn, scale, base, sinkhorn_iters)
    T, n, H = x.shape
    x = x.contiguous()
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    post = torch.empty((T, n), dtype=torch.float32, device=x.device)
    comb = torch.empty((T, n, n), dtype=torch.float32, device=x.device)
    out32 = torch.empty((T, H), dtype=torch.float32, device=x.device) if fp32_copy else None
    if T > 0:
        part, sumsq, splits, block_m = _mixes(x, fn.float().contiguous())
        _pre_finish(x, part, sumsq, splits, block_m, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm_weight,
                    norm_eps, out, post, comb, out32)
    return (out, post, comb, out32) if fp32_copy else (out, post, comb)


def _pre_finish(x, part, sumsq, splits, block_m, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm_weight,
                norm_eps, out, post, comb, out32=None) -> None:
    """mhc_pre's finish launch over the split-K partials of x (checked, contiguous; T > 0): out, post, comb (and
    out32, the fp32 copy of out, with a norm)."""
    T, n, H = x.shape
    norm = norm_weight is not None
    if norm:
        check(norm_weight.numel() == H and norm_eps is not None,
              f"mhc_pre: norm_weight must have {H} entries and come with norm_eps, got {norm_weight.numel()}")
        norm_weight = norm_weight.contiguous()
    if norm:
        block_t, block_hd, warps = norm_finish_config(T, H, on_interpreter(x))
        grid = (triton.cdiv(T, block_t), 1)
    else:
        block_t, block_hd = finish_config(T, H, on_interpreter(x))
        grid, warps = (triton.cdiv(T, block_t), triton.cdiv(H, block_hd)), 4
    _mhc_pre_finish_kernel[grid](
        x, part, sumsq, scale.float().contiguous(), base.float().contiguous(), out, post, comb,
        norm_weight if norm else out, out32 if out32 is not None else out, T, n, H, splits, float(rms_eps),
        float(hc_eps), int(sinkhorn_iters), float(norm_eps or 0.0), BLOCK_T=block_t, BLOCK_M=block_m,
        BLOCK_S=_sum_block(splits, block_t, block_m), BLOCK_HD=block_hd, NP=next_pow2(n), NORM=norm,
        OUT32=out32 is not None, num_warps=warps,
    )
    if out32 is not None and not norm:  # the chunked collapse has no fp32 store: one copy (no caller does this)
        out32.copy_(out)


@accelerated("hc_head", "cuda", "rocm", "xpu")
def hc_head(
    x: torch.Tensor,  # [T, n, H]
    fn: torch.Tensor,  # [n, n*H]
    scale: torch.Tensor,  # [1]
    base: torch.Tensor,  # [n]
    rms_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    """Triton twin of `ops.mhc.hc_head` -> [T, H] x.dtype."""
    _check_mix("hc_head", x, fn, base, x.shape[1] if x.dim() == 3 else 0)
    check(scale.numel() == 1, f"hc_head: scale must have 1 entry, got {scale.numel()}")
    T, n, H = x.shape
    x = x.contiguous()
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    part, sumsq, splits, block_m = _mixes(x, fn.float().contiguous())
    block_t, block_hd = finish_config(T, H, on_interpreter(x))
    _hc_head_finish_kernel[(triton.cdiv(T, block_t), triton.cdiv(H, block_hd))](
        x, part, sumsq, scale.float().contiguous(), base.float().contiguous(), out,
        T, n, H, splits, float(rms_eps), float(hc_eps),
        BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_S=_sum_block(splits, block_t, block_m), BLOCK_HD=block_hd,
        NP=next_pow2(n), num_warps=4,
    )
    return out


@accelerated("mhc_post", "cuda", "rocm", "xpu")
def mhc_post(
    y: torch.Tensor,  # [T, H]
    x: torch.Tensor,  # [T, n, H]
    post: torch.Tensor,  # [T, n]
    comb: torch.Tensor,  # [T, n, n]
) -> torch.Tensor:
    """Triton twin of `ops.mhc.mhc_post` (fp32 arithmetic, one rounding) -> [T, n, H] x.dtype."""
    _check_post("mhc_post", y, x, post, comb)
    T, n, H = x.shape
    out = torch.empty((T, n, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    y, x, post, comb = (t if t.stride(-1) == 1 else t.contiguous() for t in (y, x, post, comb))
    block_hd = min(64 if on_interpreter(x) else 512, max(next_pow2(H), 16))
    _mhc_post_kernel[(T, triton.cdiv(H, block_hd))](
        y, x, post, comb, out, n, H,
        y.stride(0), x.stride(0), x.stride(1), post.stride(0), comb.stride(0), comb.stride(1),
        NP=next_pow2(n), BLOCK_HD=block_hd, num_warps=4,
    )
    return out


_POST_MIX_BLOCK_T = 16  # tokens per program of the fused post + split-K launch (tl.dot needs >= 16)
_POST_MIX_ROWS_BLOCK_T = 1  # tokens per program without tl.dot
_POST_MIX_ROWS_BLOCK_HD = 64  # H columns per program (and split) without tl.dot


def post_mix_config(T: int, H: int, interpreted: bool = False) -> tuple[int, int, bool]:
    """(tokens per program, H columns per program = per split, tl.dot) of `_mhc_post_mix_kernel` for T tokens. A
    decode step's few tokens go one per program without `tl.dot` (its 16-row tile made the launch several times
    slower at one token); from 16 tokens the dot tile. Batch-invariant mode takes the one-token programs at every
    T: a token's sums then never depend on the others (one path, no padding rows), at the cost of reading the
    mixes' weights once per token."""
    if _one_token_programs(T):
        block_t, block_hd, dot = _POST_MIX_ROWS_BLOCK_T, _POST_MIX_ROWS_BLOCK_HD, False
    else:
        block_t, block_hd, dot = _POST_MIX_BLOCK_T, 64, True
    return block_t, min(32 if interpreted else block_hd, max(next_pow2(H), 16)), dot


@accelerated("mhc_post_pre", "cuda", "rocm", "xpu")
def mhc_post_pre(
    y: torch.Tensor,  # [T, H]
    x: torch.Tensor,  # [T, n, H]
    post: torch.Tensor,  # [T, n]
    comb: torch.Tensor,  # [T, n, n]
    fn: torch.Tensor,  # [M, n*H]
    scale: torch.Tensor,  # [3]
    base: torch.Tensor,  # [M]
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,  # [H]
    norm_eps: float | None = None,
    fp32_copy: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Triton twin of `ops.mhc.mhc_post_pre` in two launches instead of three: the stream update writes the next
    mhc_pre's split-K partials too (one split per H chunk: a count fixed by H; the token tile by `post_mix_config`),
    then
    mhc_pre's finish launch -> (streams [T, n, H] x.dtype, layer_input [T, H], post [T, n], comb [T, n, n]
    [, layer_input in fp32 with `fp32_copy`])."""
    _check_post("mhc_post_pre", y, x, post, comb)
    _check_pre("mhc_post_pre", x, fn, scale, base, sinkhorn_iters)
    T, n, H = x.shape
    streams = torch.empty((T, n, H), dtype=x.dtype, device=x.device)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    post_next = torch.empty((T, n), dtype=torch.float32, device=x.device)
    comb_next = torch.empty((T, n, n), dtype=torch.float32, device=x.device)
    out32 = torch.empty((T, H), dtype=torch.float32, device=x.device) if fp32_copy else None
    if T == 0:
        return (streams, out, post_next, comb_next) + ((out32,) if fp32_copy else ())
    y = y if y.stride(-1) == 1 else y.contiguous()
    x, post, comb = x.contiguous(), post.float().contiguous(), comb.float().contiguous()
    fn = fn.float()
    fn = fn if fn.stride(-1) == 1 else fn.contiguous()
    num_mix = fn.shape[0]
    block_m = max(next_pow2(num_mix), 16)
    block_t, block_hd, dot = post_mix_config(T, H, on_interpreter(x))
    splits = triton.cdiv(H, block_hd)
    part = torch.empty((splits, T, block_m), dtype=torch.float32, device=x.device)
    sumsq = torch.empty((splits, T), dtype=torch.float32, device=x.device)
    _mhc_post_mix_kernel[(triton.cdiv(T, block_t), splits)](
        y, x, post, comb, fn, streams, part, sumsq, T, n, H, num_mix, y.stride(0), fn.stride(0),
        BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_HD=block_hd, NP=next_pow2(n), DOT=dot, num_warps=4,
    )
    _pre_finish(streams, part, sumsq, splits, block_m, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm_weight,
                norm_eps, out, post_next, comb_next, out32)
    return (streams, out, post_next, comb_next) + ((out32,) if fp32_copy else ())
