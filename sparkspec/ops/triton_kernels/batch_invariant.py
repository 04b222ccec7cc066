"""A batch-invariant (batched) GEMM: c[b] = a[b] · bm[b] (+ bias), one fixed tile and K split for every row count.

Legend: B batch of matrices (1 for mm / linear), M rows (tokens), N output columns, K the reduced dim, S the K
chunks.

Why: cuBLAS picks its algorithm, tile and split-K by the shapes, M included, so the order in which one row's K
products are summed (and thus its rounding) changes with how many rows the step has: a request's greedy tokens
then depend on the batch it ran in. Here the arithmetic of a row is fixed by (N, K) alone (`invariant_tile`):
BLOCK_M, BLOCK_N and the warps are constants, BLOCK_K and the K chunk (CHUNK_K, a multiple of BLOCK_K; S =
cdiv(K, CHUNK_K) chunks) follow the weight's N, K and dtype. Row m's result is

    c[m] = round(((0 + p_0[m]) + p_1[m]) + ... + p_{S-1}[m] (+ bias)),  p_s[m] = Σ over chunk s's K tiles in
                                                                              increasing k0 of one `tl.dot` each,

each dot by the same instruction sequence whatever M is and wherever m sits in its block (rows of a dot never
mix). Only the schedule depends on M, and it does not change those sums:

* fused (enough output tiles to fill the GPU): one program per output tile computes p_0, p_1, ... in turn and
  adds them in registers;
* split (few output tiles, e.g. one token: N / BLOCK_N programs alone would leave most SMs idle): one program
  per (tile, chunk) writes p_s to an fp32 workspace and bumps the tile's counter; the program that arrives last
  adds the S partials in chunk order (never in arrival order), writes c and resets the counter to 0 for the next
  launch (CUDA-graph replay safe). One launch, no fp32 atomics on the output.

fp32 accumulation; 16-bit operands go to tensor-core dots (exact products); fp32 operands on NVIDIA to
tensor-core `tf32x3` dots (each operand split into a high and a low tf32 part, three MMAs: products to about
2^-22 relative instead of fp32's 2^-24), elsewhere to exact (`ieee`) CUDA-core dots, which on the H200 took 3.4-11x
cuBLAS's time at Flash's compressor and router shapes (`ops/triton_kernels/NOTES.md`). The output is rounded
once to the inputs' dtype. Each is one instruction sequence per row whatever M is. In the interpreter (CPU
tests) a dot is an fp32 broadcast product summed with tl.sum: its tl.dot (numpy's BLAS) rounds a row
differently by its place in the tile, which the GPU's MMA instructions do not, and its 16-bit dots are wrong.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sparkspec.ops.triton_kernels.common import check, on_interpreter, same_device

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TARGET_PROGRAMS = 264  # output tiles below which a launch with K chunks splits them over programs (2 per SM)
GPU_PROGRAMS = 128  # (tile, chunk) programs a K split aims at (about one per SM of an H100 / H200)
SPLIT_MIN_K = 2048  # K up to which one program sums all of K (no split: measured faster at every M on the H200)
_INTERP_TARGET = 8  # the interpreter's (tests): small shapes already split
_COUNTER_SLOTS = 1024  # tile counters per device; a split launch has fewer than TARGET_PROGRAMS output tiles
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # device -> [_COUNTER_SLOTS] int32, all 0 between launches


@triton.jit
def _bi_matmul_kernel(
    a_ptr,  # [B, M, K] any strides
    b_ptr,  # [B, K, N] any strides (a linear's weight [N, K] passed transposed)
    bias_ptr,  # [N] (unused without HAS_BIAS)
    c_ptr,  # [B, M, N] contiguous
    ws_ptr,  # [B, S, M, N] fp32 partials (SPLIT only)
    count_ptr,  # [>= B · m blocks · n blocks] int32 arrivals per output tile, 0 on entry and exit (SPLIT only)
    M,
    N,
    K,
    CHUNK_K,  # K per chunk, a multiple of BLOCK_K
    NUM_CHUNKS,  # S = cdiv(K, CHUNK_K)
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,  # "half": 16-bit operands into tl.dot; "tf32x3" / "ieee": fp32 ones (three tf32 MMAs /
    # exact CUDA-core products); "sum": products
    # summed by tl.sum (the interpreter, whose tl.dot is numpy's BLAS: its sums depend on a row's place in the tile)
    SPLIT: tl.constexpr,  # program_id(2) = batch · S + chunk, one chunk per program; else all chunks, one program
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # M fastest: the row blocks of one weight tile run together and share it through L2
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if SPLIT:
        batch, first = tl.program_id(2) // NUM_CHUNKS, tl.program_id(2) % NUM_CHUNKS
        last = first + 1
    else:
        batch, first, last = tl.program_id(2), 0, NUM_CHUNKS
    batch = batch.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok, col_ok = rows < M, cols < N
    out_ok = row_ok[:, None] & col_ok[None, :]
    a_rows = a_ptr + batch * stride_ab + rows.to(tl.int64) * stride_am  # [BLOCK_M]
    b_cols = b_ptr + batch * stride_bb + cols * stride_bn  # [BLOCK_N]
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for chunk in range(first, last):  # chunks in increasing order, K tiles in increasing k0 inside each
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(chunk * CHUNK_K, tl.minimum(chunk * CHUNK_K + CHUNK_K, K), BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_rows[:, None] + ks[None, :].to(tl.int64) * stride_ak, mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            b = tl.load(b_cols[None, :] + ks[:, None].to(tl.int64) * stride_bk, mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)  # [BLOCK_K, BLOCK_N]
            if DOT == "half":
                acc = tl.dot(a, b, acc)
            elif DOT == "tf32x3":
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")
            elif DOT == "ieee":
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:  # "sum"
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        total += acc
    c = c_ptr + batch * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    if SPLIT:
        plane = rows[:, None].to(tl.int64) * N + cols[None, :]  # [BLOCK_M, BLOCK_N] offsets in one [M, N] partial
        tl.store(ws_ptr + (batch * NUM_CHUNKS + first) * M * N + plane, total, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is written before the (one-thread) release below
        tile = (batch * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_m
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_CHUNKS - 1:  # the tile's last chunk: all partials are visible (acquire)
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, NUM_CHUNKS):  # chunk order: the fused schedule's sum, bit for bit
                total += tl.load(ws_ptr + (batch * NUM_CHUNKS + s) * M * N + plane, mask=out_ok, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(c, total.to(c_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch (or graph replay)
    else:
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c, total.to(c_ptr.dtype.element_ty), mask=out_ok)


class Tile(NamedTuple):
    """The launch constants of one weight shape: everything a row's arithmetic depends on."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    chunk_k: int  # K per chunk, a multiple of block_k


