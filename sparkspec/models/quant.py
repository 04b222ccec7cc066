"""Dequantisation of DeepSeek-V4 checkpoint formats at load time.

* FP8 e4m3 weights with one scale per 128×128 block (`.scale` as e8m0 / fp32, or `weight_scale_inv`):
  W = w · scale[block].
* FP4 e2m1 experts packed two per byte (low nibble first) with one e8m0 scale per 1×32 block.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
# e2m1 code -> value; low nibble is the first element
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:  # raw e8m0 exponent bytes
        return torch.exp2(scale.float() - 127)
    return scale.float()


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Block-scale shape of an FP8 weight [out, in]: one scale per 128x128 block, the last ones ragged.
    Separate from the dequantisation so that a loader can check it from the file header, before reading data."""
    out, inn = shape
    return (out + FP8_BLOCK - 1) // FP8_BLOCK, (inn + FP8_BLOCK - 1) // FP8_BLOCK


def fp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Scale shape of an FP4 weight whose unpacked shape is [out, in]: one scale per 1x32 block."""
    out, inn = shape
    return out, (inn + FP4_BLOCK - 1) // FP4_BLOCK


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, name: str = "",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [out, in] float8_e4m3fn, scale [ceil(out/128), ceil(in/128)] -> `dtype` [out, in]. The product is
    formed in fp32 and rounded once, so any `dtype` equals dequantising to fp32 and casting afterwards."""
    out, inn = w.shape
    need = fp8_scale_shape(w.shape)
    if tuple(scale.shape) != need:
        raise ValueError(f"tensor '{name}': FP8 block scale has shape {tuple(scale.shape)}, expected {need}")
    s = scale_to_float(scale).repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inn]
    return s.mul_(w.float()).to(dtype)  # in place into the expanded scale: one fp32 temporary less


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/2] int8/uint8 (two e2m1 codes per byte, low nibble first) -> fp32 [out, in]."""
    b = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    if b.dtype != torch.uint8:
        b = b.view(torch.uint8)
    lo, hi = (b & 0x0F).long(), (b >> 4).long()
    vals = FP4_VALUES.to(packed.device)
    return torch.stack([vals[lo], vals[hi]], dim=-1).flatten(-2)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, name: str = "",
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [out, in/2] + e8m0 scales [out, in/32] -> `dtype` [out, in] (fp32 product, rounded once)."""
    w = unpack_fp4(packed)
    inn = w.shape[1]
    need = fp4_scale_shape(w.shape)
    if tuple(scale.shape) != need:
        raise ValueError(f"tensor '{name}': FP4 block scale has shape {tuple(scale.shape)}, expected {need}")
    return w.mul_(scale_to_float(scale).repeat_interleave(FP4_BLOCK, 1)[:, :inn]).to(dtype)


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse (power-of-two block scales), used to write test checkpoints."""
    out, inn = w.shape
    bo, bi = (out + FP8_BLOCK - 1) // FP8_BLOCK, (inn + FP8_BLOCK - 1) // FP8_BLOCK
    pad = torch.zeros(bo * FP8_BLOCK, bi * FP8_BLOCK)
    pad[:out, :inn] = w.float()
    blocks = pad.view(bo, FP8_BLOCK, bi, FP8_BLOCK).abs().amax(dim=(1, 3)).clamp(min=1e-8)
    scale = torch.exp2(torch.ceil(torch.log2(blocks / 448.0)))
    s = scale.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inn]
    return (w.float() / s).to(torch.float8_e4m3fn), scale


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest e2m1 code with power-of-two 1×32 scales -> (packed uint8 [out, in/2], e8m0 uint8 scales)."""
    out, inn = w.shape
    blocks = w.float().view(out, inn // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=1e-8)
    exp = torch.ceil(torch.log2(amax / 6.0))
    scale = torch.exp2(exp)
    scaled = (blocks / scale.unsqueeze(-1)).view(out, inn)
    codes = (scaled.unsqueeze(-1) - FP4_VALUES).abs().argmin(-1).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8)
