"""Linear layers on FP8 weights kept in their checkpoint format (one fp32 scale per 128×128 block).

Legend: M rows of x (tokens), N output features, K input features.

`fp8_block_linear(x, weight, scale)` = x · dequant(weight)ᵀ. The native version dequantises and multiplies in
fp32 (the oracle). On accelerators:
* CUDA, at SCALED_MM_MIN_ROWS rows or more (prefill), with a torch whose `F.scaled_mm` takes the DeepSeek
  recipe (activations 1×128 blocks, weights 128×128 blocks, fp32 scales; cuBLAS on sm90 / sm100): x is quantised
  to e4m3 per 1×128 block with power-of-two scales, as the official inference does before every FP8 GEMM, and
  the GEMM runs on FP8 tensor cores. This rounds the activations (about 2^-4 relative per element), so it is
  close to the oracle, not equal. Set
  SPARKSPEC_FP8_ACTIVATIONS=0 to use the Triton kernel instead. The layout is checked once per device on a
  small probe against the oracle; a build or GPU that gets it wrong uses the Triton kernel.
* otherwise the Triton kernel (`triton_kernels.quant`): activations as they are, weight tiles dequantised in
  registers, fp32 accumulation (the oracle up to summation order).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from sparkspec.ops.formats import FP8_BLOCK, dequant_fp8_block, fp8_scale_shape
from sparkspec.ops.registry import accelerated, native

log = logging.getLogger("sparkspec.ops")


@native("fp8_block_linear")
def fp8_block_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N/128), ceil(K/128)] fp32 (or e8m0)
) -> torch.Tensor:
    """x · (weight · scale[block])ᵀ -> [..., N] in x.dtype; products and sums in fp32."""
    return F.linear(x.float(), dequant_fp8_block(weight, scale)).to(x.dtype)


@accelerated("fp8_block_linear", "cuda", "rocm", "xpu")
def fp8_block_linear_accelerated(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N/128), ceil(K/128)] fp32
) -> torch.Tensor:
    """cuBLAS block-scaled FP8 GEMM where `scaled_mm_usable`, else the Triton kernel; the native for CPU
    tensors, under autograd or without triton."""
    if x.device.type == "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return fp8_block_linear(x, weight, scale)
    if tuple(scale.shape) != fp8_scale_shape(weight.shape):  # e.g. a weight sliced without its scales
        raise ValueError(f"fp8_block_linear: scale {tuple(scale.shape)} does not fit weight {tuple(weight.shape)}, "
                         f"expected {fp8_scale_shape(weight.shape)}")
    if scaled_mm_usable(x, weight):
        return fp8_block_linear_scaled_mm(x, weight, scale)
    try:
        from sparkspec.ops.triton_kernels.quant import fp8_block_linear_triton
    except ImportError:
        return fp8_block_linear(x, weight, scale)
    return fp8_block_linear_triton(x, weight, scale)


# ---------------------------------------------------------------- cuBLAS block-scaled FP8


def quantize_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 [M, K], fp32 scales [M, K/128]): each 1×128 block divided by the
    power of two 2^ceil(log2(amax / 448)) (amax floored at 1e-4), the official activation recipe."""
    M, K = x.shape
    blocks = x.float().view(M, K // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=1e-4)  # [M, K/128]
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return (blocks / scale.unsqueeze(-1)).view(M, K).to(torch.float8_e4m3fn), scale


def fp8_block_linear_scaled_mm(
    x: torch.Tensor,  # [..., K], K a multiple of 128
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N/128, K/128] fp32
) -> torch.Tensor:
    """x quantised per 1×128 block, then `F.scaled_mm` with BlockWise1x128 × BlockWise128x128 fp32 scales
    -> [..., N] (x.dtype). cuBLAS wants the activation scales outer-dim-major, the weight column-major (its
    transpose view), the row count a multiple of 4 and the number of K blocks of the weight scales a multiple
    of 4 (zero-padded here)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M % 4:
        x2 = F.pad(x2, (0, 0, 0, 4 - M % 4))
    xq, xs = quantize_act_1x128(x2)
    kb = scale.shape[1]
    ws = F.pad(scale, (0, -kb % 4)) if kb % 4 else scale
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    y = F.scaled_mm(xq, weight.t(), xs.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                    ws.t(), F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return y[:M].to(x.dtype).view(*lead, weight.shape[0])


def scaled_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The block-scaled cuBLAS path runs here: CUDA sm90/sm100, a torch with the DeepSeek recipe in
    `F.scaled_mm`, N and K multiples of 128, not switched off, and the once-per-device probe passed."""
    N, K = weight.shape
    if x.device.type != "cuda" or torch.version.cuda is None or N % FP8_BLOCK or K % FP8_BLOCK:
        return False
    if x.numel() // K < SCALED_MM_MIN_ROWS:
        return False
    if os.environ.get("SPARKSPEC_FP8_ACTIVATIONS", "1") == "0":
        return False
    if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise128x128"):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] not in (9, 10):
        return False
    if index not in _PROBED:
        if torch.cuda.is_current_stream_capturing():  # no probe inside a graph capture (it reads results)
            return False
        _PROBED[index] = _scaled_mm_probe(index)
    return _PROBED[index]


_PROBED: dict[int, bool] = {}  # device index -> the probe passed
# Below this many rows the Triton kernel is faster (H200, torch 2.11 + CUDA 13, a one-off timing run whose script
# is not in the repository: 0.07 ms against 0.27 ms at M = 1 on 1024 x 4096; 0.26 ms against 0.19 ms at M = 2048),
# and it is also exact on x.
SCALED_MM_MIN_ROWS = 1024


def _scaled_mm_probe(index: int) -> bool:
    """One small block-scaled GEMM with distinct scales per block against the oracle. Activations that are
    exact in e4m3 with power-of-two block scales make the FP8 path exact up to summation order, so a wrong
    scale layout (transposed, misaligned blocks) shows as a large error."""
    device = torch.device("cuda", index)
    g = torch.Generator().manual_seed(0)
    N, K, M = 256, 384, 8
    weight = (torch.randn(N, K, generator=g) * 8).to(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-4, 4, (N // FP8_BLOCK, K // FP8_BLOCK), generator=g).float())
    x = (torch.randn(M, K, generator=g) * 4).to(torch.float8_e4m3fn).float()
    x = x * torch.exp2(torch.randint(-3, 3, (M, K // FP8_BLOCK), generator=g).float()).repeat_interleave(128, 1)
    try:
        weight, scale, x = weight.to(device), scale.to(device), x.to(device)
        got = fp8_block_linear_scaled_mm(x, weight, scale)
        want = fp8_block_linear(x, weight, scale)
        err = float((got - want).abs().max() / want.abs().max())
    except (RuntimeError, TypeError, ValueError, AttributeError) as e:  # cuBLAS / an unsupported build
        log.warning("block-scaled FP8 GEMM (F.scaled_mm) unusable on cuda:%d, using the Triton kernel: %s: %s",
                    index, type(e).__name__, e)
        return False
    if err > 1e-3:
        log.warning("block-scaled FP8 GEMM (F.scaled_mm) disagrees with the reference on cuda:%d (relative "
                    "error %.3g), using the Triton kernel", index, err)
        return False
    return True
