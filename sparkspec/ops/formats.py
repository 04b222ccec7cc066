"""The FP8 / FP4 block formats of DeepSeek-V4 checkpoints: block sizes, scale shapes, dequantisation.

* FP8 e4m3 weights with one scale per 128×128 block (`.scale` as e8m0 / fp32, or `weight_scale_inv`):
  W = w · scale[block].
* FP4 e2m1 experts packed two per byte (low nibble first) with one e8m0 scale per 1×32 block.

Also the forms a model keeps when it computes on quantised weights (`sparkspec.loading.quantized`): FP8 block
scales as fp32, FP4 scales as raw e8m0 exponent bytes (`e8m0_bytes`), and `Quantized`, the pair a loader hands
over instead of a dequantised tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
# e2m1 code -> value; low nibble is the first element
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


class Quantized(NamedTuple):
    """A weight kept in its checkpoint format: FP8 `data` [out, in] float8_e4m3fn with fp32 `scale`
    [ceil(out/128), ceil(in/128)], or FP4 `data` [out, in/2] uint8 (e2m1 pairs) with `scale` [out, in/32]
    uint8 (e8m0 exponents)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def is_fp4(self) -> bool:
        return self.data.dtype == torch.uint8

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dequantised tensor (FP4: two values a byte)."""
        *lead, last = self.data.shape
        return (*lead, last * 2) if self.is_fp4 else (*lead, last)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> `dtype` [..., out, in]; FP4 stacks [E, out, in/2] too (its rows are independent)."""
        if self.is_fp4:
            rows = dequant_fp4(self.data.reshape(-1, self.data.shape[-1]),
                               self.scale.reshape(-1, self.scale.shape[-1]), dtype=dtype)
            return rows.view(self.shape)
        if self.data.dim() == 2:
            return dequant_fp8_block(self.data, self.scale, dtype=dtype)
        return torch.stack([dequant_fp8_block(d, s, dtype=dtype) for d, s in zip(self.data, self.scale)])


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:  # raw e8m0 exponent bytes
        return torch.exp2(scale.float() - 127)
    return scale.float()


def e8m0_bytes(scale: torch.Tensor, name: str = "") -> torch.Tensor:
    """Block scales as e8m0 exponent bytes (uint8, value 2^(byte - 127)): e8m0 and uint8 scales as they are,
    float scales only when every one is a power of two in e8m0's range (else a ValueError naming the tensor)."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    exp = torch.log2(scale.float()).round()
    if not (torch.exp2(exp) == scale.float()).all() or exp.min() < -127 or exp.max() > 127:
        raise ValueError(f"tensor '{name}': FP4 scales are not all powers of two; they cannot be kept as e8m0")
    return (exp + 127).to(torch.uint8)


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