@functools.cache
def invariant_tile(N: int, K: int, interpreter: bool, itemsize: int = 2) -> Tile:
    """The tile and K chunk of an [N, K] weight of `itemsize`-byte elements: never a function of M (that is the
    point). On the GPU: 16-row tiles (a decode step's few rows fill them; prefill re-reads a weight tile per 16
    rows, from L2) by 32 columns, the whole K of a 16-bit weight in one program up to K = SPLIT_MIN_K; longer K
    (and any fp32 K) is cut into chunks so that one row block still has about GPU_PROGRAMS (tile, chunk)
    programs. Measured on the H200 at bench-1b's shapes (`ops/triton_kernels/NOTES.md`): this tile with one chunk
    ran 2.5-5.1 us at M = 1..64, faster than cuBLAS there, where the earlier 64-row tile split over ~264 programs
    took 4.7-10 us (its split's fp32 workspace round trip and counter cost more than the split gained). fp32
    operands (twice the bytes of a K step, `dot_mode`'s tf32x3 or ieee dots) take 64-deep K steps and always
    split."""
    if interpreter:
        bm, bn, bk, warps, stages, target, min_k = 16, 32, 32, 4, 1, _INTERP_TARGET, 0
    else:
        bk = 64 if itemsize > 2 else 256 if K % 256 == 0 else 128
        bm, bn, warps, stages, target, min_k = 16, 32, 4, 3, GPU_PROGRAMS, 0 if itemsize > 2 else SPLIT_MIN_K
    k_tiles = triton.cdiv(max(K, 1), bk)
    splits = 1 if K <= min_k else max(1, min(k_tiles, triton.cdiv(target, triton.cdiv(N, bn))))
    return Tile(bm, bn, bk, warps, stages, triton.cdiv(k_tiles, splits) * bk)


