"""Triton GEMMs on weights kept in their checkpoint formats, dequantised tile by tile in registers.

Legend: M rows of x (tokens), N output features, K input features, R rows of a weight matrix.
* FP8: W [N, K] float8_e4m3fn, one fp32 scale per 128×128 block, scales [ceil(N/128), ceil(K/128)].
* FP4: W [R, K/2] uint8, two e2m1 codes a byte (low nibble = even column), one e8m0 exponent byte per 1×32
  block, scales [R, ceil(K/32)] (value 2^(byte - 127)).
FP8 linear: the e4m3 codes are cast to x's dtype (exact in bf16 / fp16 / fp32) and multiplied by x in `tl.dot`
(16-bit operands on a GPU: the tensor cores' exact products, fp32 accumulation; fp32 operands with exact
products for fp32 x and on the interpreter, whose 16-bit dots are wrong); each 128-column block's partial sum
is then scaled by its block scale, so against dequantise-then-matmul only the summation order (and, for a
scale that is not a power of two, one rounding of the product) differs. Few rows: split over K (whole scale
blocks per program, one reduction launch) so that enough programs stream W. FP4: tiles dequantised to fp32
(`fp4_tile` / `weight_tile` / `dot_t`, shared with the FP4 grouped MoE GEMM in `triton_kernels.moe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkspec.ops.triton_kernels.common import check, on_interpreter, same_device

FP8_BLOCK = 128  # ops.formats.FP8_BLOCK
SCALE_BLOCK = tl.constexpr(FP8_BLOCK)  # the same inside kernels (they may read only constexpr globals)


@triton.jit
def e2m1_value(code):
    """e2m1 codes (int32, 0..15: sign, 2 exponent bits, 1 mantissa bit) -> fp32 values, exactly: 0, ±0.5 for
    exponent 0, else ±(1 + m/2)·2^(e-1) built from its bits."""
    e = (code >> 1) & 3
    m = code & 1
    normal = ((e + 126) << 23 | m << 22).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, 0.5 * m.to(tl.float32), normal)
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def e8m0_value(byte):
    """e8m0 exponent bytes (int32) -> 2^(byte - 127) fp32 from its bits (byte 0, 2^-127, reads as 0)."""
    return (byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp4_tile(
    w_ptr,  # [R, K/2] uint8 packed e2m1
    s_ptr,  # [R, ceil(K/32)] uint8 e8m0
    rows,  # [BLOCK_N] int64 rows of W
    row_ok,  # [BLOCK_N] bool
    k0,  # first column of the tile (even)
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Columns k0 .. k0 + BLOCK_K of `rows`, dequantised -> [BLOCK_N, BLOCK_K] fp32 (0 outside W)."""
    js = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K/2] bytes: columns 2j (low nibble) and 2j + 1
    ok = row_ok[:, None] & (js[None, :] < K // 2)
    b = tl.load(w_ptr + rows[:, None] * (K // 2) + js[None, :], mask=ok, other=0).to(tl.int32)
    s = tl.load(s_ptr + rows[:, None] * ((K + 31) // 32) + (2 * js[None, :]) // 32, mask=ok, other=0)
    scale = e8m0_value(s.to(tl.int32))  # both columns of a byte share a 32-block
    return tl.interleave(e2m1_value(b & 15) * scale, e2m1_value(b >> 4) * scale)


@triton.jit
def dot_t(a, w, acc, IEEE: tl.constexpr):
    """acc + a · wᵀ (a [M, K], w [N, K]): exact fp32 products when IEEE, else the default dot (tf32 on fp32
    operands, the operands' own precision on 16-bit ones)."""
    if IEEE:
        return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def weight_tile(
    w_ptr,  # [R, K] (plain) or [R, K/2] uint8 (FP4)
    s_ptr,  # FP4: [R, ceil(K/32)] uint8; plain: unused
    rows,  # [BLOCK_N] int64
    row_ok,  # [BLOCK_N] bool
    k0,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP4: tl.constexpr,
):
    """A [BLOCK_N, BLOCK_K] fp32 tile of a plain or FP4 weight."""
    if FP4:
        return fp4_tile(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K)
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K),
                   other=0.0).to(tl.float32)


@triton.jit
def _fp8_linear_kernel(
    x_ptr,  # [M, K] (row stride stride_xm)
    w_ptr,  # [N, K] float8_e4m3fn contiguous
    s_ptr,  # [ceil(N/128), ceil(K/128)] fp32 contiguous
    out_ptr,  # SPLIT == 1: y [M, N] (x.dtype); else partial sums [SPLIT, M, N] fp32
    M,
    stride_xm,
    N: tl.constexpr,  # N, K constexpr: fixed per layer (Triton 3.6's interpreter breaks on range(arg))
    K: tl.constexpr,
    KB_PER_SPLIT: tl.constexpr,  # 128-column scale blocks each program sums (program_id(1) picks its share)
    DOT16: tl.constexpr,  # the weight tile cast to x's 16-bit dtype (exact), 16-bit dots; else fp32 operands
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products
    SWAP: tl.constexpr,  # acc [BLOCK_N, BLOCK_M] = W·xᵀ: the weight tile fills the MMA's M side (few rows)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides 128: a K tile lies in one scale block
):
    """y[rows, cols] (or this split's partial sum) = Σ_kb scale[n-block, kb] · (x · W_codesᵀ)[over the 128
    columns of kb]: the codes are exact in bf16 / fp16 / fp32, so each block's partial sum is the oracle's up to
    summation order, and the scale multiplies [BLOCK_N] partial sums once per 128-column block instead of every
    weight element (exact for power-of-two scales, one fp32 rounding otherwise)."""
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok, col_ok = rows < M, cols < N
    num_kb = (K + SCALE_BLOCK - 1) // SCALE_BLOCK
    w_rows = w_ptr + cols.to(tl.int64) * K  # [BLOCK_N] row starts of W
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm  # [BLOCK_M]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(0, KB_PER_SPLIT):
        kb = tl.program_id(1) * KB_PER_SPLIT + i  # past num_kb (the last split's tail): all loads masked off
        part = tl.zeros_like(acc)
        for j in tl.static_range(0, SCALE_BLOCK // BLOCK_K):
            ks = kb * SCALE_BLOCK + j * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_ok = ks < K
            w = tl.load(w_rows[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT16:  # e4m3 -> bf16 / fp16 by the hardware cast: exact (4 significant bits, a narrow exponent)
                w = w.to(x_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_K]
            else:
                w = w.to(tl.float32)
            if SWAP:
                xt = tl.load(x_rows[None, :] + ks[:, None], mask=row_ok[None, :] & k_ok[:, None], other=0.0)
                if not DOT16:
                    xt = xt.to(tl.float32)  # [BLOCK_K, BLOCK_M]
                if IEEE:
                    part = tl.dot(w, xt, part, input_precision="ieee")
                else:
                    part = tl.dot(w, xt, part)
            else:
                xt = tl.load(x_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                if not DOT16:
                    xt = xt.to(tl.float32)  # [BLOCK_M, BLOCK_K]
                part = dot_t(xt, w, part, IEEE)
        # [BLOCK_N]; past the last block `part` is 0 and any finite scale will do
        s = tl.load(s_ptr + (cols // SCALE_BLOCK) * num_kb + tl.minimum(kb, num_kb - 1), mask=col_ok, other=0.0)
        if SWAP:
            acc += part * s[:, None]
        else:
            acc += part * s[None, :]
    out = out_ptr + tl.program_id(1).to(tl.int64) * M * N  # this split's [M, N] slab (the only one when SPLIT=1)
    if SWAP:
        tl.store(out + rows[None, :].to(tl.int64) * N + cols[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[None, :] & col_ok[:, None])
    else:
        tl.store(out + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(
    part_ptr,  # [SPLIT, MN] fp32
    y_ptr,  # [MN] (x.dtype)
    MN,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y = Σ_s part[s] in split order (deterministic, unlike atomics), cast to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(0, SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class GemmConfig:
    """Tile of the FP8 linear. split_k: programs along K (each sums whole 128-column blocks; partial sums then go
    through one reduction launch), 0 = enough to give about `CTAS_PER_SM` programs per SM. swap: compute
    W·xᵀ (for few rows: the N side fills the MMA's wide side, x's rows its narrow one)."""

    block_m: int = 16  # tl.dot needs >= 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0
    swap: bool = False


CTAS_PER_SM = 2  # programs per SM the automatic split aims at (bandwidth-bound decode: bytes in flight)
_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessors of `device` (cached; 132 on the interpreter, an H100 / H200's count)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def fp8_config(num_rows: int, interpreter: bool) -> GemmConfig:
    """First choices until an H200 sweep picks them (no autotune: see the package
    docstring): up to 64 rows W is read once with row blocks as tall as M and split over K so that enough
    programs stream it; more rows take 64 x 128 tiles."""
    if interpreter:
        return GemmConfig(16, 16, 32, 4, 1, split_k=0, swap=num_rows <= 16)
    if num_rows <= 16:
        return GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True)
    if num_rows <= 64:
        return GemmConfig(block_m=triton.next_power_of_2(num_rows), block_n=64, block_k=128, num_warps=4,
                          num_stages=4)
    return GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)


def num_splits(cfg: GemmConfig, M: int, N: int, K: int, device: torch.device) -> tuple[int, int]:
    """-> (programs along K, 128-column blocks each): cfg.split_k, or the automatic count, capped at the number
    of scale blocks and trimmed so that no program gets an empty share."""
    num_kb = triton.cdiv(K, FP8_BLOCK)
    split = cfg.split_k
    if split <= 0:
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        split = max(1, (CTAS_PER_SM * num_sms(device)) // tiles)
    per = triton.cdiv(num_kb, min(split, num_kb))
    return triton.cdiv(num_kb, per), per


def fp8_block_linear_triton(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N/128), ceil(K/128)] fp32
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `ops.quant.fp8_block_linear` -> [..., N] (x.dtype). One launch, or two with split-K (the
    count fixed by the shapes: graph-capturable, no host sync)."""
    check(weight.dim() == 2 and weight.dtype == torch.float8_e4m3fn,
          f"fp8_block_linear: weight must be [N, K] float8_e4m3fn, got {tuple(weight.shape)} {weight.dtype}")
    N, K = weight.shape
    need = (triton.cdiv(N, FP8_BLOCK), triton.cdiv(K, FP8_BLOCK))
    check(tuple(scale.shape) == need and scale.dtype == torch.float32,
          f"fp8_block_linear: scale must be {need} fp32, got {tuple(scale.shape)} {scale.dtype}")
    check(x.shape[-1] == K, f"fp8_block_linear: x has {x.shape[-1]} features, weight {K}")
    check(x.dtype in (torch.bfloat16, torch.float16, torch.float32),
          f"fp8_block_linear: x must be bf16 / fp16 / fp32, got {x.dtype}")
    check(same_device(x, weight, scale), "fp8_block_linear: x, weight and scale must share a device")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y.view(*lead, N)
    interpreter = on_interpreter(x)
    cfg = config or fp8_config(M, interpreter)
    check(FP8_BLOCK % cfg.block_k == 0, f"fp8_block_linear: block_k {cfg.block_k} must divide {FP8_BLOCK}")
    check(cfg.block_m >= 16 and cfg.block_n >= 16, f"fp8_block_linear: tl.dot needs tiles >= 16, got {cfg}")
    split, per = num_splits(cfg, M, N, K, x.device)
    # the interpreter's bf16 / fp16 dots are wrong: fp32 operands there (the codes and x are exact in fp32)
    dot16 = x.dtype != torch.float32 and not interpreter
    out = y if split == 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, cfg.block_n), split, triton.cdiv(M, cfg.block_m))
    _fp8_linear_kernel[grid](
        x2, weight.contiguous(), scale.contiguous(), out, M, x2.stride(0), N=N, K=K, KB_PER_SPLIT=per,
        DOT16=dot16, IEEE=not dot16, SWAP=cfg.swap, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](out, y, M * N, SPLIT=split, BLOCK=block, num_warps=4)
    return y.view(*lead, N)
