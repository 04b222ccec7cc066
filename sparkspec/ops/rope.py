"""Row-wise RMS norm and rotary embedding (RoPE): the elementwise chains around attention's projections.

Legend: T tokens, F row width (the last dim), R rotary dims (the last R of F), N rows (T times the dims between).
Each op is one launch where a kernel is registered (`triton_kernels/rope.py`): upcast, normalise, rotate and
round once, instead of a cast, a norm, a cast back, a complex multiply and a concatenation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparkspec.ops.registry import native


@native("rms_norm")
def rms_norm(
    x: torch.Tensor,  # [..., F]
    weight: torch.Tensor | None,  # [F] (None: unweighted)
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight in fp32 -> [..., F] out_dtype (default x.dtype), rounded once."""
    w = None if weight is None else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(out_dtype or x.dtype)


@native("rope")
def rope(
    x: torch.Tensor,  # [T, ..., F] the rotary dims last
    rot: torch.Tensor,  # [T, R/2] complex64: e^{i·pos·freq} of each token
    inverse: bool = False,  # rotate by the conjugate (undo a rotation)
    norm_weight: torch.Tensor | None = None,  # [F] weight of the RMS norm taken first (when norm_eps is set)
    norm_eps: float | None = None,  # set: RMS-normalise each row over F first (fp32, no rounding in between)
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,  # [S, F] a pool (x [T, F]): the rows are written to out[out_rows] instead
    out_rows: torch.Tensor | None = None,  # [T] rows of out
) -> torch.Tensor:
    """GPT-J (interleaved pairs) RoPE on the last R = 2·rot.shape[1] features of x: each pair (even, odd) is the
    complex number even + i·odd, multiplied by rot (or its conjugate). Optionally after an RMS norm of the whole
    row. The other features pass through. fp32 arithmetic -> [T, ..., F] out_dtype (default x.dtype); with `out`, the
    rows written to out[out_rows] in out's dtype (one launch for the projection's norm, rotation and cache write where
    a kernel is registered) -> out."""
    y = x.float() if norm_eps is None else rms_norm(x, norm_weight, norm_eps, torch.float32)
    R = 2 * rot.shape[-1]
    rot = rot.conj() if inverse else rot
    rot = rot.view([rot.shape[0]] + [1] * (x.dim() - 2) + [rot.shape[1]])
    pairs = torch.view_as_complex(y[..., -R:].unflatten(-1, (-1, 2)).contiguous())  # [T, ..., R/2]
    rotated = torch.view_as_real(pairs * rot).flatten(-2)
    y = torch.cat([y[..., :-R], rotated], dim=-1)
    if out is not None:  # the cache write: rounded once, to the pool's dtype
        return out.index_copy_(0, out_rows, y.to(out.dtype))
    return y.to(out_dtype or x.dtype)