def dot_mode(a: torch.Tensor) -> str:
    """The kernel's DOT for operands like `a`: "sum" in the interpreter, "half" for 16-bit, fp32 "tf32x3" on
    NVIDIA (Triton's 3-pass tf32 on tensor cores) and "ieee" on other GPUs."""
    if on_interpreter(a):
        return "sum"
    if a.dtype != torch.float32:
        return "half"
    return "tf32x3" if a.device.type == "cuda" and torch.version.hip is None else "ieee"


def _counters(device: torch.device) -> torch.Tensor | None:
    """The device's tile counters; None while a CUDA graph is being captured before they exist (an allocation
    there would belong to the graph's pool): that launch takes the fused schedule, the same bits."""
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[device] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def matmul_invariant(
    a: torch.Tensor,  # [M, K] or [B, M, K]
    b: torch.Tensor,  # [K, N] or [B, K, N] (for a linear: weight.t())
    bias: torch.Tensor | None = None,  # [N]
    split: bool | None = None,  # force the schedule (tests, benchmarks); None: split when the tiles are few
    tile: Tile | None = None,  # another tile than `invariant_tile`'s (sweeps; its rows are invariant too)
) -> torch.Tensor:
    """-> a · b (+ bias) [M, N] / [B, M, N] in a.dtype, with fp32 accumulation and a reduction order per row that
    does not depend on M (module docstring). Split launches share the device's counters: one GEMM at a time per
    device (the engine's streams run one after another)."""
    check(a.dim() == b.dim() and a.dim() in (2, 3), f"matmul_invariant: want a [M, K] and b [K, N] (or batched "
          f"[B, M, K], [B, K, N]), got {tuple(a.shape)} and {tuple(b.shape)}")
    check(a.shape[-1] == b.shape[-2] and (a.dim() == 2 or a.shape[0] == b.shape[0]),
          f"matmul_invariant: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    check(a.dtype == b.dtype and a.dtype in SUPPORTED_DTYPES,
          f"matmul_invariant: a and b must share a dtype in {SUPPORTED_DTYPES}, got {a.dtype} and {b.dtype}")
    check(same_device(a, b) and (bias is None or same_device(a, bias)), "matmul_invariant: one device for all")
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    (B, M, K), N = a3.shape, b3.shape[2]
    check(bias is None or (bias.dim() == 1 and bias.shape[0] == N),
          f"matmul_invariant: bias must be [{N}], got {None if bias is None else tuple(bias.shape)}")
    c = torch.empty(B, M, N, dtype=a.dtype, device=a.device)
    if c.numel() == 0 or K == 0:
        c = c.zero_() if K == 0 else c
        if K == 0 and bias is not None:
            c += bias.to(c.dtype)
        return c if batched else c[0]
    interp = on_interpreter(a)
    tile = tile or invariant_tile(N, K, interp, a.element_size())
    check(tile.chunk_k > 0 and tile.chunk_k % tile.block_k == 0,
          f"matmul_invariant: chunk_k must be a positive multiple of block_k, got {tile}")
    num_chunks = triton.cdiv(K, tile.chunk_k)
    tiles = triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n) * B
    if split is None:
        split = num_chunks > 1 and tiles < (_INTERP_TARGET if interp else TARGET_PROGRAMS)
    counters = _counters(a.device) if split and tiles <= _COUNTER_SLOTS else None
    split = counters is not None
    ws = torch.empty(B, num_chunks, M, N, dtype=torch.float32, device=a.device) if split else c
    grid = (triton.cdiv(M, tile.block_m), triton.cdiv(N, tile.block_n), B * num_chunks if split else B)
    _bi_matmul_kernel[grid](
        a3, b3, bias if bias is not None else c, c, ws, counters if split else c, M, N, K, tile.chunk_k, num_chunks,
        a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
        HAS_BIAS=bias is not None, DOT=dot_mode(a), SPLIT=split,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return c if batched else c[0]
