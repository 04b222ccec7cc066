"""Triton GEMMs on weights kept in their checkpoint formats, dequantised tile by tile in registers.

Legend: M rows of x (tokens), N output features, K input features, R rows of a weight matrix.
* FP8: W [N, K] float8_e4m3fn, one fp32 scale per 128×128 block, scales [ceil(N/128), ceil(K/128)].
* FP4: W [R, K/2] uint8, two e2m1 codes a byte (low nibble = even column), one e8m0 exponent byte per 1×32
  block, scales [R, ceil(K/32)] (value 2^(byte - 127)).
Activations stay in their dtype (bf16 or fp32) and every tile is upcast to fp32 before `tl.dot` (fp32
accumulation): a dequantised value is exact in bf16 and tf32, so against dequantise-then-matmul only the
summation order differs. `fp4_tile` / `weight_tile` are shared with the FP4 grouped MoE GEMM
(`triton_kernels.moe`).
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
    y_ptr,  # [M, N] (x.dtype) contiguous
    M,
    stride_xm,
    N: tl.constexpr,  # N, K constexpr: fixed per layer (Triton 3.6's interpreter breaks on range(arg))
    K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides 128: a K tile lies in one scale block
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    num_kb = (K + SCALE_BLOCK - 1) // SCALE_BLOCK
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        s = tl.load(s_ptr + (cols // SCALE_BLOCK) * num_kb + k0 // SCALE_BLOCK, mask=col_ok, other=0.0)  # [BLOCK_N]
        acc = dot_t(xt, w * s[:, None], acc, IEEE)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16  # tl.dot needs >= 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def fp8_config(num_rows: int, interpreter: bool) -> GemmConfig:
    """Untuned first choices (no autotune: see the package docstring): decode-sized M reads W once with
    narrow row blocks; larger M takes wider ones."""
    if interpreter:
        return GemmConfig(16, 16, 32, 4, 1)
    if num_rows <= 32:
        return GemmConfig(block_m=16, block_n=64, block_k=128)
    return GemmConfig(block_m=64, block_n=64, block_k=64)


def fp8_block_linear_triton(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N/128), ceil(K/128)] fp32
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `ops.quant.fp8_block_linear` -> [..., N] (x.dtype)."""
    check(weight.dim() == 2 and weight.dtype == torch.float8_e4m3fn,
          f"fp8_block_linear: weight must be [N, K] float8_e4m3fn, got {tuple(weight.shape)} {weight.dtype}")
    N, K = weight.shape
    need = (triton.cdiv(N, FP8_BLOCK), triton.cdiv(K, FP8_BLOCK))
    check(tuple(scale.shape) == need and scale.dtype == torch.float32,
          f"fp8_block_linear: scale must be {need} fp32, got {tuple(scale.shape)} {scale.dtype}")
    check(x.shape[-1] == K, f"fp8_block_linear: x has {x.shape[-1]} features, weight {K}")
    check(same_device(x, weight, scale), "fp8_block_linear: x, weight and scale must share a device")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y.view(*lead, N)
    cfg = config or fp8_config(M, on_interpreter(x))
    check(FP8_BLOCK % cfg.block_k == 0, f"fp8_block_linear: block_k {cfg.block_k} must divide {FP8_BLOCK}")
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n))
    _fp8_linear_kernel[grid](
        x2, weight.contiguous(), scale.contiguous(), y, M, x2.stride(0), N=N, K=K,
        IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(*lead, N)
